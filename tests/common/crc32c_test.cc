#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ctxcache {
namespace {

// Test vectors from RFC 3720 (iSCSI) appendix B.4 and the usual check value.
TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(crc32c::Value("123456789"), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(crc32c::Value(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c::Value(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c::Value(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c::Value(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(crc32c::Value("", 0), 0u);
}

TEST(Crc32cTest, ExtendEqualsWhole) {
  std::string s = "the quick brown fox jumps over the lazy dog, twice over";
  for (size_t split = 0; split <= s.size(); ++split) {
    uint32_t a = crc32c::Extend(0, s.data(), split);
    EXPECT_EQ(crc32c::Extend(a, s.data() + split, s.size() - split), crc32c::Value(s));
  }
}

TEST(Crc32cTest, DetectsSingleBitFlip) {
  std::string s(4096, 'x');
  uint32_t base = crc32c::Value(s);
  for (size_t byte : {0ul, 7ul, 2048ul, 4095ul}) {
    std::string t = s;
    t[byte] ^= 0x10;
    EXPECT_NE(crc32c::Value(t), base);
  }
}

// Bitwise reference (RFC 3720 polynomial, reflected).
uint32_t ReferenceCrc32c(const uint8_t* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

// Lengths around the three-stream thresholds (3 x 256 and 3 x 2048 bytes),
// pages (8 KiB + header), unaligned starts and split points.
TEST(Crc32cTest, ThreeStreamPathMatchesBitwiseReference) {
  std::vector<uint8_t> buf(3 * 2048 * 3 + 64);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : buf) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  for (size_t n :
       {767ul, 768ul, 769ul, 1536ul, 6143ul, 6144ul, 6151ul, 8192ul, 8208ul, 12288ul, 18000ul}) {
    for (size_t offset : {0ul, 1ul, 5ul}) {
      const uint8_t* p = buf.data() + offset;
      const uint32_t want = ReferenceCrc32c(p, n);
      EXPECT_EQ(crc32c::Value(p, n), want) << n << " at +" << offset;
      for (size_t split : {size_t{3}, n / 3, n - 1}) {
        EXPECT_EQ(crc32c::Extend(crc32c::Value(p, split), p + split, n - split), want)
            << n << " split " << split;
      }
    }
  }
}

}  // namespace
}  // namespace ctxcache
