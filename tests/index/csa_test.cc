// CSAttention tables and retrieval against a naive reimplementation of the
// definition (index/csa.h, DESIGN §5.1), streaming inserts against a rebuild,
// both serializations, schedules and the bad-parameter table.
#include "index/csa.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>

#include "common/dtype.h"

namespace ctxcache::index {
namespace {

constexpr int kD = 32;
constexpr int kG = 2;

struct Data {
  int64_t n = 512;
  int64_t nq = 128;  // query rows per head
  std::vector<float> keys, queries, decode;
  HeadPrefill prefill() const {
    HeadPrefill p;
    p.n_tokens = n;
    p.head_dim = kD;
    p.group_size = kG;
    p.keys = keys.data();
    p.n_queries = nq;
    p.queries = queries.data();
    return p;
  }
};

Data MakeData(int64_t n, uint64_t seed) {
  Data data;
  data.n = n;
  data.nq = std::min<int64_t>(128, n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0, 1);
  // Clustered queries (8 directions) and keys with an offset, so the tables
  // have structure; exact values do not matter for the definition checks.
  std::vector<float> dirs(8 * kD);
  for (auto& v : dirs) v = g(rng);
  data.queries.resize(kG * data.nq * kD);
  for (int64_t r = 0; r < kG * data.nq; ++r) {
    const int c = static_cast<int>(r % 8);
    for (int j = 0; j < kD; ++j) data.queries[r * kD + j] = dirs[c * kD + j] + 0.3f * g(rng);
  }
  data.keys.resize(n * kD);
  for (auto& v : data.keys) v = 0.5f + g(rng);
  data.decode.resize(6 * kG * kD);
  for (size_t i = 0; i < data.decode.size(); ++i) {
    data.decode[i] = dirs[((i / kD) % 8) * kD + i % kD] + 0.3f * g(rng);
  }
  return data;
}

CsaOptions SmallOptions() {
  CsaOptions o;
  o.m = 4;
  o.C = 16;
  o.alpha = 0.25;
  o.kmeans_iters = 5;
  o.rerank = 0;  // the lists alone; RerankMatchesNaiveDefinition covers stage 2
  return o;
}

float Fp16(double x) { return HalfToFloat(FloatToHalf(static_cast<float>(x))); }

// Naive definition of list (b, j) over keys[0..n): top-L by fp16-rounded
// c_j^b . (k_i^b - kbar^b), ties to the lower id. Returns (score, id) sorted.
std::vector<std::pair<float, int32_t>> NaiveList(const CsaSelector& s, const float* keys, int64_t n,
                                                 int b, int j) {
  const int ds = s.sub_dim();
  std::vector<std::pair<float, int32_t>> all;
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0;
    for (int t = 0; t < ds; ++t) {
      dot += static_cast<double>(s.centroid(b, j)[t]) *
             (keys[i * kD + b * ds + t] - s.key_mean()[b * ds + t]);
    }
    all.emplace_back(Fp16(dot), static_cast<int32_t>(i));
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& c) {
    return a.first > c.first || (a.first == c.first && a.second < c.second);
  });
  all.resize(s.L());
  return all;
}

// The stored list equals the naive one up to fp16 rounding at the boundary.
void ExpectListMatches(const CsaSelector& s, const float* keys, int64_t n, int b, int j) {
  auto want = NaiveList(s, keys, n, b, j);
  const float boundary = want.back().first;
  std::set<int32_t> want_ids;
  for (auto& e : want) want_ids.insert(e.second);
  const int32_t* ids = s.list_ids(b, j);
  const uint16_t* sc = s.list_scores(b, j);
  const float root = HalfToFloat(sc[0]);
  const float tol = std::abs(boundary) * 2e-3f + 1e-3f;
  int mismatches = 0;
  for (int64_t e = 0; e < s.L(); ++e) {
    EXPECT_LE(root, HalfToFloat(sc[e]));  // heap: the root is the minimum
    if (!want_ids.count(ids[e])) {
      ++mismatches;
      EXPECT_NEAR(HalfToFloat(sc[e]), boundary, tol) << "list " << b << "," << j;
    }
  }
  EXPECT_LE(mismatches, 2) << "list " << b << "," << j;
}

struct NaiveConfig {
  bool norm = false, proj = false, impute_min = false;
};

// Naive retrieval for one query using the selector's stored lists.
std::vector<int32_t> NaiveSelect(const CsaSelector& s, const float* q, int64_t budget,
                                 std::vector<double>* acc_out) {
  const CsaOptions& o = s.options();
  const int64_t n = s.n_tokens();
  const int ds = s.sub_dim();
  std::vector<double> acc(n, 0.0);
  for (int b = 0; b < o.m; ++b) {
    double norm = 0;
    for (int t = 0; t < ds; ++t) norm += double(q[b * ds + t]) * q[b * ds + t];
    norm = std::sqrt(norm);
    if (norm == 0) continue;
    std::vector<std::pair<double, int>> sims;
    for (int j = 0; j < o.C; ++j) {
      double dot = 0;
      for (int t = 0; t < ds; ++t) dot += double(q[b * ds + t]) * s.centroid(b, j)[t];
      sims.emplace_back(-dot, j);
    }
    std::sort(sims.begin(), sims.end());
    int take = 1;
    if (o.tau > 1 && -sims[0].first / norm < o.backoff_cos) take = o.tau;
    for (int t = 0; t < take; ++t) {
      const int j = sims[t].second;
      double w = o.proj_weights ? -sims[t].first : (o.norm_weights ? norm : 1.0);
      w /= take;
      const double mn = o.impute_min ? HalfToFloat(s.list_scores(b, j)[0]) : 0.0;
      for (int64_t e = 0; e < s.L(); ++e) {
        acc[s.list_ids(b, j)[e]] += w * (HalfToFloat(s.list_scores(b, j)[e]) - mn);
      }
    }
  }
  std::set<int32_t> forced;
  for (int64_t i = 0; i < std::min<int64_t>(o.sinks, n); ++i) forced.insert(i);
  for (int64_t i = std::max<int64_t>(0, n - o.recent); i < n; ++i) forced.insert(i);
  const int64_t k = budget > 0 ? budget : static_cast<int64_t>(std::ceil(o.rho * n));
  std::vector<std::pair<double, int32_t>> rest;
  for (int64_t i = 0; i < n; ++i) {
    if (!forced.count(i)) rest.emplace_back(-acc[i], static_cast<int32_t>(i));
  }
  std::sort(rest.begin(), rest.end());
  std::vector<int32_t> out(forced.begin(), forced.end());
  for (int64_t i = 0; i < k - static_cast<int64_t>(forced.size()) && i < (int64_t)rest.size();
       ++i) {
    out.push_back(rest[i].second);
  }
  std::sort(out.begin(), out.end());
  if (acc_out) *acc_out = acc;
  return out;
}

void ExpectSelectionMatches(CsaSelector* s, const float* q, int64_t budget) {
  std::vector<double> acc;
  auto want = NaiveSelect(*s, q, budget, &acc);
  SelectInput in;
  in.queries = q;
  in.n_queries = 1;
  in.budget = budget;
  Selection out;
  ASSERT_TRUE(s->Select(in, &out, nullptr).ok());
  const auto& got = out.per_head[0];
  EXPECT_EQ(got.size(), want.size());
  // Equal up to float-vs-double near-ties at the K-th score.
  std::vector<int32_t> only_got, only_want;
  std::set_difference(got.begin(), got.end(), want.begin(), want.end(),
                      std::back_inserter(only_got));
  std::set_difference(want.begin(), want.end(), got.begin(), got.end(),
                      std::back_inserter(only_want));
  ASSERT_EQ(only_got.size(), only_want.size());
  for (size_t i = 0; i < only_got.size(); ++i) {
    EXPECT_NEAR(acc[only_got[i]], acc[only_want[i]], 1e-3 * (1 + std::abs(acc[only_want[i]])));
  }
  EXPECT_LE(only_got.size(), 2u);
  // Logit estimates for the page cap: the accumulated score of each selected
  // token, times the mean sub-query norm for uniform weights, over sqrt(d).
  ASSERT_EQ(out.per_head_logits.size(), 1u);
  ASSERT_EQ(out.per_head_logits[0].size(), got.size());
  const CsaOptions& o = s->options();
  double scale = 1.0;
  if (!o.norm_weights && !o.proj_weights) {
    const int ds = kD / o.m;
    double sum = 0;
    for (int b = 0; b < o.m; ++b) {
      double n2 = 0;
      for (int t = 0; t < ds; ++t) n2 += double(q[b * ds + t]) * q[b * ds + t];
      sum += std::sqrt(n2);
    }
    scale = sum / o.m;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double want_logit = acc[got[i]] * scale / std::sqrt(double(kD));
    EXPECT_NEAR(out.per_head_logits[0][i], want_logit, 1e-3 * (1 + std::abs(want_logit)))
        << "token " << got[i];
  }
}

TEST(CsaTest, CentroidsAreCosineKMeansOfPooledQueries) {
  Data data = MakeData(512, 1);
  CsaOptions o = SmallOptions();
  auto s = CsaSelector::Build(data.prefill(), o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->L(), 128);  // ceil(0.25 * 512)
  const int ds = kD / o.m;
  for (int b = 0; b < o.m; ++b) {
    KMeansOptions ko;
    ko.k = o.C;
    ko.metric = KMeansMetric::kCosine;
    ko.max_iters = o.kmeans_iters;
    ko.seed = o.seed + 7919 * static_cast<uint64_t>(b);
    auto km = KMeans(data.queries.data() + b * ds, kG * data.nq, ds, kD, ko);
    ASSERT_TRUE(km.ok());
    for (int j = 0; j < o.C; ++j) {
      for (int t = 0; t < ds; ++t) EXPECT_EQ((*s)->centroid(b, j)[t], km->centroids(j, t));
    }
  }
}

TEST(CsaTest, ListsMatchNaiveDefinition) {
  Data data = MakeData(512, 2);
  for (bool center : {true, false}) {
    CsaOptions o = SmallOptions();
    o.center_keys = center;
    auto s = CsaSelector::Build(data.prefill(), o);
    ASSERT_TRUE(s.ok());
    for (int b = 0; b < o.m; ++b) {
      for (int j = 0; j < o.C; ++j) ExpectListMatches(**s, data.keys.data(), data.n, b, j);
    }
  }
}

TEST(CsaTest, SelectionMatchesNaiveDefinition) {
  Data data = MakeData(512, 3);
  struct Case {
    const char* name;
    void (*apply)(CsaOptions*);
  };
  const Case cases[] = {
      {"uniform", [](CsaOptions*) {}},
      {"norm", [](CsaOptions* o) { o->norm_weights = true; }},
      {"proj", [](CsaOptions* o) { o->proj_weights = true; }},
      {"always_backoff_tau3",
       [](CsaOptions* o) {
         o->backoff_cos = 1.0;
         o->tau = 3;
       }},
      {"missing_min", [](CsaOptions* o) { o->impute_min = true; }},
      {"no_forced",
       [](CsaOptions* o) {
         o->sinks = 0;
         o->recent = 0;
       }},
      {"rho_0.2", [](CsaOptions* o) { o->rho = 0.2; }},
  };
  CsaOptions base = SmallOptions();
  auto built = CsaSelector::Build(data.prefill(), base);
  ASSERT_TRUE(built.ok());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    CsaOptions o = base;
    c.apply(&o);
    ASSERT_TRUE((*built)->SetRetrievalOptions(o).ok());
    for (int t = 0; t < 6; ++t)
      ExpectSelectionMatches(built->get(), data.decode.data() + t * kD, 0);
    ExpectSelectionMatches(built->get(), data.decode.data(), 50);
  }
  // Budget below the forced set: only sinks + recent come back.
  ASSERT_TRUE((*built)->SetRetrievalOptions(base).ok());
  SelectInput in;
  in.queries = data.decode.data();
  in.n_queries = 1;
  in.budget = 3;
  Selection out;
  ASSERT_TRUE((*built)->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.per_head[0].size(), 4u + 32u);
}

// The key sketch, by its definition (index/csa.h): x = k - kbar, scale =
// fp16(max|x| / 127), code = clamp(round(x / scale), -127, 127).
void ExpectSketchOf(const CsaSelector& s, int64_t id, const float* key) {
  float mx = 0;
  for (int j = 0; j < kD; ++j) mx = std::max(mx, std::fabs(key[j] - s.key_mean()[j]));
  const float scale = Fp16(mx / 127.0f);
  ASSERT_EQ(s.sketch_scale(id), scale) << "token " << id;
  for (int j = 0; j < kD; ++j) {
    const float x = key[j] - s.key_mean()[j];
    const int want = scale > 0 ? static_cast<int>(std::clamp<float>(std::nearbyint(x / scale),
                                                                     -127, 127))
                               : 0;
    ASSERT_EQ(s.sketch_codes(id)[j], want) << "token " << id << " dim " << j;
    EXPECT_LE(std::fabs(scale * s.sketch_codes(id)[j] - x), 0.5f * scale * 1.01f + 1e-6f);
  }
}

// Built on the first n0 tokens of `data`, the rest appended one by one;
// each appended token is passed to `check` (may be null) after its Append.
std::unique_ptr<CsaSelector> BuildThenAppend(const Data& data, int64_t n0, const CsaOptions& o,
                                             void (*check)(const CsaSelector&, int64_t,
                                                           const float*) = nullptr) {
  Data first = data;
  first.n = n0;
  first.keys.resize(n0 * kD);
  auto s = CsaSelector::Build(first.prefill(), o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  for (int64_t i = n0; i < data.n; ++i) {
    EXPECT_TRUE((*s)->Append(data.keys.data() + i * kD, nullptr, nullptr).ok());
    if (check) check(**s, i, data.keys.data() + i * kD);
  }
  return std::move(*s);
}

// The sketch score of token i for query q, by its definition: q quantized to
// int16 codes of max magnitude 2047, an exact integer dot product.
float NaiveSketchScore(const CsaSelector& s, const float* q, int64_t i) {
  float mx = 0;
  for (int j = 0; j < kD; ++j) mx = std::max(mx, std::fabs(q[j]));
  const float qs = mx / 2047.0f;
  int64_t dot = 0;
  for (int j = 0; j < kD; ++j) {
    const int qi = qs > 0 ? static_cast<int>(std::nearbyint(q[j] / qs)) : 0;
    dot += int64_t{qi} * s.sketch_codes(i)[j];
  }
  return static_cast<float>(static_cast<double>(dot) *
                            (static_cast<double>(qs) * static_cast<double>(s.sketch_scale(i))));
}

// Stage 2 (rerank > 0): the forced tokens plus the best of the candidates by
// the sketch score, ties to the lower id; logits r / sqrt(d). With rerank 64
// every token is a candidate, so stage 1 cannot hide a difference.
TEST(CsaTest, RerankMatchesNaiveDefinition) {
  Data data = MakeData(512, 3);
  for (double rerank : {64.0, 2.0}) {
    SCOPED_TRACE(rerank);
    CsaOptions o = SmallOptions();
    o.rerank = rerank;
    auto s = CsaSelector::Build(data.prefill(), o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*s)->has_sketch());
    for (int64_t i = 0; i < data.n; ++i) ExpectSketchOf(**s, i, data.keys.data() + i * kD);
    const int64_t n = data.n;
    const int64_t k = 100;  // above the 36 forced tokens
    for (int t = 0; t < 6; ++t) {
      const float* q = data.decode.data() + t * kD;
      std::vector<double> acc;
      NaiveSelect(**s, q, k, &acc);
      std::set<int32_t> forced;
      for (int64_t i = 0; i < o.sinks; ++i) forced.insert(static_cast<int32_t>(i));
      for (int64_t i = n - o.recent; i < n; ++i) forced.insert(static_cast<int32_t>(i));
      const int64_t n_forced = static_cast<int64_t>(forced.size());
      // Stage 1: the top ceil(rerank * k) - |forced| others by the estimate.
      std::vector<std::pair<double, int32_t>> rest;
      for (int32_t i = 0; i < n; ++i) {
        if (!forced.count(i)) rest.emplace_back(-acc[i], i);
      }
      std::sort(rest.begin(), rest.end());
      const int64_t want =
          std::min<int64_t>(n - n_forced, static_cast<int64_t>(std::ceil(rerank * k)) - n_forced);
      std::vector<std::pair<float, int32_t>> cand;  // (-r, id)
      for (int64_t c = 0; c < want; ++c) {
        cand.emplace_back(-NaiveSketchScore(**s, q, rest[c].second), rest[c].second);
      }
      std::sort(cand.begin(), cand.end());
      std::set<int32_t> expect(forced.begin(), forced.end());
      for (int64_t c = 0; c < k - n_forced; ++c) expect.insert(cand[c].second);
      SelectInput in;
      in.queries = q;
      in.n_queries = 1;
      in.budget = k;
      Selection out;
      ASSERT_TRUE((*s)->Select(in, &out, nullptr).ok());
      const std::vector<int32_t>& got = out.per_head[0];
      ASSERT_EQ(static_cast<int64_t>(got.size()), k);
      std::vector<int32_t> differ;
      std::set_symmetric_difference(got.begin(), got.end(), expect.begin(), expect.end(),
                                    std::back_inserter(differ));
      // rerank 64: exact; rerank 2: stage 1's float-vs-double near-ties may
      // swap a candidate at its boundary.
      EXPECT_LE(differ.size(), rerank == 64.0 ? 0u : 2u) << "query " << t;
      ASSERT_EQ(out.per_head_logits[0].size(), got.size());
      for (size_t e = 0; e < got.size(); ++e) {
        EXPECT_EQ(out.per_head_logits[0][e],
                  NaiveSketchScore(**s, q, got[e]) * (1.0f / std::sqrt(static_cast<float>(kD))))
            << "token " << got[e];
      }
    }
  }
}

// The sketch round trips through both forms (appended tokens included),
// selections stay identical, and an index without one refuses rerank.
TEST(CsaTest, KeySketchRoundTripsAndFollowsAppends) {
  Data data = MakeData(600, 5);
  CsaOptions o = SmallOptions();
  o.rerank = 4;
  auto s = BuildThenAppend(data, 500, o, ExpectSketchOf);
  ASSERT_NE(s, nullptr);
  std::string plain, compact;
  s->SerializePlain(&plain);
  s->SerializeCompact(&compact);
  for (const std::string* bytes : {&plain, &compact}) {
    auto loaded = CsaSelector::Load(*bytes);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    ASSERT_TRUE((*loaded)->has_sketch());
    EXPECT_EQ((*loaded)->options().rerank, 4.0);
    for (int64_t i = 0; i < 600; ++i) {
      ASSERT_EQ((*loaded)->sketch_scale(i), s->sketch_scale(i));
      ASSERT_EQ(std::memcmp((*loaded)->sketch_codes(i), s->sketch_codes(i), kD), 0);
    }
    if (bytes == &plain) {
      for (int t = 0; t < 6; ++t) {
        SelectInput in;
        in.queries = data.decode.data() + t * kD;
        in.n_queries = 1;
        Selection a, b;
        ASSERT_TRUE(s->Select(in, &a, nullptr).ok());
        ASSERT_TRUE((*loaded)->Select(in, &b, nullptr).ok());
        EXPECT_EQ(a.per_head, b.per_head);
        EXPECT_EQ(a.per_head_logits, b.per_head_logits);
      }
    }
    // Corruption: a code of -128, a truncated sketch, a sketch whose rerank is 0.
    std::string bad = *bytes;
    bad[bad.size() - 2 * 600 - 1] = static_cast<char>(-128);  // the last token's last code
    EXPECT_EQ(CsaSelector::Load(bad).status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(CsaSelector::Load(bytes->substr(0, bytes->size() - 1)).status().code(),
              StatusCode::kDataLoss);
    bad = *bytes;
    const size_t header = bad.size() - 2 * 600 - 600 * kD - 9;
    const double zero = 0;
    std::memcpy(&bad[header], &zero, sizeof(zero));
    auto z = CsaSelector::Load(bad);
    EXPECT_EQ(z.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(z.status().message().find("rerank"), std::string_view::npos) << z.status().ToString();
  }
  // Built with rerank 0: no sketch stored, and rerank refused.
  CsaOptions none = SmallOptions();
  auto plain_lists = CsaSelector::Build(data.prefill(), none);
  ASSERT_TRUE(plain_lists.ok());
  EXPECT_FALSE((*plain_lists)->has_sketch());
  CsaOptions want = none;
  want.rerank = 2;
  Status st = (*plain_lists)->SetRetrievalOptions(want);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("rerank=2"), std::string_view::npos) << st.ToString();
  // And rerank can be switched off on an index that has one.
  want = s->options();
  want.rerank = 0;
  EXPECT_TRUE(s->SetRetrievalOptions(want).ok());
}

// A decode session's `rerank` param (session/session_params.h) reaches its own
// selector through ApplySessionOverrides: the same selections as an index
// whose options say that factor, and the shared tables stay as built.
TEST(CsaTest, SessionOverridesSetRerankPerSession) {
  Data data = MakeData(600, 5);
  CsaOptions o = SmallOptions();
  o.rerank = 6;
  auto built = CsaSelector::Build(data.prefill(), o);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  for (double factor : {0.0, 2.0, 12.0}) {
    std::unique_ptr<Selector> session = (*built)->Clone();
    char text[16];
    std::snprintf(text, sizeof(text), "%g", factor);
    ASSERT_TRUE(session->ApplySessionOverrides({{"rerank", text}}).ok()) << text;
    CsaOptions want_o = (*built)->options();
    want_o.rerank = factor;
    std::unique_ptr<Selector> want = (*built)->Clone();
    ASSERT_TRUE(static_cast<CsaSelector*>(want.get())->SetRetrievalOptions(want_o).ok());
    EXPECT_EQ(static_cast<CsaSelector*>(session.get())->options().rerank, factor);
    int differ_from_built = 0;
    for (int t = 0; t < 5; ++t) {
      SelectInput in;
      in.queries = data.decode.data() + t * kD;
      in.n_queries = 1;
      in.budget = 100;  // above the 36 forced tokens
      Selection a, b, c;
      ASSERT_TRUE(session->Select(in, &a, nullptr).ok());
      ASSERT_TRUE(want->Select(in, &b, nullptr).ok());
      std::unique_ptr<Selector> as_built = (*built)->Clone();
      ASSERT_TRUE(as_built->Select(in, &c, nullptr).ok());
      EXPECT_EQ(a.per_head, b.per_head) << "rerank " << factor << " query " << t;
      EXPECT_EQ(a.per_head_logits, b.per_head_logits);
      differ_from_built += a.per_head != c.per_head;
    }
    // The factor matters: 0 (the lists alone) and 2 pick other tokens than
    // 6 for some query; 12 may agree with 6 on this small index.
    if (factor < 6) {
      EXPECT_GT(differ_from_built, 0) << "rerank " << factor;
    }
  }
  EXPECT_EQ((*built)->options().rerank, 6.0);  // the clones' overrides stay theirs
  // Bad overrides name the param and change nothing.
  std::unique_ptr<Selector> s = (*built)->Clone();
  for (const MethodParams& bad : std::vector<MethodParams>{
           {{"rerank", "0.5"}}, {{"rerank", "65"}}, {{"rerank", "x"}}, {{"rho", "0.1"}}}) {
    Status st = s->ApplySessionOverrides(bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad.begin()->first;
    EXPECT_NE(st.message().find(bad.begin()->first), std::string_view::npos) << st.ToString();
    EXPECT_EQ(static_cast<CsaSelector*>(s.get())->options().rerank, 6.0);
  }
  // An index built without the sketch serves rerank 0 only.
  auto plain_lists = CsaSelector::Build(data.prefill(), SmallOptions());
  ASSERT_TRUE(plain_lists.ok());
  EXPECT_TRUE((*plain_lists)->ApplySessionOverrides({{"rerank", "0"}}).ok());
  Status st = (*plain_lists)->ApplySessionOverrides({{"rerank", "4"}});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("key sketch"), std::string_view::npos) << st.ToString();
  EXPECT_TRUE((*plain_lists)->ApplySessionOverrides({}).ok());
}

TEST(CsaTest, UnionOverHeadsForcedTokensAndStats) {
  Data data = MakeData(512, 4);
  auto s = CsaSelector::Build(data.prefill(), SmallOptions());
  ASSERT_TRUE(s.ok());
  SelectInput in;
  in.queries = data.decode.data();
  in.n_queries = kG;
  in.budget = 60;
  Selection out;
  WorkStats stats;
  ASSERT_TRUE((*s)->Select(in, &out, &stats).ok());
  ASSERT_EQ(out.per_head.size(), static_cast<size_t>(kG));
  std::set<int32_t> u;
  for (const auto& h : out.per_head) {
    EXPECT_EQ(h.size(), 60u);
    u.insert(h.begin(), h.end());
    for (int32_t i : {0, 1, 2, 3, 480, 511}) EXPECT_TRUE(std::binary_search(h.begin(), h.end(), i));
  }
  EXPECT_EQ(out.merged, std::vector<int32_t>(u.begin(), u.end()));
  // m lists of L entries per head (no backoff here or more), plus centroids.
  EXPECT_GE(stats.entries_touched, static_cast<uint64_t>(kG) * (4 * 128 + 4 * 16));
  EXPECT_EQ(stats.keys_scored, 0u);
  EXPECT_GT(stats.bytes_touched, stats.entries_touched * 4);
}

TEST(CsaTest, StreamingInsertKeepsListsEqualToRebuild) {
  Data data = MakeData(600, 5);
  CsaOptions o = SmallOptions();
  o.fixed_L = 100;
  auto s = BuildThenAppend(data, 500, o);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->n_tokens(), 600);
  EXPECT_EQ(s->L(), 100);
  int inserted = 0;
  for (int b = 0; b < o.m; ++b) {
    for (int j = 0; j < o.C; ++j) {
      ExpectListMatches(*s, data.keys.data(), 600, b, j);
      for (int64_t e = 0; e < 100; ++e) inserted += s->list_ids(b, j)[e] >= 500;
    }
  }
  EXPECT_GT(inserted, 0);  // the appended keys did enter lists
  // Appended tokens are in the recent window of the next selection.
  SelectInput in;
  in.queries = data.decode.data();
  in.n_queries = 1;
  Selection out;
  ASSERT_TRUE(s->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.per_head[0].back(), 599);
}

TEST(CsaTest, PlainSerializationIsBitExact) {
  Data data = MakeData(512, 6);
  CsaOptions o = SmallOptions();
  o.norm_weights = true;
  o.compact = false;
  auto s = CsaSelector::Build(data.prefill(), o);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE((*s)->Append(data.keys.data(), nullptr, nullptr).ok());
  std::string bytes;
  ASSERT_TRUE((*s)->Serialize(&bytes).ok());
  auto loaded = LoadSelector("csa", bytes);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  std::string again;
  ASSERT_TRUE((*loaded)->Serialize(&again).ok());
  EXPECT_EQ(again, bytes);
  auto* l = static_cast<CsaSelector*>(loaded->get());
  EXPECT_EQ(l->n_tokens(), 513);
  EXPECT_TRUE(l->options().norm_weights);
  for (int b = 0; b < o.m; ++b) {
    for (int j = 0; j < o.C; ++j) {
      ASSERT_TRUE(std::equal(l->list_ids(b, j), l->list_ids(b, j) + l->L(), (*s)->list_ids(b, j)));
      ASSERT_TRUE(
          std::equal(l->list_scores(b, j), l->list_scores(b, j) + l->L(), (*s)->list_scores(b, j)));
    }
  }
  SelectInput in;
  in.queries = data.decode.data();
  in.n_queries = kG;
  Selection a, b2;
  ASSERT_TRUE((*s)->Select(in, &a, nullptr).ok());
  ASSERT_TRUE(l->Select(in, &b2, nullptr).ok());
  EXPECT_EQ(a.per_head, b2.per_head);
  // Clone is a deep copy with the same tables.
  std::string cloned;
  ASSERT_TRUE((*s)->Clone()->Serialize(&cloned).ok());
  EXPECT_EQ(cloned, bytes);
  // Corruption is reported, never a crash.
  for (size_t cut : {size_t{0}, size_t{7}, size_t{100}, bytes.size() - 1}) {
    EXPECT_FALSE(LoadSelector("csa", bytes.substr(0, cut)).ok()) << cut;
  }
  std::string bad = bytes;
  bad[bad.size() - 3 * 1000] ^= 0x7f;  // inside the id array or the scores
  auto r = LoadSelector("csa", bad);
  (void)r;  // may load (scores) or fail (ids); must not crash
}

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// The sketch section of an index built with rerank 0: rerank (double) and
// bits (uint8, 0).
constexpr size_t kNoSketchBytes = sizeof(double) + 1;

template <typename T>
void PutRaw(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// A CSAC version 1 artifact of `s` (what earlier builds wrote and stored
// contexts may hold: per list lo, hi, delta varints, 8-bit codes; layout in
// docs/storage-format.md). Everything before the lists is shared with CSAP.
// (No key sketch: version 1 has none, and `s` is built with rerank 0.)
std::string CompactV1(const CsaSelector& s) {
  std::string plain;
  s.SerializePlain(&plain);
  const int64_t L = s.L();
  const size_t lists = static_cast<size_t>(s.m()) * s.C() * L * 6 + kNoSketchBytes;
  std::string out = "CSAC";
  PutRaw<uint32_t>(&out, 1);
  out += plain.substr(8, plain.size() - lists - 8);
  for (int b = 0; b < s.m(); ++b) {
    for (int j = 0; j < s.C(); ++j) {
      std::vector<std::pair<int32_t, float>> list;
      float lo = INFINITY, hi = -INFINITY;
      for (int64_t e = 0; e < L; ++e) {
        const float v = HalfToFloat(s.list_scores(b, j)[e]);
        list.emplace_back(s.list_ids(b, j)[e], v);
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      std::sort(list.begin(), list.end());
      PutRaw<float>(&out, lo);
      PutRaw<float>(&out, hi);
      int32_t prev = -1;
      for (auto& [id, v] : list) {
        PutVarint(&out, static_cast<uint64_t>(id - prev));
        prev = id;
      }
      const float step = hi > lo ? (hi - lo) / 255.0f : 0.0f;
      for (auto& [id, v] : list) {
        out.push_back(static_cast<char>(step > 0 ? std::lround((v - lo) / step) : 0));
      }
    }
  }
  return out;
}

// Sorted (id, score) pairs of list (b, j).
std::vector<std::pair<int32_t, float>> SortedList(const CsaSelector& s, int b, int j) {
  std::vector<std::pair<int32_t, float>> out;
  for (int64_t e = 0; e < s.L(); ++e) {
    out.emplace_back(s.list_ids(b, j)[e], HalfToFloat(s.list_scores(b, j)[e]));
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CsaTest, CompactV1ArtifactsStillLoadAsDequantizedPlain) {
  Data data = MakeData(512, 7);
  CsaOptions o = SmallOptions();
  auto s = CsaSelector::Build(data.prefill(), o);
  ASSERT_TRUE(s.ok());
  const std::string v1 = CompactV1(**s);
  auto loaded = CsaSelector::Load(v1);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  for (int b = 0; b < o.m; ++b) {
    for (int j = 0; j < o.C; ++j) {
      // Expected: the same id set, each score dequantized from its 8-bit code.
      auto want = SortedList(**s, b, j);
      float lo = INFINITY, hi = -INFINITY;
      for (auto& [id, v] : want) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      const float step = hi > lo ? (hi - lo) / 255.0f : 0.0f;
      for (auto& [id, v] : want) {
        const long q = step > 0 ? std::lround((v - lo) / step) : 0;
        v = HalfToFloat(FloatToHalf(lo + q * step));
      }
      const float root = HalfToFloat((*loaded)->list_scores(b, j)[0]);
      for (int64_t e = 1; e < (*loaded)->L(); ++e) {
        EXPECT_LE(root, HalfToFloat((*loaded)->list_scores(b, j)[e]));  // heap
      }
      ASSERT_EQ(SortedList(**loaded, b, j), want) << "list " << b << "," << j;
    }
  }
}

// Version 4 (written): the same ids; 4-bit codebook scores: at most 16
// distinct values per list, each score's error below a sixteenth of the
// list's range on average; the three id codings round trip.
// Also: a loaded compact list is in the order Build writes (worst entry
// first: ascending score, among equal scores the higher id first), which the
// streaming insert's heap and the append overlay rely on; the loader places
// the entries by a counting sort over the codebook ranks, not a sort.
TEST(CsaTest, CompactV2KeepsIdsAndQuantizesScoresToACodebook) {
  Data data = MakeData(512, 7);
  // L = 128: bitmap ids; L = 8: varints; L = 32: Elias-Fano.
  for (int64_t fixed_L : {int64_t{0}, int64_t{8}, int64_t{32}}) {
    CsaOptions o = SmallOptions();
    o.fixed_L = fixed_L;
    auto s = CsaSelector::Build(data.prefill(), o);
    ASSERT_TRUE(s.ok());
    std::string compact, plain;
    ASSERT_TRUE((*s)->Serialize(&compact).ok());
    (*s)->SerializePlain(&plain);
    ASSERT_EQ(compact.substr(0, 8), std::string("CSAC\x04\0\0\0", 8));
    // 1 byte per entry against 6, plus a codebook per list (min(16, L) fp16).
    EXPECT_LT(compact.size() * (fixed_L == 0 ? 3 : 1), plain.size()) << "L=" << (*s)->L();
    auto loaded = CsaSelector::Load(compact);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    int64_t ties = 0;
    for (int b = 0; b < o.m; ++b) {
      for (int j = 0; j < o.C; ++j) {
        const auto want = SortedList(**s, b, j);
        const auto got = SortedList(**loaded, b, j);
        ASSERT_EQ(got.size(), want.size());
        std::set<float> levels;
        float lo = INFINITY, hi = -INFINITY;
        double err = 0;
        for (size_t e = 0; e < got.size(); ++e) {
          ASSERT_EQ(got[e].first, want[e].first) << "list " << b << "," << j;
          levels.insert(got[e].second);
          lo = std::min(lo, want[e].second);
          hi = std::max(hi, want[e].second);
          err += std::abs(got[e].second - want[e].second);
        }
        EXPECT_LE(levels.size(), 16u);
        EXPECT_LE(err / got.size(), (hi - lo) / 16 + 1e-3) << "list " << b << "," << j;
        const int32_t* ids = (*loaded)->list_ids(b, j);
        const uint16_t* sc = (*loaded)->list_scores(b, j);
        for (int64_t e = 1; e < (*loaded)->L(); ++e) {
          const float prev = HalfToFloat(sc[e - 1]), cur = HalfToFloat(sc[e]);
          ASSERT_TRUE(prev < cur || (prev == cur && ids[e - 1] > ids[e]))
              << "L " << fixed_L << " list " << b << "," << j << " entry " << e;
          ties += prev == cur;
        }
      }
    }
    EXPECT_GT(ties, 0) << "4-bit scores tie; L " << fixed_L;
  }
}

// The compact tables select what the built ones select: recall against the
// exact top-K of the decode queries within 0.02 of the unquantized tables.
TEST(CsaTest, CompactV2RecallEqualsBuiltTables) {
  Data data = MakeData(4096, 11);
  CsaOptions o = SmallOptions();
  o.C = 32;
  auto s = CsaSelector::Build(data.prefill(), o);
  ASSERT_TRUE(s.ok());
  std::string compact;
  (*s)->SerializeCompact(&compact);
  auto loaded = CsaSelector::Load(compact);
  ASSERT_TRUE(loaded.ok());
  const int64_t k = 205;  // 5% of 4096
  const int n_q = static_cast<int>(data.decode.size() / kD);
  double recall_built = 0, recall_compact = 0;
  for (int qi = 0; qi < n_q; ++qi) {
    const float* q = data.decode.data() + qi * kD;
    std::vector<std::pair<float, int32_t>> exact;
    for (int64_t i = 0; i < data.n; ++i) {
      float dot = 0;
      for (int t = 0; t < kD; ++t) dot += q[t] * data.keys[i * kD + t];
      exact.emplace_back(-dot, static_cast<int32_t>(i));
    }
    std::partial_sort(exact.begin(), exact.begin() + k, exact.end());
    std::set<int32_t> top;
    for (int64_t e = 0; e < k; ++e) top.insert(exact[e].second);
    for (CsaSelector* sel : {s->get(), loaded->get()}) {
      SelectInput in;
      in.queries = q;
      in.n_queries = 1;
      in.budget = k;
      Selection out;
      ASSERT_TRUE(sel->Select(in, &out, nullptr).ok());
      int hit = 0;
      for (int32_t id : out.per_head[0]) hit += top.count(id);
      (sel == s->get() ? recall_built : recall_compact) += static_cast<double>(hit) / k / n_q;
    }
  }
  EXPECT_GT(recall_built, 0.2);  // the tables carry signal
  EXPECT_NEAR(recall_compact, recall_built, 0.02);
}

// Default tables at N = 8192 (L = N/4, m·C = 1024 lists): the compact
// artifact is at most 1.0x the bf16 K+V bytes at d = 128 and 1.5x at d = 64.
TEST(CsaTest, CompactV2SizeAgainstKvBytes) {
  for (int d : {64, 128}) {
    const int64_t n = 8192, nq = 2048;
    std::mt19937_64 rng(d);
    std::normal_distribution<float> g(0, 1);
    std::vector<float> keys(n * d), queries(nq * d);
    for (auto& v : keys) v = g(rng);
    for (auto& v : queries) v = g(rng);
    HeadPrefill p;
    p.n_tokens = n;
    p.head_dim = d;
    p.group_size = 1;
    p.keys = keys.data();
    p.n_queries = nq;
    p.queries = queries.data();
    auto s = CsaSelector::Build(p, CsaOptions{});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    const double kv_bytes_per_token = 2.0 * d * 2;
    const double ratio = (*s)->CompactBytesPerToken() / kv_bytes_per_token;
    EXPECT_LE(ratio, d == 128 ? 1.0 : 1.5) << "d=" << d;
    EXPECT_GT(ratio, 0.25) << "d=" << d;  // about 1 byte per entry
    std::printf("csa compact v4, defaults, d=%d: %.3fx the bf16 K+V bytes\n", d, ratio);
  }
}

// Found by fuzz/fuzz_index_csa: a compact list id delta near 2^64 wrapped the
// running id (signed overflow) and loaded negative ids; it is DATA_LOSS, in
// version 1 and in version 2's varint id coding. A bitmap with the wrong
// number of ids, and Elias-Fano ids with a bad k, an extra upper bit or
// truncated, are DATA_LOSS too.
TEST(CsaTest, CompactIdDeltaOverflowIsDataLoss) {
  Data data = MakeData(512, 7);
  CsaOptions o = SmallOptions();
  for (int64_t fixed_L : {int64_t{0}, int64_t{8}, int64_t{32}}) {
    o.fixed_L = fixed_L;
    auto s = CsaSelector::Build(data.prefill(), o);
    ASSERT_TRUE(s.ok());
    std::string plain;
    (*s)->SerializePlain(&plain);
    // Every form shares the bytes before the lists with CSAP, whose lists
    // are int32 ids + fp16 scores per entry.
    const size_t lists = static_cast<size_t>(o.m) * o.C * (*s)->L() * 6 + kNoSketchBytes;
    ASSERT_GT(plain.size(), lists);
    const size_t prefix = plain.size() - lists;
    auto overflow = [&](const std::string& bytes, size_t at) {
      ASSERT_TRUE(CsaSelector::Load(bytes).ok());
      size_t end = at;
      while (end < bytes.size() && (static_cast<uint8_t>(bytes[end]) & 0x80) != 0) ++end;
      ASSERT_LT(end, bytes.size());
      std::string bad = bytes;
      bad.replace(at, end - at + 1, std::string(9, '\xff') + '\x01');  // varint 2^64 - 1
      auto loaded = CsaSelector::Load(bad);
      EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss) << loaded.status().ToString();
    };
    // Version 1: the first list starts with its (lo, hi) floats.
    overflow(CompactV1(**s), prefix + 8);
    std::string v2;
    (*s)->SerializeCompact(&v2);
    // Version 3: the score-bits byte, then the first list's id coding byte.
    const uint8_t coding = static_cast<uint8_t>(v2[prefix + 1]);
    auto data_loss = [](const std::string& bytes) {
      auto loaded = CsaSelector::Load(bytes);
      EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss) << loaded.status().ToString();
    };
    if (fixed_L == 32) {
      // 32 of 512 ids: Elias-Fano (k = 3: 12 low bytes + 12 upper bytes + k)
      // is smaller than 32 varints and a 64-byte bitmap.
      ASSERT_EQ(coding, 2);
      const size_t k_at = prefix + 2;
      const int k = static_cast<uint8_t>(v2[k_at]);
      ASSERT_EQ(k, 3);
      const size_t upper_at = k_at + 1 + (32 * k + 7) / 8;
      const size_t upper_bits = 32 + (511 >> k) + 1;
      const size_t last = upper_at + (upper_bits - 1) / 8;
      std::string bad = v2;
      bad[k_at] = 32;  // k > 31
      data_loss(bad);
      // An extra set bit in the upper bitmap: one id more than L.
      bad = v2;
      size_t clear = upper_at * 8;
      while ((static_cast<uint8_t>(bad[clear / 8]) >> (clear % 8)) & 1) ++clear;
      ASSERT_LT(clear, upper_at * 8 + upper_bits);
      bad[clear / 8] = static_cast<char>(bad[clear / 8] | (1 << (clear % 8)));
      data_loss(bad);
      bad = v2;
      for (size_t i = upper_at; i <= last; ++i) bad[i] = 0;  // no ids at all
      data_loss(bad);
      data_loss(v2.substr(0, upper_at));  // truncated in the ids
      continue;
    }
    if (fixed_L == 8) {
      ASSERT_EQ(coding, 0);  // 8 varints are smaller than a 64-byte bitmap
      overflow(v2, prefix + 2);
    } else {
      ASSERT_EQ(coding, 1);  // 128 of 512 ids: the bitmap is smaller
      std::string bad = v2;
      bad[prefix + 2] = static_cast<char>(bad[prefix + 2] ^ 0x01);  // one id more or less
      auto loaded = CsaSelector::Load(bad);
      EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss) << loaded.status().ToString();
    }
  }
}

// Rows long enough for the sampled threshold (n >= 4096) and scores with many
// fp16 ties: the radix-selected lists still equal the naive definition.
TEST(CsaTest, LongListsWithTiesMatchNaiveDefinition) {
  Data data = MakeData(6000, 12);
  for (auto& v : data.keys) v = std::round(v * 4) / 4;  // coarse keys: tied scores
  CsaOptions o = SmallOptions();
  auto s = CsaSelector::Build(data.prefill(), o);
  ASSERT_TRUE(s.ok());
  for (int b = 0; b < o.m; ++b) {
    for (int j = 0; j < o.C; ++j) ExpectListMatches(**s, data.keys.data(), data.n, b, j);
  }
}

// k-means runs on query_cap of the pooled rows: a build on 1/4 of them keeps
// recall against the exact top-K within 0.05 of the build on all of them.
TEST(CsaTest, SubsampledQueriesKeepRecall) {
  Data data = MakeData(4096, 13);
  data.nq = 2048;  // 4096 pooled rows
  std::mt19937_64 rng(13);
  std::normal_distribution<float> g(0, 1);
  data.queries.resize(kG * data.nq * kD);
  for (int64_t r = 0; r < kG * data.nq; ++r) {
    for (int t = 0; t < kD; ++t) {
      data.queries[r * kD + t] =
          data.decode[(r % (data.decode.size() / kD)) * kD + t] + 0.3f * g(rng);
    }
  }
  auto recall_of = [&](int64_t cap) {
    CsaOptions o = SmallOptions();
    o.C = 32;
    o.query_cap = cap;
    auto s = CsaSelector::Build(data.prefill(), o);
    EXPECT_TRUE(s.ok());
    const int64_t k = 205;
    const int n_q = static_cast<int>(data.decode.size() / kD);
    double recall = 0;
    for (int qi = 0; qi < n_q; ++qi) {
      const float* q = data.decode.data() + qi * kD;
      std::vector<std::pair<float, int32_t>> exact;
      for (int64_t i = 0; i < data.n; ++i) {
        float dot = 0;
        for (int t = 0; t < kD; ++t) dot += q[t] * data.keys[i * kD + t];
        exact.emplace_back(-dot, static_cast<int32_t>(i));
      }
      std::partial_sort(exact.begin(), exact.begin() + k, exact.end());
      std::set<int32_t> top;
      for (int64_t e = 0; e < k; ++e) top.insert(exact[e].second);
      SelectInput in;
      in.queries = q;
      in.n_queries = 1;
      in.budget = k;
      Selection out;
      EXPECT_TRUE((*s)->Select(in, &out, nullptr).ok());
      for (int32_t id : out.per_head[0]) recall += static_cast<double>(top.count(id)) / k / n_q;
    }
    return recall;
  };
  const double all = recall_of(1 << 20), quarter = recall_of(1024);
  EXPECT_GT(all, 0.2);
  EXPECT_NEAR(quarter, all, 0.05);
}

TEST(CsaTest, SearchPeriodReusesSelection) {
  Data data = MakeData(512, 8);
  auto params = ParseParams("m=4,C=16,iters=5,schedule=0.15/4");
  ASSERT_TRUE(params.ok());
  auto sel = BuildSelector("csa", data.prefill(), *params);
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  auto* s = static_cast<CsaSelector*>(sel->get());
  EXPECT_EQ(s->options().period, 4);
  EXPECT_DOUBLE_EQ(s->options().rho, 0.15);
  SelectInput in;
  in.n_queries = 1;
  Selection first, out;
  WorkStats stats;
  for (int step = 0; step < 6; ++step) {
    in.queries = data.decode.data() + step * kD;  // a different query each step
    ASSERT_TRUE(s->Select(in, &out, &stats).ok());
    if (step == 0) {
      first = out;
      EXPECT_EQ(out.per_head[0].size(), 77u);  // ceil(0.15 * 512)
      EXPECT_GT(stats.entries_touched, 0u);
      ASSERT_TRUE(s->Append(data.keys.data(), nullptr, nullptr).ok());  // token 512
    } else if (step < 4) {
      EXPECT_EQ(stats.entries_touched, 0u) << step;
      auto want = first.per_head[0];
      want.push_back(512);
      EXPECT_EQ(out.per_head[0], want) << step;
    } else if (step == 4) {
      EXPECT_GT(stats.entries_touched, 0u);  // searched again
    }
  }
}

// m = 0 (the default) picks the subspaces by head_dim: the largest divisor
// <= min(16, d / 4); the built selector, its params and its artifact carry the
// resolved m, and an explicit m is kept.
TEST(CsaTest, DefaultSubspacesFollowHeadDim) {
  EXPECT_EQ(CsaSubspaces(0, 128), 16);
  EXPECT_EQ(CsaSubspaces(0, 64), 16);
  EXPECT_EQ(CsaSubspaces(0, 32), 8);
  EXPECT_EQ(CsaSubspaces(0, 16), 4);
  EXPECT_EQ(CsaSubspaces(0, 33), 3);
  EXPECT_EQ(CsaSubspaces(0, 4), 1);
  EXPECT_EQ(CsaSubspaces(0, 2), 1);
  EXPECT_EQ(CsaSubspaces(8, 64), 8);
  EXPECT_EQ(CsaOptions{}.m, 0);
  Data data = MakeData(512, 3);  // head_dim kD
  CsaOptions o = SmallOptions();
  o.m = 0;
  auto s = CsaSelector::Build(data.prefill(), o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->m(), CsaSubspaces(0, kD));
  std::string bytes;
  ASSERT_TRUE((*s)->Serialize(&bytes).ok());
  auto loaded = CsaSelector::Load(bytes);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->m(), CsaSubspaces(0, kD));
}

TEST(CsaTest, BadParametersAreInvalidArgument) {
  Data data = MakeData(512, 9);
  const struct {
    const char* params;
    const char* expect;  // substring of the message
  } cases[] = {
      {"m=5", "does not divide"},
      {"m=-1", "'m'"},
      {"C=600", "exceeds n_tokens"},
      {"C=300", "pooled query rows"},
      {"rho=0", "(0, 1]"},
      {"rho=1.5", "'rho'"},
      {"alpha=0", "'alpha'"},
      {"alpha=2", "'alpha'"},
      {"tau=0", "'tau'"},
      {"C=16,tau=17", "tau"},
      {"period=0", "'period'"},
      {"schedule=0.3/2", "'schedule'"},
      {"weights=foo", "'weights'"},
      {"backoff_cos=2", "'backoff_cos'"},
      {"R=-1", "'R'"},
      {"bogus=1", "unknown parameter"},
      {"m=abc", "'m'"},
      {"format=zip", "'format'"},
      {"rerank=0.5", "rerank"},
      {"rerank=65", "'rerank'"},
      {"rerank=-1", "'rerank'"},
  };
  for (const auto& c : cases) {
    auto params = ParseParams(c.params);
    ASSERT_TRUE(params.ok()) << c.params;
    auto s = BuildSelector("csa", data.prefill(), *params);
    ASSERT_FALSE(s.ok()) << c.params;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << c.params;
    EXPECT_NE(s.status().message().find(c.expect), std::string_view::npos)
        << c.params << ": " << s.status().ToString();
  }
  // Shape and content errors in the prefill.
  Data bad = data;
  bad.keys[17] = NAN;
  EXPECT_EQ(BuildSelector("csa", bad.prefill(), {}).status().code(), StatusCode::kInvalidArgument);
  bad = data;
  bad.queries[3] = INFINITY;
  EXPECT_EQ(BuildSelector("csa", bad.prefill(), {}).status().code(), StatusCode::kInvalidArgument);
  HeadPrefill p = data.prefill();
  p.n_queries = 513;
  EXPECT_EQ(BuildSelector("csa", p, {}).status().code(), StatusCode::kInvalidArgument);
  p = data.prefill();
  p.group_size = 0;
  EXPECT_EQ(BuildSelector("csa", p, {}).status().code(), StatusCode::kInvalidArgument);
  p = data.prefill();
  p.queries = nullptr;
  EXPECT_EQ(BuildSelector("csa", p, {}).status().code(), StatusCode::kInvalidArgument);
  p = data.prefill();
  p.head_dim = 0;
  EXPECT_EQ(BuildSelector("csa", p, {}).status().code(), StatusCode::kInvalidArgument);
  // Select / Append inputs.
  auto s = CsaSelector::Build(data.prefill(), SmallOptions());
  ASSERT_TRUE(s.ok());
  std::vector<float> q(kD, 1.0f);
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 0;
  Selection out;
  EXPECT_EQ((*s)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);
  in.n_queries = 1;
  in.budget = -1;
  EXPECT_EQ((*s)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);
  in.budget = 0;
  q[2] = NAN;
  EXPECT_EQ((*s)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->Append(q.data(), nullptr, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->Append(nullptr, nullptr, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadSelector("csa", "garbage").status().code(), StatusCode::kInvalidArgument);
}

// Issue #19 finding 1: clones share the immutable tables, and a clone's
// appended tokens live in its own overlay. Selections over base + overlay
// equal those of a selector whose lists hold the appended tokens in its base
// tables (the serialized form loaded back), for every missing-score rule.
TEST(CsaTest, ClonesShareTablesAndAppendOverlayMatchesRewrittenLists) {
  Data data = MakeData(700, 17);
  for (const char* missing : {"zero", "min", "mean"}) {
    CsaOptions o = SmallOptions();
    o.fixed_L = 120;
    o.compact = false;  // plain: the loaded lists are bit-exact
    o.impute_min = std::string(missing) == "min";
    o.impute_tail_mean = std::string(missing) == "mean";
    Data first = data;
    first.n = 500;
    first.keys.resize(500 * kD);
    auto built = CsaSelector::Build(first.prefill(), o);
    ASSERT_TRUE(built.ok());
    std::unique_ptr<Selector> a = (*built)->Clone();
    std::unique_ptr<Selector> b = (*built)->Clone();
    auto* ca = static_cast<CsaSelector*>(a.get());
    auto* cb = static_cast<CsaSelector*>(b.get());
    EXPECT_TRUE(ca->SharesTablesWith(**built));
    // Base lists are sorted worst first (the overlay relies on it), built or
    // loaded from either form.
    std::string compact_bytes;
    (*built)->SerializeCompact(&compact_bytes);
    auto from_compact = CsaSelector::Load(compact_bytes);
    ASSERT_TRUE(from_compact.ok());
    for (const CsaSelector* s : {built->get(), from_compact->get()}) {
      for (int b = 0; b < o.m; ++b) {
        for (int j = 0; j < o.C; ++j) {
          const int32_t* ids = s->list_ids(b, j);
          const uint16_t* sc = s->list_scores(b, j);
          for (int64_t e = 1; e < s->L(); ++e) {
            const float prev = HalfToFloat(sc[e - 1]), cur = HalfToFloat(sc[e]);
            ASSERT_TRUE(cur > prev || (cur == prev && ids[e] < ids[e - 1])) << b << "," << j;
          }
        }
      }
    }
    EXPECT_TRUE(cb->SharesTablesWith(*ca));
    // A clone's own state is small next to the tables.
    EXPECT_LT(ca->SessionBytes() * 20, ca->TableBytes());
    for (int64_t i = 500; i < 700; ++i) {
      ASSERT_TRUE(a->Append(data.keys.data() + i * kD, nullptr, nullptr).ok());
    }
    // The other clone and the original do not see a's tokens.
    EXPECT_EQ(b->n_tokens(), 500);
    EXPECT_TRUE(cb->SharesTablesWith(*ca));
    std::string bytes, bytes_b, bytes_built;
    ASSERT_TRUE(a->Serialize(&bytes).ok());
    ASSERT_TRUE(b->Serialize(&bytes_b).ok());
    ASSERT_TRUE((*built)->Serialize(&bytes_built).ok());
    EXPECT_EQ(bytes_b, bytes_built);
    auto loaded = LoadSelector("csa", bytes);
    ASSERT_TRUE(loaded.ok());
    EXPECT_EQ((*loaded)->n_tokens(), 700);
    // Overlay bytes grow with the appended tokens only.
    EXPECT_GT(ca->SessionBytes(), cb->SessionBytes());
    SelectInput in;
    in.n_queries = kG;
    in.want_log_normalizer = true;
    for (int step = 0; step < 8; ++step) {
      in.queries = data.decode.data() + (step % 4) * kD;
      in.budget = step % 2 ? 0 : 90;
      Selection x, y;
      ASSERT_TRUE(a->Select(in, &x, nullptr).ok());
      ASSERT_TRUE((*loaded)->Select(in, &y, nullptr).ok());
      EXPECT_EQ(x.per_head, y.per_head) << missing << " step " << step;
      EXPECT_EQ(x.per_head_logits, y.per_head_logits) << missing << " step " << step;
      EXPECT_EQ(x.per_head_log_normalizer, y.per_head_log_normalizer) << missing;
    }
    // A clone of a clone carries the overlay (deep copy) and still shares.
    std::unique_ptr<Selector> a2 = a->Clone();
    EXPECT_TRUE(static_cast<CsaSelector*>(a2.get())->SharesTablesWith(*ca));
    std::string bytes2;
    ASSERT_TRUE(a2->Serialize(&bytes2).ok());
    EXPECT_EQ(bytes2, bytes);
    ASSERT_TRUE(a2->Append(data.keys.data(), nullptr, nullptr).ok());
    std::string after;
    ASSERT_TRUE(a->Serialize(&after).ok());
    EXPECT_EQ(after, bytes);
  }
}

}  // namespace
}  // namespace ctxcache::index
