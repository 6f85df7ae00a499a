#include "index/lfps.h"

#include <gtest/gtest.h>

#include <cstring>

#include <cmath>
#include <random>

#include "index/metrics.h"
#include "index/synthetic.h"

namespace ctxcache::index {
namespace {

TEST(LfpsMathTest, KurtosisAndThresholdHandComputed) {
  // x = [0, 0, 0, 4]: mean 1, deviations (-1, -1, -1, 3): Σc² = 12, Σc⁴ = 84.
  const float x[] = {0, 0, 0, 4};
  EXPECT_NEAR(LfpsKurtosis(x, 4), 84.0 / 144.0, 1e-12);
  EXPECT_NEAR(LfpsThreshold(x, 4, 0.2), 0.2 * 1.0 / (84.0 / 144.0), 1e-12);
  // A flat table has no peak: no candidates.
  const float flat[] = {2, 2, 2};
  EXPECT_EQ(LfpsKurtosis(flat, 3), 0.0);
  EXPECT_TRUE(std::isinf(LfpsThreshold(flat, 3, 0.2)));
  // A sharper peak (higher kurtosis) lowers the threshold relative to the mean.
  std::vector<float> wide(100, 0.0f), sharp(100, 0.0f);
  for (int i = 0; i < 20; ++i) wide[i] = 1.0f;
  sharp[0] = 20.0f;
  EXPECT_GT(LfpsKurtosis(sharp.data(), 100), LfpsKurtosis(wide.data(), 100));
  EXPECT_LT(LfpsThreshold(sharp.data(), 100, 0.2) / 0.2,
            LfpsThreshold(wide.data(), 100, 0.2) / 0.2);
}

TEST(LfpsMathTest, InitialTablesHandComputed) {
  // n = 4, queries at positions 2 and 3, r = 0.5: c = 1/(2·2·0.5) = 0.5.
  std::vector<std::vector<float>> w = {{0.2f, 0.3f, 0.5f, 0.0f}, {0.1f, 0.2f, 0.3f, 0.4f}};
  std::vector<float> ver, sla;
  LfpsInitialTables(w, {2, 3}, 4, 0.5, &ver, &sla);
  const std::vector<float> want_ver = {0.15f, 0.25f, 0.4f, 0.2f};
  // Slash: the row of position 3 unshifted, the row of position 2 shifted by one.
  const std::vector<float> want_sla = {0.05f, 0.2f, 0.3f, 0.45f};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(ver[i], want_ver[i], 1e-6) << i;
    EXPECT_NEAR(sla[i], want_sla[i], 1e-6) << i;
  }
}

TEST(LfpsMathTest, ExpansionHandComputed) {
  // ver: mean 9/12 = 0.75; sla: mean 3.6/12 = 0.3.
  std::vector<float> ver(12, 0.0f), sla(12, 0.0f);
  ver[4] = 6.0f;
  ver[5] = 3.0f;
  sla[9] = 2.4f;
  sla[10] = 1.2f;
  // Offsets {-1,0,1,2} around 4 and 9, kept where either table beats its mean.
  EXPECT_EQ(LfpsExpand(ver, sla, {4, 9}, 0), (std::vector<int32_t>{4, 5, 9, 10}));
  // Positions below `lo` (sinks) are never produced.
  EXPECT_EQ(LfpsExpand(ver, sla, {4}, 5), (std::vector<int32_t>{5}));
}

TEST(LfpsMathTest, UpdateHandComputed) {
  std::vector<float> ver = {0.5f, 1.0f, 0.0f, 2.0f, 0.0f};
  std::vector<float> sla = {1.0f, 0.0f, 0.5f, 0.0f, 0.0f};
  // r = 0.5, C2 = {1, 3} with weights 0.75 / 0.25; 1/(2|C2|) = 0.25.
  LfpsUpdateTables(0.5, {1, 3}, {0.75f, 0.25f}, &ver, &sla);
  const std::vector<float> want_ver = {0.25f, 1.0f, 0.0f, 1.0f, 0.0f};
  const std::vector<float> want_sla = {0.0f, 1.0f, 0.0f, 0.25f, 0.0f};
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(ver[i], want_ver[i], 1e-6) << i;
    EXPECT_NEAR(sla[i], want_sla[i], 1e-6) << i;
  }
  // The table mass converges to 0.5/(1-r) (LFPS B.2): each update adds 0.5.
  std::vector<float> v(50, 0.0f), s(50, 0.0f);
  for (int t = 0; t < 400; ++t) LfpsUpdateTables(0.9, {3, 7}, {0.5f, 0.5f}, &v, &s);
  double sum = 0;
  for (float x : v) sum += x;
  EXPECT_NEAR(sum, 0.5 / (1 - 0.9), 1e-3);
}

// A decode that keeps answering one question: every query (the last s
// prefill rows and the decode steps) is the same target direction plus a
// fresh per-step part (weight 1 - rho), over synthetic clustered keys. The
// context is the synthetic prefill plus the first s "decode" tokens, so the
// initial tables come from those s rows (causal, positions N..N+s-1).
class LfpsDecodeTest : public ::testing::Test {
 protected:
  static constexpr int kHistory = 32;
  static constexpr int kSteps = 48;
  void SetUp() override {
    SyntheticOptions o;
    o.n_tokens = 4096;
    o.head_dim = 64;
    o.group_size = 2;
    o.n_prefill_queries = 64;
    o.n_decode_steps = kHistory + kSteps;
    auto h = GenerateSyntheticHead(o);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    head_ = std::move(*h);
    const int d = head_.head_dim, G = head_.group_size;
    const int T = head_.n_decode;
    // Stationary-target stream: q_t = m + sqrt(rho)·e_0 + sqrt(1-rho)·e_t, e = q - mean.
    const float rho = 0.95f;
    for (int g = 0; g < G; ++g) {
      std::vector<float> m(d, 0.0f);
      for (int t = 0; t < T; ++t) {
        for (int j = 0; j < d; ++j) m[j] += head_.decode_queries[(t * G + g) * d + j] / T;
      }
      std::vector<float> e0(d);
      for (int j = 0; j < d; ++j) e0[j] = head_.decode_queries[g * d + j] - m[j];
      for (int t = 0; t < T; ++t) {
        float* q = head_.decode_queries.data() + (t * G + g) * d;
        for (int j = 0; j < d; ++j) {
          q[j] = m[j] + std::sqrt(rho) * e0[j] + std::sqrt(1 - rho) * (q[j] - m[j]);
        }
      }
    }
    all_keys_ = head_.keys;
    all_keys_.insert(all_keys_.end(), head_.decode_keys.begin(), head_.decode_keys.end());
    // The s history rows, [G][s][d], at positions N..N+s-1.
    for (int g = 0; g < G; ++g) {
      for (int t = 0; t < kHistory; ++t) {
        const float* q = head_.DecodeQueries(t) + g * d;
        history_.insert(history_.end(), q, q + d);
      }
    }
    for (int t = 0; t < kHistory; ++t) positions_.push_back(head_.n_tokens + t);
  }
  HeadPrefill Prefill() const {
    HeadPrefill p;
    p.n_tokens = head_.n_tokens + kHistory;
    p.head_dim = head_.head_dim;
    p.group_size = head_.group_size;
    p.keys = all_keys_.data();
    p.n_queries = kHistory;
    p.query_positions = positions_.data();
    p.queries = history_.data();
    return p;
  }
  SyntheticHead head_;
  std::vector<float> all_keys_;
  std::vector<float> history_;
  std::vector<int64_t> positions_;
};

TEST_F(LfpsDecodeTest, TracksExactTopKWithFewKeysScored) {
  LfpsOptions seed;  // the seed's candidate set: the tables alone
  seed.candidate_floor = 0;
  auto built = LfpsSelector::Build(Prefill(), seed);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  LfpsSelector& sel = **built;
  const int d = head_.head_dim;
  double eta = 0;
  int count = 0;
  for (int t = kHistory; t < head_.n_decode; ++t) {
    const int64_t n = sel.n_tokens();
    ArrayKeySource keys(all_keys_.data(), n, d);
    SelectInput in;
    in.queries = head_.DecodeQueries(t);
    in.n_queries = head_.group_size;
    in.budget = static_cast<int64_t>(std::ceil(0.02 * n));
    in.keys = &keys;
    Selection out;
    WorkStats st;
    ASSERT_TRUE(sel.Select(in, &out, &st).ok());
    for (int h = 0; h < head_.group_size; ++h) {
      auto exact = ExactAttention::Compute(in.queries + h * d, all_keys_.data(), nullptr, n, d);
      ASSERT_TRUE(exact.ok());
      eta += RecallAtK(out.per_head[h], exact->TopK(in.budget));
      ++count;
      EXPECT_LE(static_cast<int64_t>(out.per_head[h].size()), in.budget);
    }
    ASSERT_TRUE(sel.Append(all_keys_.data() + n * d, nullptr, nullptr).ok());
  }
  eta /= count;
  const double scored = static_cast<double>(sel.counters().keys_scored) /
                        static_cast<double>(sel.counters().keys_total);
  // A selector scoring this fraction of the keys at random would find about
  // `scored` of the top-k; the history tables must do far better.
  EXPECT_GT(eta, 0.35) << "scored fraction " << scored;
  EXPECT_LT(scored, 0.12);
  EXPECT_GT(eta, 5 * scored) << "eta " << eta;
  EXPECT_EQ(sel.counters().bypassed, 0u);
}

TEST(LfpsBypassTest, SinkDominatedHeadTakesTheBypass) {
  // Small keys, one huge sink key along e0; queries along e0 put ~all the
  // attention on the sink: ρ > ε.
  const int d = 8, n = 256;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  std::vector<float> keys(n * d);
  for (float& x : keys) x = nd(rng);
  keys[0] = 10.0f;
  std::vector<float> queries(32 * d);
  for (float& x : queries) x = nd(rng);
  HeadPrefill p;
  p.n_tokens = n;
  p.head_dim = d;
  p.group_size = 1;
  p.keys = keys.data();
  p.n_queries = 32;
  p.queries = queries.data();
  auto built = LfpsSelector::Build(p, LfpsOptions{});
  ASSERT_TRUE(built.ok());
  ArrayKeySource ks(keys.data(), n, d);
  std::vector<float> q(d, 0.0f);
  q[0] = 3.0f;
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 1;
  in.budget = 40;
  in.keys = &ks;
  Selection out;
  const std::vector<float> before = (*built)->vertical(0);
  ASSERT_TRUE((*built)->Select(in, &out, nullptr).ok());
  EXPECT_EQ((*built)->counters().bypassed, 1u);
  // Sinks + local window only, and the tables are left alone.
  std::vector<int32_t> want = {0, 1, 2, 3};
  for (int i = n - 6; i < n; ++i) want.push_back(i);
  EXPECT_EQ(out.per_head[0], want);
  EXPECT_EQ((*built)->vertical(0), before);
  // A query orthogonal to the sink is not bypassed.
  q[0] = 0.0f;
  q[1] = 3.0f;
  ASSERT_TRUE((*built)->Select(in, &out, nullptr).ok());
  EXPECT_EQ((*built)->counters().bypassed, 1u);
  EXPECT_NE((*built)->vertical(0), before);  // the tables were updated
  EXPECT_LE(out.per_head[0].size(), 40u);
}

TEST_F(LfpsDecodeTest, SerializeRoundTripContinuesIdentically) {
  auto built = BuildLfpsSelector(Prefill(), {{"a", "0.2"}});
  ASSERT_TRUE(built.ok());
  const int d = head_.head_dim;
  ArrayKeySource keys(all_keys_.data(), head_.n_tokens + kHistory, d);
  SelectInput in;
  in.queries = head_.DecodeQueries(0);
  in.n_queries = 2;
  in.keys = &keys;
  Selection a, b;
  ASSERT_TRUE((*built)->Select(in, &a, nullptr).ok());  // state moved on once
  std::string bytes;
  ASSERT_TRUE((*built)->Serialize(&bytes).ok());
  auto loaded = LoadSelector("lfps", bytes);  // through the registry
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->method(), "lfps");
  in.queries = head_.DecodeQueries(1);
  ASSERT_TRUE((*built)->Select(in, &a, nullptr).ok());
  ASSERT_TRUE((*loaded)->Select(in, &b, nullptr).ok());
  EXPECT_EQ(a.per_head, b.per_head);
  auto clone = (*loaded)->Clone();
  std::string c1, c2;
  ASSERT_TRUE((*loaded)->Serialize(&c1).ok());
  ASSERT_TRUE(clone->Serialize(&c2).ok());
  EXPECT_EQ(c1, c2);
  EXPECT_EQ(LoadLfpsSelector(bytes.substr(0, bytes.size() - 3)).status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(LoadLfpsSelector("LFP1").status().code(), StatusCode::kInvalidArgument);
}

// Found by fuzz/fuzz_index_lfps: an artifact's local window was only checked
// for >= 0, and Select reserved that many candidates (8 GiB for 2^31 - 1).
// Loaded options obey the params' bounds; anything else is rejected.
TEST_F(LfpsDecodeTest, LoadRejectsOutOfRangeWindows) {
  auto built = BuildLfpsSelector(Prefill(), {});
  ASSERT_TRUE(built.ok());
  std::string bytes;
  ASSERT_TRUE((*built)->Serialize(&bytes).ok());
  ASSERT_TRUE(LoadLfpsSelector(bytes).ok());
  // Header: magic+version 8, n_tokens 8, d 4, G 4, s 4, r 8, eps 8, a 8,
  // then int32 sink at 52 and int32 local at 56.
  for (size_t offset : {size_t{52}, size_t{56}}) {
    for (int32_t v : {(1 << 20) + 1, INT32_MAX}) {
      std::string bad = bytes;
      std::memcpy(bad.data() + offset, &v, sizeof(v));
      auto loaded = LoadLfpsSelector(bad);
      EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument)
          << offset << " " << v << " " << loaded.status().ToString();
    }
  }
}

// The candidate floor: C1 gets the positions of largest max(|Φver|, |Φsla|)
// it lacks (a negative entry by magnitude), sinks and the local window apart.
TEST(LfpsMathTest, TopUpHandComputed) {
  //                          0     1     2      3     4     5     6     7
  const std::vector<float> ver = {9.0f, 0.0f, 0.1f, -0.5f, 0.0f, 0.3f, 0.0f, 2.0f};
  const std::vector<float> sla = {0.0f, 0.2f, 0.0f, 0.0f, 0.0f, 0.0f, 0.4f, 0.0f};
  // lo = 1 (token 0 is a sink), end = 7 (token 7 is in the local window).
  EXPECT_EQ(LfpsTopUp(ver, sla, {2}, 1, 7, 4), (std::vector<int32_t>{2, 3, 5, 6}));
  EXPECT_EQ(LfpsTopUp(ver, sla, {2}, 1, 7, 1), (std::vector<int32_t>{2}));  // already there
  EXPECT_EQ(LfpsTopUp(ver, sla, {}, 1, 7, 100), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
}

// A version 1 artifact (no floor) loads with the seed's candidate set.
TEST_F(LfpsDecodeTest, VersionOneArtifactLoadsWithoutFloor) {
  auto built = BuildLfpsSelector(Prefill(), {{"floor", "3"}});
  ASSERT_TRUE(built.ok());
  std::string bytes;
  ASSERT_TRUE((*built)->Serialize(&bytes).ok());
  auto v2 = LfpsSelector::Load(bytes);
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  EXPECT_EQ((*v2)->options().candidate_floor, 3);
  // Version 1: the same header without the f64 floor at offset 68.
  std::string v1 = bytes.substr(0, 68) + bytes.substr(76);
  const uint32_t one = 1;
  std::memcpy(v1.data() + 4, &one, sizeof(one));
  auto loaded = LfpsSelector::Load(v1);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->options().candidate_floor, 0);
  EXPECT_EQ((*loaded)->vertical(0), (*v2)->vertical(0));
}

TEST_F(LfpsDecodeTest, BadParameters) {
  HeadPrefill p = Prefill();
  for (auto [k, v] : std::vector<std::pair<std::string, std::string>>{{"r", "1"},
                                                                      {"eps", "0"},
                                                                      {"a", "-1"},
                                                                      {"s", "0"},
                                                                      {"sink", "-2"},
                                                                      {"rho", "1.5"},
                                                                      {"floor", "-1"},
                                                                      {"decay", "0.9"}}) {
    auto s = BuildLfpsSelector(p, {{k, v}});
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << k << "=" << v;
    EXPECT_NE(s.status().message().find(k), std::string_view::npos) << s.status().ToString();
  }
  p.queries = nullptr;
  EXPECT_EQ(BuildLfpsSelector(p, {}).status().code(), StatusCode::kInvalidArgument);
  auto built = BuildLfpsSelector(Prefill(), {});
  ASSERT_TRUE(built.ok());
  SelectInput in;
  in.queries = head_.DecodeQueries(0);
  in.n_queries = 2;
  Selection out;
  EXPECT_EQ((*built)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);  // no keys
  ArrayKeySource keys(all_keys_.data(), head_.n_tokens + kHistory, head_.head_dim);
  in.keys = &keys;
  in.n_queries = 1;
  EXPECT_EQ((*built)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::index
