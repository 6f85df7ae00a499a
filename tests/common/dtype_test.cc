#include "common/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace ctxcache {
namespace {

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("fp16"), DType::kF16);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
  auto bad = ParseDType("int8");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int8"), std::string_view::npos);
}

// Found by fuzz/fuzz_trace: a .ctxtrace payload (and a safetensors tensor)
// may start at an odd offset, and the element-wise tail of the 16-bit
// conversions loaded it as uint16_t (misaligned load: UBSan reports it in the
// sanitizer unit run). Every length hits the tail; src is odd on purpose.
TEST(DTypeTest, ConvertToFloatReadsUnalignedSource) {
  const std::vector<float> want = {1.0f, -2.0f, 0.5f, 3.0f, -0.25f, 8.0f, 16.0f, -1.0f,
                                   2.0f, 4.0f,  -8.0f, 0.125f};
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (size_t n = 1; n <= want.size(); ++n) {
      std::vector<char> raw(1 + 2 * n);
      std::vector<uint16_t> bits(n);
      ConvertFromFloat(dtype, want.data(), bits.data(), n);
      std::memcpy(raw.data() + 1, bits.data(), 2 * n);
      std::vector<float> got(n);
      ConvertToFloat(dtype, raw.data() + 1, got.data(), n);
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(got[i], want[i]) << DTypeName(dtype) << " " << n;
    }
  }
}

TEST(Bf16Test, ExactValuesRoundTrip) {
  for (float x : {0.0f, -0.0f, 1.0f, -2.5f, 1024.0f, 0.15625f}) {
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(x)), x) << x;
  }
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
}

TEST(Bf16Test, RoundsToNearestEven) {
  // 1.0 = 0x3F800000. Halfway above 1.0 (lsb of bf16 is 0): rounds down to even.
  EXPECT_EQ(FloatToBf16(FromBits(0x3F808000u)), 0x3F80);
  // Halfway above 0x3F81 (odd): rounds up to 0x3F82.
  EXPECT_EQ(FloatToBf16(FromBits(0x3F818000u)), 0x3F82);
  // Just above halfway rounds up, just below rounds down.
  EXPECT_EQ(FloatToBf16(FromBits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(FloatToBf16(FromBits(0x3F807FFFu)), 0x3F80);
  // Rounding carries into the exponent; the max finite float rounds to Inf.
  EXPECT_EQ(FloatToBf16(FromBits(0x3FFFFFFFu)), 0x4000);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);
}

TEST(Bf16Test, NanInfSubnormal) {
  float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBf16(inf), 0x7F80);
  EXPECT_EQ(FloatToBf16(-inf), 0xFF80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  // A NaN whose payload lives only in the low 16 bits must stay NaN.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0x7F800001u)))));
  // Subnormals keep their value when representable.
  float sub = FromBits(0x00010000u);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(sub)), sub);
  EXPECT_EQ(FloatToBf16(FromBits(0x00008000u)), 0x0000);  // tie to even -> 0
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)), 0x0002);  // tie to even -> up
}

TEST(Fp16Test, KnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // overflows to Inf (round to even)
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  // Smallest subnormal 2^-24 and the round-to-even tie below it.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -24)), 0x0002);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  // 1 + 2^-11 is a tie between 1 and 1+2^-10: rounds to even (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
}

TEST(Fp16Test, AllHalfValuesRoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

TEST(DTypeBulkTest, BulkMatchesScalar) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const size_t n = 1037;  // not a multiple of the vector width
  std::vector<float> src(n);
  for (auto& x : src) x = dist(rng);
  src[5] = std::numeric_limits<float>::infinity();
  src[17] = std::nanf("");
  src[33] = FromBits(0x00018000u);
  std::vector<uint16_t> bf(n), hf(n);
  FloatToBf16(src.data(), bf.data(), n);
  FloatToHalf(src.data(), hf.data(), n);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(bf[i], FloatToBf16(src[i])) << i;
    EXPECT_EQ(hf[i], FloatToHalf(src[i])) << i;
  }
  std::vector<float> back(n);
  Bf16ToFloat(bf.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(src[i])) {
      EXPECT_TRUE(std::isnan(back[i]));
      continue;
    }
    EXPECT_EQ(Bits(back[i]), static_cast<uint32_t>(bf[i]) << 16);
    if (std::isnormal(src[i])) {  // subnormals lose relative precision by design
      EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 128.0f);
    }
  }
  HalfToFloat(hf.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) {
    if (std::isfinite(src[i])) {
      EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 1024.0f + 1e-7f);
    }
  }
}

TEST(DTypeBulkTest, ConvertDispatchAndNonFinite) {
  std::vector<float> src = {1.0f, -0.5f, 3.25f, 0.0f, 7.0f, 8.0f, 9.0f, 10.0f, 11.0f};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<uint8_t> buf(src.size() * DTypeSize(dt));
    ConvertFromFloat(dt, src.data(), buf.data(), src.size());
    std::vector<float> back(src.size());
    ConvertToFloat(dt, buf.data(), back.data(), src.size());
    EXPECT_EQ(back, src) << DTypeName(dt);
  }
  EXPECT_FALSE(HasNonFinite(src.data(), src.size()));
  src[8] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(HasNonFinite(src.data(), src.size()));
  src[8] = 0.0f;
  src[2] = std::nanf("");
  EXPECT_TRUE(HasNonFinite(src.data(), src.size()));
}

TEST(DTypeBulkTest, NonFiniteAsStored) {
  std::vector<float> src(300);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 0.25f * static_cast<float>(i) - 30.0f;
  src[7] = std::numeric_limits<float>::max();  // finite in f32, Inf in f16
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<float> x = src;
    if (dt == DType::kF16) x[7] = 65504.0f;  // f16's largest finite
    if (dt == DType::kBF16) x[7] = 3.0e38f;  // FLT_MAX rounds to Inf in bf16
    std::vector<uint8_t> buf(x.size() * DTypeSize(dt) + 1);
    // At an odd offset: stored bytes need no alignment.
    ConvertFromFloat(dt, x.data(), buf.data() + 1, x.size());
    EXPECT_FALSE(HasNonFinite(dt, buf.data() + 1, x.size())) << DTypeName(dt);
    const float inf = std::numeric_limits<float>::infinity();
    for (float bad : {inf, -inf, std::nanf("")}) {
      std::vector<float> y = x;
      y[299] = bad;
      ConvertFromFloat(dt, y.data(), buf.data() + 1, y.size());
      EXPECT_TRUE(HasNonFinite(dt, buf.data() + 1, y.size())) << DTypeName(dt) << " " << bad;
    }
  }
}

}  // namespace
}  // namespace ctxcache
