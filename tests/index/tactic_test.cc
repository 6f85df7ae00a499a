#include "index/tactic.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "index/kmeans.h"
#include "index/metrics.h"
#include "index/synthetic.h"

namespace ctxcache::index {
namespace {

TEST(TacticMathTest, FitRecoversKnownInverseCurves) {
  for (auto [a, b] :
       std::vector<std::pair<double, double>>{{5.0, 0.1}, {120.0, 0.0}, {2.0, -0.01}}) {
    const InverseFit f = FitInverse(10, a / 10 + b, 60, a / 60 + b);
    EXPECT_NEAR(f.a, a, 1e-9 * std::abs(a) + 1e-12);
    EXPECT_NEAR(f.b, b, 1e-12);
    EXPECT_NEAR(f(33.0), a / 33.0 + b, 1e-12);
  }
  // A flat curve: a = 0.
  const InverseFit flat = FitInverse(5, 0.3, 50, 0.3);
  EXPECT_NEAR(flat.a, 0.0, 1e-12);
  EXPECT_NEAR(flat.b, 0.3, 1e-12);
}

TEST(TacticMathTest, CumulativeBudgetMatchesBruteForce) {
  std::mt19937 rng(11);
  std::exponential_distribution<double> ex(1.0);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<double> s(1 + rng() % 300);
    for (double& v : s) v = ex(rng);
    const double p = 0.05 + 0.9 * (rng() % 1000) / 1000.0;
    const int64_t k = CumulativeBudget(s, p);
    double total = 0;
    for (double v : s) total += v;
    // Brute force: the smallest prefix length reaching p·total.
    int64_t want = static_cast<int64_t>(s.size());
    for (size_t len = 1; len <= s.size(); ++len) {
      double acc = 0;
      for (size_t i = 0; i < len; ++i) acc += s[i];
      if (acc >= p * total) {
        want = static_cast<int64_t>(len);
        break;
      }
    }
    ASSERT_EQ(k, want) << "trial " << trial;
  }
  EXPECT_EQ(CumulativeBudget({0.0, 0.0}, 0.9), 2);
}

// The estimator on an exactly inverse-shaped tail: the fitted budget equals
// the brute-force budget over the true scores.
TEST(TacticMathTest, EstimatedBudgetOnAnInverseTail) {
  const int64_t n = 5000, n0 = 75;
  const double a = 40.0, b = 0.002;
  std::vector<double> truth(n);
  for (int64_t i = 0; i < n; ++i) truth[i] = i < n0 ? 3.0 + 0.01 * (n0 - i) : a / (i + 1) + b;
  // Window means around 10% and 60% (w = 1 → the points themselves).
  const InverseFit f = FitInverse(500, truth[499], 3000, truth[2999]);
  std::vector<double> s(n);
  for (int64_t i = 0; i < n; ++i) s[i] = i < n0 ? truth[i] : f(static_cast<double>(i + 1));
  for (double p : {0.5, 0.7, 0.9}) EXPECT_EQ(CumulativeBudget(s, p), CumulativeBudget(truth, p));
}

// Small contexts are scored exactly (sampling would cost as much): the
// estimated mass is then the true mass, and the cut is minimal per cluster.
TEST(TacticSelectorTest, ExactRegimeReachesTargetMinimally) {
  const int d = 16;
  const int64_t n = 250;  // N0 + 2w = 4 + 128 >= n / 2: exact regime
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> keys(n * d), q(3 * d);
  for (float& x : keys) x = nd(rng);
  for (float& x : q) x = 2.0f * nd(rng);
  TacticOptions o;
  o.target = 0.8;
  o.n_sink = 4;
  auto sel = TacticSelector::Build(keys.data(), n, d, o);
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  ArrayKeySource ks(keys.data(), n, d);
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 3;
  in.keys = &ks;
  Selection out;
  WorkStats st;
  ASSERT_TRUE((*sel)->Select(in, &out, &st).ok());
  EXPECT_EQ(st.keys_scored, 3u * n);
  double est = 0;
  std::set<int32_t> uni;
  for (int h = 0; h < 3; ++h) {
    auto exact = ExactAttention::Compute(q.data() + h * d, keys.data(), nullptr, n, d);
    ASSERT_TRUE(exact.ok());
    const double mass = exact->Mass(out.per_head[h]);
    const TacticHeadEstimate& e = (*sel)->last_estimates()[h];
    EXPECT_NEAR(e.estimated_mass, mass, 1e-4);
    EXPECT_GE(mass, 0.8 - 1e-6);
    // Minimal: without the last selected cluster the target is missed.
    std::vector<int32_t> order;
    std::vector<int64_t> cend;
    (*sel)->RankTokens(q.data() + h * d, &order, &cend);
    auto it = std::find(cend.begin(), cend.end(), e.k_selected);
    ASSERT_NE(it, cend.end()) << "selection is not a whole-cluster prefix";
    const int64_t prev = it == cend.begin() ? 0 : *(it - 1);
    std::vector<int32_t> fewer(order.begin(), order.begin() + prev);
    for (int32_t i = 0; i < 4; ++i) fewer.push_back(i);  // sinks are always selected
    std::sort(fewer.begin(), fewer.end());
    for (int32_t i = 0; i < 4; ++i) {
      EXPECT_TRUE(std::binary_search(out.per_head[h].begin(), out.per_head[h].end(), i));
    }
    EXPECT_LT(exact->Mass(fewer), 0.8);
    est += e.estimated_mass;
    uni.insert(out.per_head[h].begin(), out.per_head[h].end());
  }
  EXPECT_NEAR(out.estimated_mass, est / 3, 1e-12);
  EXPECT_EQ(out.merged, std::vector<int32_t>(uni.begin(), uni.end()));
}

class TacticSyntheticTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SyntheticOptions o;
    o.n_tokens = 4096;
    o.head_dim = 64;
    o.group_size = 2;
    o.n_prefill_queries = 64;
    o.n_decode_steps = 16;
    auto h = GenerateSyntheticHead(o);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    head_ = std::move(*h);
  }
  SyntheticHead head_;
};

TEST_F(TacticSyntheticTest, SelectsWholeClustersAndEstimatesMass) {
  auto sel = BuildTacticSelector(head_.Prefill(), {{"recent", "32"}, {"sinks", "4"}});
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  auto* tactic = static_cast<TacticSelector*>(sel->get());
  EXPECT_EQ(tactic->n_sink(), 4);
  const int c = TacticOptions{}.avg_cluster_size;
  EXPECT_EQ(tactic->n_clusters(), (4096 - 4 - 32) / c);  // sinks and the recent tail apart
  const int d = head_.head_dim;
  ArrayKeySource ks(head_.keys.data(), head_.n_tokens, d);
  double mass = 0, est = 0, frac = 0, scored = 0;
  int count = 0;
  for (int t = 0; t < head_.n_decode; ++t) {
    SelectInput in;
    in.queries = head_.DecodeQueries(t);
    in.n_queries = 2;
    in.keys = &ks;
    Selection out;
    WorkStats st;
    ASSERT_TRUE(tactic->Select(in, &out, &st).ok());
    scored += static_cast<double>(st.keys_scored) / (2.0 * head_.n_tokens);
    for (int h = 0; h < 2; ++h) {
      auto exact = ExactAttention::Compute(in.queries + h * d, head_.keys.data(), nullptr,
                                           head_.n_tokens, d);
      ASSERT_TRUE(exact.ok());
      mass += exact->Mass(out.per_head[h]);
      est += tactic->last_estimates()[h].estimated_mass;
      frac += static_cast<double>(out.per_head[h].size()) / head_.n_tokens;
      // Sinks and the last 32 prefill tokens (the initial tail) are always selected.
      EXPECT_EQ(out.per_head[h].front(), 0);
      EXPECT_EQ(out.per_head[h].back(), head_.n_tokens - 1);
      EXPECT_TRUE(std::binary_search(out.per_head[h].begin(), out.per_head[h].end(),
                                     static_cast<int32_t>(head_.n_tokens - 32)));
      ++count;
    }
  }
  mass /= count;
  est /= count;
  frac /= count;
  scored /= head_.n_decode;
  EXPECT_GT(mass, 0.8) << "selected fraction " << frac;
  EXPECT_NEAR(est, 0.9, 0.05);
  EXPECT_LT(frac, 0.6);
  // Sampling: N0 + two windows of 64.
  EXPECT_LT(scored, TacticOptions{}.n0_frac + 128.0 / 4096 + 0.01);
}

TEST_F(TacticSyntheticTest, AppendedTailIsSelectedUntilReclustered) {
  auto sel = TacticSelector::Build(head_.keys.data(), head_.n_tokens, head_.head_dim, [] {
    TacticOptions o;
    o.recluster_every = 64;
    o.n_recent = 0;  // the default: the tail is exactly the appended tokens
    return o;
  }());
  ASSERT_TRUE(sel.ok());
  const int d = head_.head_dim;
  std::vector<float> all = head_.keys;
  all.insert(all.end(), head_.decode_keys.begin(), head_.decode_keys.end());
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < 70; ++i) {
    std::vector<float> k(d);
    for (int j = 0; j < d; ++j) k[j] = head_.keys[(100 + i) * d + j] + 0.01f * nd(rng);
    all.insert(all.end(), k.begin(), k.end());
  }
  const int64_t base = head_.n_tokens;
  for (int i = 0; i < 63; ++i) {
    ASSERT_TRUE(
        (*sel)->Append(all.data() + (base + head_.n_decode + i) * d, nullptr, nullptr).ok());
  }
  // 63 appended keys: ids base..base+62, all in the unclustered tail.
  EXPECT_EQ((*sel)->n_tokens(), base + 63);
  EXPECT_EQ((*sel)->n_ranked(), base);  // defaults: no sinks, no recent window
  std::vector<float> ctx(all.begin(), all.begin() + base * d);
  ctx.insert(ctx.end(), all.begin() + (base + head_.n_decode) * d,
             all.begin() + (base + head_.n_decode + 63) * d);
  ArrayKeySource ks(ctx.data(), base + 63, d);
  SelectInput in;
  in.queries = head_.DecodeQueries(0);
  in.n_queries = 2;
  in.keys = &ks;
  Selection out;
  ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
  for (int h = 0; h < 2; ++h) {
    for (int64_t i = base; i < base + 63; ++i) {
      EXPECT_TRUE(std::binary_search(out.per_head[h].begin(), out.per_head[h].end(), i));
    }
  }
  // The 64th append re-clusters the tail: it joins the ranking.
  ASSERT_TRUE((*sel)->Append(all.data() + (base + head_.n_decode + 63) * d, nullptr, nullptr).ok());
  EXPECT_EQ((*sel)->n_ranked(), base + 64);
  const int cs = TacticOptions{}.avg_cluster_size;
  EXPECT_EQ((*sel)->n_clusters(), 4096 / cs + 64 / cs);
  // Round trip after appends: identical selections.
  std::string bytes;
  ASSERT_TRUE((*sel)->Serialize(&bytes).ok());
  auto loaded = LoadSelector("tactic", bytes);  // through the registry
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ctx.insert(ctx.end(), all.begin() + (base + head_.n_decode + 63) * d,
             all.begin() + (base + head_.n_decode + 64) * d);
  ArrayKeySource ks2(ctx.data(), base + 64, d);
  in.keys = &ks2;
  Selection a, b;
  ASSERT_TRUE((*sel)->Select(in, &a, nullptr).ok());
  ASSERT_TRUE((*loaded)->Select(in, &b, nullptr).ok());
  EXPECT_EQ(a.per_head, b.per_head);
  EXPECT_EQ(a.estimated_mass, b.estimated_mass);
  auto clone = (*loaded)->Clone();
  std::string c;
  ASSERT_TRUE(clone->Serialize(&c).ok());
  EXPECT_EQ(c, bytes);
  EXPECT_EQ(LoadTacticSelector(bytes.substr(0, bytes.size() - 4)).status().code(),
            StatusCode::kDataLoss);
  std::string v2 = bytes;
  v2[4] = 2;
  EXPECT_EQ(LoadTacticSelector(v2).status().code(), StatusCode::kInvalidArgument);
}

// 4096 keys, 256 clusters: the two-level k-means with its flat step. Every
// centroid is the mean of its members (the final update), and the clusters
// are about as tight as a flat k-means with the same k and iterations.
TEST_F(TacticSyntheticTest, TwoLevelClustersAreMemberMeansAndTight) {
  auto sel = BuildTacticSelector(head_.Prefill(), {});
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  auto* tactic = static_cast<TacticSelector*>(sel->get());
  const int d = head_.head_dim;
  const int64_t k = 4096 / TacticOptions{}.avg_cluster_size;
  ASSERT_EQ(tactic->n_clusters(), k);
  double sse = 0;
  int64_t covered = 0;
  for (int64_t c = 0; c < k; ++c) {
    const std::vector<int32_t> mem = tactic->members(c);
    ASSERT_FALSE(mem.empty());
    covered += static_cast<int64_t>(mem.size());
    for (int t = 0; t < d; ++t) {
      double mean = 0;
      for (int32_t id : mem) mean += head_.keys[static_cast<size_t>(id) * d + t];
      mean /= static_cast<double>(mem.size());
      ASSERT_NEAR(tactic->centroid(c)[t], mean, 1e-4 * (1 + std::abs(mean))) << "cluster " << c;
      for (int32_t id : mem) {
        const double diff = head_.keys[static_cast<size_t>(id) * d + t] - tactic->centroid(c)[t];
        sse += diff * diff;
      }
    }
  }
  EXPECT_EQ(covered, 4096);
  KMeansOptions ko;
  ko.k = static_cast<int>(k);
  ko.metric = KMeansMetric::kL2;
  ko.init = KMeansInit::kRandom;
  ko.max_iters = 10;
  auto flat = KMeans(head_.keys.data(), 4096, d, d, ko);
  ASSERT_TRUE(flat.ok());
  const double two_level = sse / 4096;
  EXPECT_LT(two_level, 1.10 * flat->objective) << "flat " << flat->objective;
}

TEST_F(TacticSyntheticTest, FixedBudgetTakesWholeClustersWithinBudget) {
  auto sel = TacticSelector::Build(head_.keys.data(), head_.n_tokens, head_.head_dim, {});
  ASSERT_TRUE(sel.ok());
  SelectInput in;
  in.queries = head_.DecodeQueries(1);
  in.n_queries = 2;
  in.budget = 205;  // no KeySource needed in fixed-budget mode
  Selection out;
  WorkStats st;
  ASSERT_TRUE((*sel)->Select(in, &out, &st).ok());
  EXPECT_EQ(st.keys_scored, 0u);
  EXPECT_LT(out.estimated_mass, 0);
  for (int h = 0; h < 2; ++h) {
    EXPECT_LE(static_cast<int64_t>(out.per_head[h].size()), 205);
    EXPECT_GT(static_cast<int64_t>(out.per_head[h].size()), 205 / 2);
  }
}

// Found by fuzz/fuzz_index_tactic: the loader added the artifact's sink and
// ranked counts before range-checking them (signed overflow: UBSan reports
// it in the sanitizer unit run; wrapped, a huge n_ranked passed the header
// checks). Each count is checked on its own first: DATA_LOSS.
TEST_F(TacticSyntheticTest, LoadRejectsOverflowingCounts) {
  auto sel = BuildTacticSelector(head_.Prefill(), {});
  ASSERT_TRUE(sel.ok());
  std::string bytes;
  ASSERT_TRUE((*sel)->Serialize(&bytes).ok());
  ASSERT_TRUE(LoadTacticSelector(bytes).ok());
  // int64 n_sink at byte 84, int64 n_ranked at 92 (header layout: Serialize).
  const std::vector<std::pair<int64_t, int64_t>> cases = {
      {1, INT64_MAX}, {INT64_MIN, INT64_MIN}, {-1, 1}, {0, head_.n_tokens + 1}};
  for (auto [n_sink, n_ranked] : cases) {
    std::string bad = bytes;
    std::memcpy(bad.data() + 84, &n_sink, sizeof(n_sink));
    std::memcpy(bad.data() + 92, &n_ranked, sizeof(n_ranked));
    auto loaded = LoadTacticSelector(bad);
    EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss)
        << n_sink << " " << n_ranked << " " << loaded.status().ToString();
  }
}

// A session's P (session param, applied through ApplySessionOverrides) is the
// target of the adaptive mode that SelectInput::budget == 0 asks for: a
// higher P selects more tokens and estimates at least that mass.
TEST_F(TacticSyntheticTest, SessionTargetDrivesTheAdaptiveBudget) {
  auto sel = BuildTacticSelector(head_.Prefill(), {});
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  ArrayKeySource ks(head_.keys.data(), head_.n_tokens, head_.head_dim);
  SelectInput in;
  in.queries = head_.DecodeQueries(0);
  in.n_queries = head_.group_size;
  in.keys = &ks;
  in.budget = 0;
  size_t tokens_prev = 0;
  for (const char* p : {"0.5", "0.99"}) {
    std::unique_ptr<Selector> session = (*sel)->Clone();
    ASSERT_TRUE(session->ApplySessionOverrides({{"P", p}}).ok()) << p;
    EXPECT_DOUBLE_EQ(static_cast<TacticSelector*>(session.get())->options().target,
                     std::stod(p));
    Selection out;
    ASSERT_TRUE(session->Select(in, &out, nullptr).ok());
    EXPECT_GE(out.estimated_mass, std::stod(p) - 1e-9) << p;
    EXPECT_GT(out.merged.size(), tokens_prev) << p;
    tokens_prev = out.merged.size();
  }
  // The prototype keeps its build target; other keys and bad values are refused.
  EXPECT_DOUBLE_EQ(static_cast<TacticSelector*>(sel->get())->options().target, 0.9);
  for (auto [k, v] : std::vector<std::pair<std::string, std::string>>{
           {"P", "0"}, {"P", "1.5"}, {"P", "x"}, {"cluster", "8"}}) {
    std::unique_ptr<Selector> session = (*sel)->Clone();
    EXPECT_EQ(session->ApplySessionOverrides({{k, v}}).code(), StatusCode::kInvalidArgument)
        << k << "=" << v;
  }
}

TEST(TacticParamsTest, BadParameters) {
  std::vector<float> keys(256 * 4, 1.0f);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<float>(i % 7);
  HeadPrefill p;
  p.n_tokens = 256;
  p.head_dim = 4;
  p.keys = keys.data();
  EXPECT_TRUE(BuildTacticSelector(p, {{"cluster", "32"}, {"P", "0.5"}}).ok());
  for (auto [k, v] : std::vector<std::pair<std::string, std::string>>{{"cluster", "0"},
                                                                      {"P", "1.5"},
                                                                      {"P", "0"},
                                                                      {"iters", "0"},
                                                                      {"n0", "0.9"},
                                                                      {"w", "0"},
                                                                      {"sinks", "-1"},
                                                                      {"bogus", "1"}}) {
    auto s = BuildTacticSelector(p, {{k, v}});
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << k << "=" << v;
    EXPECT_NE(s.status().message().find(k), std::string_view::npos) << s.status().ToString();
  }
  EXPECT_EQ(BuildTacticSelector(p, {{"p1", "0.7"}, {"p2", "0.6"}}).status().code(),
            StatusCode::kInvalidArgument);
  auto sel = BuildTacticSelector(p, {});
  ASSERT_TRUE(sel.ok());
  std::vector<float> q(4, 1.0f);
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 1;
  Selection out;
  // Adaptive mode needs the keys.
  EXPECT_EQ((*sel)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);
  std::vector<float> nan_key(4, std::nanf(""));
  EXPECT_EQ((*sel)->Append(nan_key.data(), nullptr, nullptr).code(), StatusCode::kInvalidArgument);
  p.keys = nullptr;
  EXPECT_EQ(BuildTacticSelector(p, {}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::index
