// Oracle and full selectors, the registry, ParseParams and ArrayKeySource.
#include "index/oracle.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "index/methods.h"
#include "index/selector.h"

namespace ctxcache::index {
namespace {

// A KeySource that is not an ArrayKeySource (exercises the GatherKeys path).
class CopyingKeySource final : public KeySource {
 public:
  CopyingKeySource(const float* k, int64_t n, int d) : inner_(k, n, d) {}
  int64_t n_tokens() const override { return inner_.n_tokens(); }
  int head_dim() const override { return inner_.head_dim(); }
  Status GatherKeys(const int32_t* ids, int64_t n, float* out) const override {
    return inner_.GatherKeys(ids, n, out);
  }

 private:
  ArrayKeySource inner_;
};

TEST(OracleTest, MatchesBruteForceTopK) {
  const int64_t n = 10000;
  const int d = 16, G = 3;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> keys(n * d), q(G * d);
  for (auto& v : keys) v = g(rng);
  for (auto& v : q) v = g(rng);
  HeadPrefill p;
  p.n_tokens = n;
  p.head_dim = d;
  p.keys = keys.data();
  auto sel = BuildSelector("oracle", p, {{"rho", "0.03"}});
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  ArrayKeySource array(keys.data(), n, d);
  CopyingKeySource copying(keys.data(), n, d);
  for (const KeySource* ks :
       {static_cast<const KeySource*>(&array), static_cast<const KeySource*>(&copying)}) {
    SelectInput in;
    in.queries = q.data();
    in.n_queries = G;
    in.keys = ks;
    Selection out;
    WorkStats stats;
    ASSERT_TRUE((*sel)->Select(in, &out, &stats).ok());
    ASSERT_EQ(out.per_head.size(), static_cast<size_t>(G));
    std::vector<int32_t> merged;
    for (int h = 0; h < G; ++h) {
      std::vector<std::pair<double, int32_t>> s;
      for (int64_t i = 0; i < n; ++i) {
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += q[h * d + j] * keys[i * d + j];
        s.emplace_back(-dot, static_cast<int32_t>(i));
      }
      std::sort(s.begin(), s.end());
      std::vector<int32_t> want;
      for (int i = 0; i < 300; ++i) want.push_back(s[i].second);  // ceil(0.03 * 10000)
      std::sort(want.begin(), want.end());
      EXPECT_EQ(out.per_head[h], want);
      // Logit estimates for the page cap: exact q.k / sqrt(d), per selected token.
      ASSERT_EQ(out.per_head_logits.size(), static_cast<size_t>(G));
      ASSERT_EQ(out.per_head_logits[h].size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += q[h * d + j] * keys[want[i] * d + j];
        EXPECT_NEAR(out.per_head_logits[h][i], dot / std::sqrt(double(d)), 1e-4);
      }
      merged.insert(merged.end(), want.begin(), want.end());
    }
    std::sort(merged.begin(), merged.end());
    merged.erase(std::unique(merged.begin(), merged.end()), merged.end());
    EXPECT_EQ(out.merged, merged);
    EXPECT_EQ(stats.keys_scored, static_cast<uint64_t>(n * G));
    // An explicit budget overrides rho.
    in.budget = 10;
    ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
    EXPECT_EQ(out.per_head[0].size(), 10u);
  }
  // Keys are required.
  SelectInput no_keys;
  no_keys.queries = q.data();
  no_keys.n_queries = 1;
  Selection out;
  EXPECT_EQ((*sel)->Select(no_keys, &out, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(OracleTest, SerializeLoadAppendClone) {
  std::vector<float> keys(64 * 8, 0.5f);
  HeadPrefill p;
  p.n_tokens = 64;
  p.head_dim = 8;
  p.keys = keys.data();
  for (const char* method : {"oracle", "full"}) {
    auto sel = BuildSelector(method, p, {});
    ASSERT_TRUE(sel.ok());
    ASSERT_TRUE((*sel)->Append(keys.data(), nullptr, nullptr).ok());
    EXPECT_EQ((*sel)->n_tokens(), 65);
    std::string bytes;
    ASSERT_TRUE((*sel)->Serialize(&bytes).ok());
    auto loaded = LoadSelector(method, bytes);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ((*loaded)->n_tokens(), 65);
    EXPECT_EQ((*loaded)->head_dim(), 8);
    EXPECT_EQ((*loaded)->method(), method);
    EXPECT_EQ((*sel)->Clone()->n_tokens(), 65);
    std::string again;
    ASSERT_TRUE((*loaded)->Serialize(&again).ok());
    EXPECT_EQ(again, bytes);
    EXPECT_FALSE(LoadSelector(method, bytes.substr(0, 6)).ok());
  }
  auto full = BuildSelector("full", p, {});
  SelectInput in;
  in.queries = keys.data();
  in.n_queries = 2;
  Selection out;
  ASSERT_TRUE((*full)->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.merged.size(), 64u);
  EXPECT_EQ(out.per_head.size(), 2u);
  // Loading another method's bytes fails cleanly.
  std::string bytes;
  ASSERT_TRUE((*full)->Serialize(&bytes).ok());
  EXPECT_EQ(LoadSelector("oracle", bytes).status().code(), StatusCode::kInvalidArgument);
}

TEST(SelectorRegistryTest, MethodsParamsAndErrors) {
  auto methods = SelectorMethods();
  for (const char* m : {"full", "oracle", "csa"}) {
    EXPECT_NE(std::find(methods.begin(), methods.end(), m), methods.end()) << m;
  }
  std::vector<float> keys(16 * 4, 1.0f);
  HeadPrefill p;
  p.n_tokens = 16;
  p.head_dim = 4;
  p.keys = keys.data();
  auto unknown = BuildSelector("nope", p, {});
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("csa"), std::string_view::npos);
  EXPECT_EQ(LoadSelector("nope", "x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildSelector("oracle", p, {{"bogus", "1"}}).status().code(),
            StatusCode::kInvalidArgument);
  for (const char* rho : {"0", "-0.1", "1.5", "abc", "nan"}) {
    EXPECT_EQ(BuildSelector("oracle", p, {{"rho", rho}}).status().code(),
              StatusCode::kInvalidArgument)
        << rho;
  }
  keys[3] = INFINITY;
  // Only a method that reads the keys checks them: a builder hands the
  // others null keys (MethodInfo::reads_keys).
  EXPECT_EQ(BuildSelector("quest", p, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(BuildSelector("oracle", p, {}).ok());
  HeadPrefill no_keys = p;
  no_keys.keys = nullptr;
  for (const MethodInfo& m : Methods()) {
    auto built = BuildSelector(std::string(m.name), no_keys, {});
    if (m.reads_keys) {
      EXPECT_EQ(built.status().code(), StatusCode::kInvalidArgument) << m.name;
    } else {
      EXPECT_TRUE(built.ok()) << m.name << ": " << built.status().ToString();
    }
  }

  auto params = ParseParams(" m=8, C=128 ,alpha=0.25,");
  ASSERT_TRUE(params.ok());
  EXPECT_EQ(params->size(), 3u);
  EXPECT_EQ(params->at("C"), "128");
  EXPECT_TRUE(ParseParams("").ok());
  EXPECT_FALSE(ParseParams("m").ok());
  EXPECT_FALSE(ParseParams("=3").ok());
  EXPECT_FALSE(ParseParams("m=1,m=2").ok());
}

TEST(ArrayKeySourceTest, GatherAndRange) {
  std::vector<float> keys(5 * 2);
  std::iota(keys.begin(), keys.end(), 0.0f);
  ArrayKeySource src(keys.data(), 5, 2);
  const int32_t ids[2] = {4, 1};
  float out[4];
  ASSERT_TRUE(src.GatherKeys(ids, 2, out).ok());
  EXPECT_EQ(out[0], 8.0f);
  EXPECT_EQ(out[3], 3.0f);
  const int32_t bad[1] = {5};
  EXPECT_EQ(src.GatherKeys(bad, 1, out).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::index
