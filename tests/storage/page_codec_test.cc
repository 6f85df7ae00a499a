#include "storage/page_codec.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace ctxcache::storage {
namespace {

std::string RandomPayload(DType dtype, uint32_t n_tokens, uint32_t head_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> f(2 * size_t{n_tokens} * head_dim);
  for (size_t i = 0; i < f.size(); ++i) f[i] = g(rng) * (1.0f + (i % head_dim == 3 ? 20.0f : 0.0f));
  std::string raw(f.size() * DTypeSize(dtype), '\0');
  ConvertFromFloat(dtype, f.data(), raw.data(), f.size());
  return raw;
}

class PageCodecRoundTrip : public ::testing::TestWithParam<std::tuple<DType, PageCodec>> {};

TEST_P(PageCodecRoundTrip, DecodesToTheSameBytes) {
  auto [dtype, codec] = GetParam();
  for (uint32_t n_tokens : {16u, 5u, 1u}) {
    PageShape shape{dtype, n_tokens, 64};
    std::string raw = RandomPayload(dtype, n_tokens, 64, n_tokens);
    std::string enc;
    ASSERT_TRUE(EncodePage({codec, 3}, shape, raw, &enc).ok());
    PageHeader h;
    std::vector<uint8_t> out(raw.size());
    Status s = DecodePage(enc, out.data(), out.size(), &h);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(h.codec, codec);
    EXPECT_EQ(h.shape.dtype, dtype);
    EXPECT_EQ(h.shape.n_tokens, n_tokens);
    EXPECT_EQ(h.shape.head_dim, 64u);
    EXPECT_EQ(0, std::memcmp(out.data(), raw.data(), raw.size()));
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypesAndCodecs, PageCodecRoundTrip,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kF16,
                                                              DType::kBF16),
                                            ::testing::Values(PageCodec::kNone, PageCodec::kZstd,
                                                              PageCodec::kZstdShuffle)));

TEST(PageCodecTest, EveryFlippedBitIsDataLoss) {
  for (PageCodec codec : {PageCodec::kNone, PageCodec::kZstd, PageCodec::kZstdShuffle}) {
    PageShape shape{DType::kBF16, 16, 32};
    std::string raw = RandomPayload(DType::kBF16, 16, 32, 7);
    std::string enc;
    ASSERT_TRUE(EncodePage({codec, 1}, shape, raw, &enc).ok());
    std::vector<uint8_t> out(raw.size());
    // Flip one bit in every byte position (header and body).
    for (size_t i = 0; i < enc.size(); ++i) {
      std::string bad = enc;
      bad[i] = static_cast<char>(bad[i] ^ (1 << (i % 8)));
      PageHeader h;
      Status s = DecodePage(bad, out.data(), out.size(), &h);
      if (s.ok() && codec != PageCodec::kNone) {
        // A flip in a zstd frame field that does not change the output
        // (e.g. a window size hint) is harmless; the bytes must be intact.
        ASSERT_EQ(0, std::memcmp(out.data(), raw.data(), raw.size())) << "byte " << i;
        continue;
      }
      ASSERT_EQ(s.code(), StatusCode::kDataLoss)
          << PageCodecName(codec) << " byte " << i << ": " << s.ToString();
    }
  }
}

// The writer's no-copy path writes the same bytes as EncodePage(kNone).
TEST(PageCodecTest, RawPageInPlaceEqualsEncodePageNone) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (uint32_t n_tokens : {16u, 5u, 1u}) {
      PageShape shape{dtype, n_tokens, 64};
      std::string raw = RandomPayload(dtype, n_tokens, 64, 7 * n_tokens);
      std::string want;
      ASSERT_TRUE(EncodePage({PageCodec::kNone, 1}, shape, raw, &want).ok());
      std::string buf(kPageHeaderSize, 'x');
      buf += raw;
      auto got = EncodeRawPageInPlace(shape, buf.data());
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(got->data(), buf.data());
      EXPECT_EQ(std::string(*got), want);
      std::vector<uint8_t> out(raw.size());
      PageHeader h;
      ASSERT_TRUE(DecodePage(*got, out.data(), out.size(), &h).ok());
      EXPECT_EQ(std::memcmp(out.data(), raw.data(), raw.size()), 0);
    }
  }
  std::string buf(kPageHeaderSize + 64, '\0');
  EXPECT_EQ(EncodeRawPageInPlace(PageShape{DType::kBF16, 0, 16}, buf.data()).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(PageCodecTest, RejectsBadShapes) {
  std::string enc;
  std::string raw(100, 'x');
  EXPECT_EQ(EncodePage({}, PageShape{DType::kBF16, 16, 64}, raw, &enc).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodePage({}, PageShape{DType::kBF16, 0, 64}, "", &enc).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(enc.empty());
  PageHeader h;
  EXPECT_EQ(DecodePage("abc", nullptr, 0, &h).code(), StatusCode::kDataLoss);
}

TEST(PageCodecTest, ShuffleIsInvertibleForEveryElementSize) {
  std::vector<uint8_t> src(96), mid(96), back(96);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  for (size_t es : {1, 2, 4}) {
    ShuffleBytes(src.data(), mid.data(), src.size() / es, es);
    UnshuffleBytes(mid.data(), back.data(), src.size() / es, es);
    EXPECT_EQ(src, back);
  }
  // Byte planes: element i's byte 1 goes to plane 1.
  ShuffleBytes(src.data(), mid.data(), 48, 2);
  EXPECT_EQ(mid[48], src[1]);
}

TEST(PageCodecTest, ShuffleCompressesBf16BetterThanPlainZstd) {
  PageShape shape{DType::kBF16, 16, 128};
  std::string raw = RandomPayload(DType::kBF16, 16, 128, 3);
  std::string plain, shuffled;
  ASSERT_TRUE(EncodePage({PageCodec::kZstd, 1}, shape, raw, &plain).ok());
  ASSERT_TRUE(EncodePage({PageCodec::kZstdShuffle, 1}, shape, raw, &shuffled).ok());
  EXPECT_LT(shuffled.size(), plain.size());
  EXPECT_LT(shuffled.size(), raw.size());
}

}  // namespace
}  // namespace ctxcache::storage
