#include "index/topk.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace ctxcache::index {
namespace {

std::vector<int32_t> BruteTopK(const std::vector<float>& s, int64_t k) {
  std::vector<int32_t> ids(s.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
  ids.resize(std::min<int64_t>(k, ids.size()));
  return ids;
}

TEST(TopKTest, MatchesBruteForceIncludingTiesAndLargeN) {
  std::mt19937_64 rng(1);
  for (int64_t n : {1, 7, 100, 5000, 20000, 200000}) {
    for (int quantize : {0, 1}) {
      std::vector<float> s(n);
      std::normal_distribution<float> g(0, 1);
      for (auto& v : s) v = quantize ? std::round(g(rng) * 4) : g(rng);  // many ties
      for (int64_t k : {int64_t{1}, n / 20 + 1, n / 3 + 1, n}) {
        auto want = BruteTopK(s, k);
        std::vector<int32_t> got;
        SelectTopK(s.data(), n, k, TopKOrder::kByScore, &got);
        EXPECT_EQ(got, want) << "n=" << n << " k=" << k;
        std::sort(want.begin(), want.end());
        SelectTopK(s.data(), n, k, TopKOrder::kById, &got);
        EXPECT_EQ(got, want) << "n=" << n << " k=" << k;
        TopKScratch scratch;
        SelectTopK(s.data(), n, k, TopKOrder::kAny, &got, &scratch);
        std::sort(got.begin(), got.end());
        EXPECT_EQ(got, want);
      }
    }
  }
}

// The digits start below the bits all keys share: narrow ranges (the
// csa accumulators are sums of similar list scores), a single value, both
// signs and ±0, infinities, and keys that differ only in the last bit.
TEST(TopKTest, NarrowClusteredAndExtremeRanges) {
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<float> u(0, 1);
  std::vector<std::vector<float>> cases;
  std::vector<float> narrow(30000);
  for (auto& v : narrow) v = 1.0f + u(rng) * 1e-4f;
  cases.push_back(narrow);
  cases.push_back(std::vector<float>(5000, 3.5f));
  std::vector<float> signs(4000);
  for (size_t i = 0; i < signs.size(); ++i) {
    signs[i] = i % 7 == 0 ? 0.0f : i % 7 == 1 ? -0.0f : (u(rng) - 0.5f) * 1e-30f;
  }
  signs[17] = std::numeric_limits<float>::infinity();
  signs[18] = -std::numeric_limits<float>::infinity();
  cases.push_back(signs);
  std::vector<float> last_bit(3000);
  for (size_t i = 0; i < last_bit.size(); ++i) {
    last_bit[i] = std::nextafter(2.0f, i % 3 == 0 ? 3.0f : 1.0f);
  }
  cases.push_back(last_bit);
  std::vector<float> clustered(40000);  // 3 values for most, a spread tail
  for (size_t i = 0; i < clustered.size(); ++i) {
    clustered[i] = i % 10 < 7 ? 0.25f * static_cast<float>(i % 3) : 0.7f + u(rng);
  }
  cases.push_back(clustered);
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto& s = cases[c];
    const int64_t n = static_cast<int64_t>(s.size());
    for (int64_t k : {int64_t{1}, n / 20 + 1, n / 3 + 1, n - 1}) {
      std::vector<int32_t> got;
      SelectTopK(s.data(), n, k, TopKOrder::kByScore, &got);
      auto want = BruteTopK(s, k);
      // Brute force orders -0 and +0 by id already (they compare equal).
      EXPECT_EQ(got, want) << "case " << c << " k=" << k;
    }
  }
}

TEST(TopKTest, AdversarialSampleFallsBackToExact) {
  // The strided sample (stride n/1024 = 97) sees only the rare large values,
  // so its threshold keeps fewer than k candidates and the exact path runs.
  const int64_t n = 97 * 1024;
  std::vector<float> s(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) s[i] = (i % 97 == 0) ? 100.0f : static_cast<float>(i % 13);
  std::vector<int32_t> got;
  SelectTopK(s.data(), n, 5000, TopKOrder::kByScore, &got);
  EXPECT_EQ(got, BruteTopK(s, 5000));
}

TEST(TopKTest, AmongAndSetHelpers) {
  std::vector<float> s = {5, 1, 9, 3, 7, 2};
  std::vector<int32_t> got;
  SelectTopKAmong(s.data(), {1, 3, 5, 0}, 2, TopKOrder::kByScore, &got);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(UnionSorted({1, 3, 5}, {2, 3, 6}), (std::vector<int32_t>{1, 2, 3, 5, 6}));
  EXPECT_EQ(IntersectionSize({1, 3, 5, 7}, {3, 4, 5}), 2);
  std::vector<int32_t> v = {5, 1, 5, 3, 1};
  SortUnique(&v);
  EXPECT_EQ(v, (std::vector<int32_t>{1, 3, 5}));
  SelectTopK(s.data(), 6, 0, TopKOrder::kById, &got);
  EXPECT_TRUE(got.empty());
}

}  // namespace
}  // namespace ctxcache::index
