#include "common/crc32c.h"

#include <nmmintrin.h>

#include <cstring>

namespace ctxcache::crc32c {
namespace {

// The crc32 instruction has a latency of 3 cycles and a throughput of 1, so
// large buffers are cut into three interleaved streams whose crcs are
// combined with a "shift by n zero bytes" operator (the method of Mark
// Adler's crc32c.c): a 4 x 256 table per stream length applies it.
constexpr size_t kLong = 2048;  // stream lengths; powers of two
constexpr size_t kShort = 256;
constexpr uint32_t kPoly = 0x82F63B78;  // reflected CRC-32C polynomial

uint32_t Gf2MatrixTimes(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec != 0) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}

void Gf2MatrixSquare(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = Gf2MatrixTimes(mat, mat[n]);
}

// The operator that appends `len` zero bytes (len a power of two) to a raw
// crc register, as a 32 x 32 GF(2) matrix.
void ZerosOperator(uint32_t* even, size_t len) {
  uint32_t odd[32];
  odd[0] = kPoly;  // one zero bit
  uint32_t row = 1;
  for (int n = 1; n < 32; ++n) {
    odd[n] = row;
    row <<= 1;
  }
  Gf2MatrixSquare(even, odd);  // two zero bits
  Gf2MatrixSquare(odd, even);  // four zero bits
  // Each square doubles the zeros: the first gives one zero byte in `even`.
  do {
    Gf2MatrixSquare(even, odd);
    len >>= 1;
    if (len == 0) return;
    Gf2MatrixSquare(odd, even);
    len >>= 1;
  } while (len != 0);
  for (int n = 0; n < 32; ++n) even[n] = odd[n];
}

struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(size_t len) {
    uint32_t op[32];
    ZerosOperator(op, len);
    for (uint32_t n = 0; n < 256; ++n) {
      t[0][n] = Gf2MatrixTimes(op, n);
      t[1][n] = Gf2MatrixTimes(op, n << 8);
      t[2][n] = Gf2MatrixTimes(op, n << 16);
      t[3][n] = Gf2MatrixTimes(op, n << 24);
    }
  }
  uint32_t Shift(uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

const ShiftTable& LongShift() {
  static const ShiftTable table(kLong);
  return table;
}
const ShiftTable& ShortShift() {
  static const ShiftTable table(kShort);
  return table;
}

uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Three streams of `len` bytes each from p; returns the raw crc of all 3*len.
uint64_t ThreeStreams(uint64_t crc0, const uint8_t* p, size_t len, const ShiftTable& shift) {
  uint64_t crc1 = 0, crc2 = 0;
  for (const uint8_t* end = p + len; p < end; p += 8) {
    crc0 = _mm_crc32_u64(crc0, Load64(p));
    crc1 = _mm_crc32_u64(crc1, Load64(p + len));
    crc2 = _mm_crc32_u64(crc2, Load64(p + 2 * len));
  }
  crc0 = shift.Shift(static_cast<uint32_t>(crc0)) ^ crc1;
  return shift.Shift(static_cast<uint32_t>(crc0)) ^ crc2;
}

}  // namespace

uint32_t Extend(uint32_t init_crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t crc = ~init_crc;
  if (n >= 3 * kShort) {
    const ShiftTable& long_shift = LongShift();
    for (; n >= 3 * kLong; p += 3 * kLong, n -= 3 * kLong) {
      crc = ThreeStreams(crc, p, kLong, long_shift);
    }
    const ShiftTable& short_shift = ShortShift();
    for (; n >= 3 * kShort; p += 3 * kShort, n -= 3 * kShort) {
      crc = ThreeStreams(crc, p, kShort, short_shift);
    }
  }
  for (; n >= 8; p += 8, n -= 8) crc = _mm_crc32_u64(crc, Load64(p));
  auto c32 = static_cast<uint32_t>(crc);
  for (; n > 0; --n) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

}  // namespace ctxcache::crc32c
