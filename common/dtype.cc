#include "common/dtype.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ctxcache {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "unknown";
}

bool IsValidDType(int value) { return value >= 0 && value <= 2; }

StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::kF16;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  return InvalidArgumentError("unknown dtype '" + std::string(name) +
                              "'; expected one of f32, f16, bf16");
}

namespace {
inline uint32_t FloatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
}  // namespace

uint16_t FloatToBf16(float x) {
  uint32_t u = FloatBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t x) { return BitsFloat(static_cast<uint32_t>(x) << 16); }

uint16_t FloatToHalf(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

float HalfToFloat(uint16_t x) { return _cvtsh_ss(x); }

void FloatToBf16(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  const __m256i kAbsMask = _mm256_set1_epi32(0x7fffffff);
  const __m256i kInf = _mm256_set1_epi32(0x7f800000);
  const __m256i kBias = _mm256_set1_epi32(0x7fff);
  const __m256i kOne = _mm256_set1_epi32(1);
  const __m256i kQuiet = _mm256_set1_epi32(0x00400000);
  for (; i + 16 <= n; i += 16) {
    __m256i out[2];
    for (int h = 0; h < 2; ++h) {
      __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8 * h));
      __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, kAbsMask), kInf);
      __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), kOne);
      __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(kBias, lsb));
      __m256i nan_val = _mm256_or_si256(u, kQuiet);
      __m256i r = _mm256_blendv_epi8(rounded, nan_val, is_nan);
      out[h] = _mm256_srli_epi32(r, 16);
    }
    // packus works per 128-bit lane: [a0..a3 b0..b3 | a4..a7 b4..b7] -> fix order.
    __m256i packed = _mm256_packus_epi32(out[0], out[1]);
    packed = _mm256_permute4x64_epi64(packed, 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  for (; i < n; ++i) {
    const uint16_t v = FloatToBf16(src[i]);  // dst may be unaligned (stored bytes)
    std::memcpy(reinterpret_cast<char*>(dst) + 2 * i, &v, 2);
  }
}

void Bf16ToFloat(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
  }
  for (; i < n; ++i) {
    uint16_t v;  // src may be unaligned (bytes from a file): no uint16_t load
    std::memcpy(&v, reinterpret_cast<const char*>(src) + 2 * i, 2);
    dst[i] = Bf16ToFloat(v);
  }
}

void FloatToHalf(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) {
    const uint16_t v = FloatToHalf(src[i]);  // dst may be unaligned (stored bytes)
    std::memcpy(reinterpret_cast<char*>(dst) + 2 * i, &v, 2);
  }
}

void HalfToFloat(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) {
    uint16_t v;  // src may be unaligned (bytes from a file): no uint16_t load
    std::memcpy(&v, reinterpret_cast<const char*>(src) + 2 * i, 2);
    dst[i] = HalfToFloat(v);
  }
}

void ConvertToFloat(DType dtype, const void* src, float* dst, size_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16:
      HalfToFloat(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::kBF16:
      Bf16ToFloat(static_cast<const uint16_t*>(src), dst, n);
      return;
  }
}

void ConvertFromFloat(DType dtype, const float* src, void* dst, size_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16:
      FloatToHalf(src, static_cast<uint16_t*>(dst), n);
      return;
    case DType::kBF16:
      FloatToBf16(src, static_cast<uint16_t*>(dst), n);
      return;
  }
}

bool HasNonFinite(const float* x, size_t n) {
  size_t i = 0;
  const __m256i kExp = _mm256_set1_epi32(0x7f800000);
  __m256i acc = _mm256_setzero_si256();
  for (; i + 8 <= n; i += 8) {
    __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    acc = _mm256_or_si256(acc, _mm256_cmpeq_epi32(_mm256_and_si256(u, kExp), kExp));
  }
  if (!_mm256_testz_si256(acc, acc)) return true;
  for (; i < n; ++i) {
    if (!std::isfinite(x[i])) return true;
  }
  return false;
}

bool HasNonFinite(DType dtype, const void* x, size_t n) {
  if (dtype == DType::kF32) {
    const auto* b = static_cast<const uint8_t*>(x);
    float buf[256];
    for (size_t i = 0; i < n; i += 256) {
      const size_t m = std::min<size_t>(256, n - i);
      std::memcpy(buf, b + i * 4, m * 4);
      if (HasNonFinite(buf, m)) return true;
    }
    return false;
  }
  // bf16: 8 exponent bits (0x7f80); f16: 5 (0x7c00). All ones: Inf or NaN.
  const uint16_t exp = dtype == DType::kBF16 ? 0x7f80 : 0x7c00;
  const auto* b = static_cast<const uint8_t*>(x);
  uint16_t hit = 0;
  for (size_t i = 0; i < n; ++i) {
    uint16_t u;
    std::memcpy(&u, b + 2 * i, 2);
    hit |= static_cast<uint16_t>((u & exp) == exp);
  }
  return hit != 0;
}

}  // namespace ctxcache
