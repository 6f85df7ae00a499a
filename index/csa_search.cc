// CsaSelector's retrieval: the session options, SearchOne and Select (list
// accumulation, then the key-sketch rerank), and the list views.
#include "index/csa.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "common/dtype.h"
#include "common/thread_pool.h"
#include "index/byte_io.h"
#include "index/csa_internal.h"
#include "index/metrics.h"
#include "index/oracle.h"
#include "index/params.h"

namespace ctxcache::index {

using csa_internal::kSketchQueryMaxCode;
using csa_internal::kEntryBytes;
using csa_internal::Half;
using csa_internal::Beats;
using csa_internal::SearchScratch;
using csa_internal::Scratch;
using csa_internal::CheckOptions;

namespace csa_internal {

SearchScratch& Scratch() {
  static thread_local SearchScratch scratch;
  return scratch;
}

}  // namespace csa_internal

namespace {

// acc[ids[e]] += w * scores[e] + bias for e < L.
void AccumulateList(const int32_t* ids, const uint16_t* sc, int64_t L, float w, float bias,
                    float* acc) {
  int64_t e = 0;
#ifdef __F16C__
  const __m256 wv = _mm256_set1_ps(w);
  const __m256 bv = _mm256_set1_ps(bias);
  alignas(32) float t[8];
  for (; e + 8 <= L; e += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + e));
    _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtph_ps(h), wv, bv));
    const int32_t* id = ids + e;
    acc[id[0]] += t[0];
    acc[id[1]] += t[1];
    acc[id[2]] += t[2];
    acc[id[3]] += t[3];
    acc[id[4]] += t[4];
    acc[id[5]] += t[5];
    acc[id[6]] += t[6];
    acc[id[7]] += t[7];
  }
#endif
  for (; e < L; ++e) acc[ids[e]] += w * Half(sc[e]) + bias;
}

// The query side of a sketch score: q_j ~ qs * qi_j with int16 qi_j in
// [-2047, 2047] (qs = max|q_j| / 2047; 0 when q is 0), so that
// sum_j qi_j * code_j is an exact int32 for d <= 4096.
float SketchQuery(const float* q, int d, int16_t* qi) {
  float mx = 0;
  for (int j = 0; j < d; ++j) mx = std::max(mx, std::fabs(q[j]));
  const float qs = mx / static_cast<float>(kSketchQueryMaxCode);
  for (int j = 0; j < d; ++j) {
    qi[j] = static_cast<int16_t>(qs > 0 ? std::nearbyint(q[j] / qs) : 0.0f);
  }
  return qs;
}

// sum_j qi[j] * code[j], exact (integer arithmetic: any order gives it).
int32_t SketchDot(const int16_t* qi, const int8_t* code, int d) {
  int j = 0;
  int32_t total = 0;
#ifdef __AVX2__
  __m256i acc = _mm256_setzero_si256();
  for (; j + 16 <= d; j += 16) {
    const __m256i c =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + j)));
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qi + j));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(c, qv));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  for (int32_t v : lanes) total += v;
#endif
  for (; j < d; ++j) total += static_cast<int32_t>(qi[j]) * code[j];
  return total;
}

#if defined(__AVX2__) && defined(__F16C__)
// Lane i of the result: the sum of v[i]'s eight int32 lanes.
inline __m256i LaneSums8(const __m256i* v) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]);
  const __m256i h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]);
  const __m256i h67 = _mm256_hadd_epi32(v[6], v[7]);
  // a = [partial sums of v0..v3 over lanes 0-3 | over lanes 4-7]; b for v4..v7.
  const __m256i a = _mm256_hadd_epi32(h01, h23);
  const __m256i b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// SketchDot and the scaling of SketchScores for 8 rows at once (d a multiple
// of 16): out[r] = float(double(dot_r) * (qs * double(half(scale[r])))), the
// same operations in the same order as the one-row path, so the same bits.
inline void SketchScores8(const int16_t* qi, const int8_t* const* rows, const uint16_t* scales,
                          int d, double qs, float* out) {
  __m256i acc[8];
  for (auto& a : acc) a = _mm256_setzero_si256();
  for (int j = 0; j < d; j += 16) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qi + j));
    for (int r = 0; r < 8; ++r) {
      const __m256i c =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + j)));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(c, qv));
    }
  }
  const __m256i dots = LaneSums8(acc);
  const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
  const __m256d q = _mm256_set1_pd(qs);
  const __m256d lo = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(dots)),
                                   _mm256_mul_pd(q, _mm256_cvtps_pd(_mm256_castps256_ps128(sc))));
  const __m256d hi = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(dots, 1)),
                                   _mm256_mul_pd(q, _mm256_cvtps_pd(_mm256_extractf128_ps(sc, 1))));
  _mm_storeu_ps(out, _mm256_cvtpd_ps(lo));
  _mm_storeu_ps(out + 4, _mm256_cvtpd_ps(hi));
}
#endif

}  // namespace

Status CsaSelector::SetRetrievalOptions(const CsaOptions& o) {
  CsaOptions next = options_;
  next.rho = o.rho;
  next.recent = o.recent;
  next.sinks = o.sinks;
  next.tau = o.tau;
  next.backoff_cos = o.backoff_cos;
  next.norm_weights = o.norm_weights;
  next.proj_weights = o.proj_weights;
  next.impute_min = o.impute_min;
  next.impute_tail_mean = o.impute_tail_mean;
  next.period = o.period;
  next.compact = o.compact;
  next.rerank = o.rerank;
  RETURN_IF_ERROR(CheckOptions(next));
  if (next.rerank > 0 && !has_sketch()) {
    return InvalidArgumentError("csa: rerank=" + std::to_string(next.rerank) +
                                " needs the key sketch, which this index was built without "
                                "(rerank=0 at build); expected rerank=0");
  }
  options_ = next;
  steps_since_search_ = 0;
  last_per_head_.clear();
  return Status::OK();
}

Status CsaSelector::ApplySessionOverrides(const MethodParams& overrides) {
  ParamReader pr("csa session", overrides);
  CsaOptions next = options_;
  ASSIGN_OR_RETURN(next.rerank, pr.Double("rerank", options_.rerank, 0.0, 64.0));
  RETURN_IF_ERROR(pr.Finish());
  if (next.rerank == options_.rerank) return Status::OK();
  return SetRetrievalOptions(next);
}

int64_t CsaSelector::AccumulateLists(const float* q, float* norm_sum) {
  const int m = options_.m, C = options_.C, ds = sub_dim();
  SearchScratch& ss = Scratch();
  int64_t lists = 0;
  for (int b = 0; b < m; ++b) {
    const float* qb = q + b * ds;
    Eigen::Map<const Eigen::VectorXf> qv(qb, ds);
    const float norm = qv.norm();
    *norm_sum += norm;
    if (!(norm > 0)) continue;  // a zero sub-query carries no signal
    // CSAttention §3.3 (1): nearest centroid by cosine (centroids are unit).
    Eigen::Map<const RowMatrixXf> cent(centroid(b, 0), C, ds);
    Eigen::Map<Eigen::VectorXf> sims(ss.centroid_sims.data(), C);
    sims.noalias() = cent * qv;
    int best = 0;
    for (int j = 1; j < C; ++j) {
      if (ss.centroid_sims[j] > ss.centroid_sims[best]) best = j;
    }
    const float w = options_.norm_weights ? norm : 1.0f;
    auto weight = [&](int j) { return options_.proj_weights ? ss.centroid_sims[j] : w; };
    // With impute_min, entries add w * (V - min_b); the heap root is min_b.
    auto accumulate = [&](int j, float wj) {
      const int64_t list = static_cast<int64_t>(b) * C + j;
      const float missing = options_.impute_tail_mean ? base_->tail_mean[list]
                            : options_.impute_min     ? WorstScore(list)
                                                      : 0.0f;
      const float bias = -wj * missing;
      AccumulateCurrent(list, wj, bias, ss.acc.data());
    };
    if (options_.tau > 1 && ss.centroid_sims[best] / norm < options_.backoff_cos) {
      // Backoff (seed 004 §4.4): the top-tau centroids, averaged.
      const int tau = std::min(options_.tau, C);
      std::vector<int>& all = ss.order;
      all.resize(C);
      std::iota(all.begin(), all.end(), 0);
      std::partial_sort(all.begin(), all.begin() + tau, all.end(), [&](int a, int c) {
        return ss.centroid_sims[a] > ss.centroid_sims[c] ||
               (ss.centroid_sims[a] == ss.centroid_sims[c] && a < c);
      });
      for (int t = 0; t < tau; ++t) {
        accumulate(all[t], weight(all[t]) / tau);
      }
      lists += tau;
    } else {
      accumulate(best, weight(best));
      ++lists;
    }
  }
  return lists;
}

void CsaSelector::SelectBySketch(const float* q, int64_t k, float to_logit,
                                 std::vector<int32_t>* selected, std::vector<float>* logits,
                                 double* log_normalizer, WorkStats* stats) {
  const int64_t n = n_tokens_;
  SearchScratch& ss = Scratch();
  std::vector<int32_t>& forced = *selected;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d_));
  // Stage 2: the sketch re-scores the forced tokens and the top
  // ceil(rerank * k) - |forced| others by acc; the best of those by the
  // sketch fill the budget.
  const int64_t n_forced = static_cast<int64_t>(forced.size());
  std::vector<int32_t>& cand = ss.cand;
  cand.clear();
  if (k > n_forced) {
    const int64_t want = std::min<int64_t>(
        n - n_forced,
        static_cast<int64_t>(std::ceil(options_.rerank * static_cast<double>(k))) - n_forced);
    ss.forced_acc.clear();
    for (int32_t i : forced) {
      ss.forced_acc.push_back(ss.acc[i]);
      ss.acc[i] = -std::numeric_limits<float>::infinity();
    }
    SelectTopK(ss.acc.data(), n, want, TopKOrder::kById, &cand, &ss.topk);
    for (size_t f = 0; f < forced.size(); ++f) ss.acc[forced[f]] = ss.forced_acc[f];
  }
  ss.forced_r.resize(forced.size());
  SketchScores(q, forced.data(), n_forced, ss.forced_r.data());
  ss.cand_r.resize(cand.size());
  SketchScores(q, cand.data(), static_cast<int64_t>(cand.size()), ss.cand_r.data());
  if (log_normalizer) {
    // Every token's best estimate: the sketch where it was computed.
    const float to_acc = to_logit > 0 ? inv_sqrt_d / to_logit : 0.0f;
    for (size_t f = 0; f < forced.size(); ++f) ss.acc[forced[f]] = ss.forced_r[f] * to_acc;
    for (size_t c = 0; c < cand.size(); ++c) ss.acc[cand[c]] = ss.cand_r[c] * to_acc;
    *log_normalizer = LogSumExp(ss.acc.data(), n, to_logit);
  }
  std::vector<int32_t>& pick = ss.topk_ids;
  pick.clear();
  if (k > n_forced) {
    SelectTopK(ss.cand_r.data(), static_cast<int64_t>(cand.size()), k - n_forced,
               TopKOrder::kById, &pick, &ss.topk);  // positions in cand: ascending ids
  }
  std::vector<int32_t> merged;
  merged.reserve(forced.size() + pick.size());
  if (logits) logits->clear();
  size_t f = 0, c = 0;
  while (f < forced.size() || c < pick.size()) {
    const bool take_forced = c == pick.size() || (f < forced.size() && forced[f] < cand[pick[c]]);
    if (take_forced) {
      merged.push_back(forced[f]);
      if (logits) logits->push_back(ss.forced_r[f] * inv_sqrt_d);
      ++f;
    } else {
      merged.push_back(cand[pick[c]]);
      if (logits) logits->push_back(ss.cand_r[pick[c]] * inv_sqrt_d);
      ++c;
    }
  }
  *selected = std::move(merged);
  if (stats) {
    const uint64_t rows = forced.size() + cand.size();
    stats->entries_touched += rows;
    stats->bytes_touched += rows * (static_cast<uint64_t>(d_) + sizeof(uint16_t));
  }
}

void CsaSelector::SelectByAccumulators(int64_t k, float to_logit, int64_t n_sinks,
                                       int64_t recent_start, std::vector<int32_t>* selected,
                                       std::vector<float>* logits, double* log_normalizer) {
  const int64_t n = n_tokens_;
  SearchScratch& ss = Scratch();
  std::vector<int32_t>& forced = *selected;
  std::vector<float>& forced_acc = ss.forced_acc;
  forced_acc.clear();
  // The normalizer over every token's estimate (tokens in no gathered list
  // keep their imputed value), before the forced tokens are masked.
  if (log_normalizer) *log_normalizer = LogSumExp(ss.acc.data(), n, to_logit);
  for (int32_t i : forced) forced_acc.push_back(ss.acc[i]);
  if (k > static_cast<int64_t>(forced.size())) {
    for (int32_t i : forced) ss.acc[i] = -std::numeric_limits<float>::infinity();
    SelectTopK(ss.acc.data(), n, k - static_cast<int64_t>(forced.size()), TopKOrder::kById,
               &ss.topk_ids, &ss.topk);
    std::vector<int32_t> merged;
    merged.reserve(forced.size() + ss.topk_ids.size());
    std::merge(forced.begin(), forced.end(), ss.topk_ids.begin(), ss.topk_ids.end(),
               std::back_inserter(merged));
    *selected = std::move(merged);
  }
  if (logits) {
    logits->clear();
    size_t f = 0;
    const int64_t n_forced_head = n_sinks;
    for (int32_t id : *selected) {
      const bool is_forced = id < n_forced_head || id >= recent_start;
      float a = is_forced ? forced_acc[f++] : ss.acc[id];
      logits->push_back(a * to_logit);
    }
  }
}

void CsaSelector::SearchOne(const float* q, std::vector<int32_t>* selected,
                            std::vector<float>* logits, double* log_normalizer, WorkStats* stats) {
  const int m = options_.m, C = options_.C, ds = sub_dim();
  const int64_t n = n_tokens_;
  SearchScratch& ss = Scratch();
  if (static_cast<int64_t>(ss.acc.size()) != n) ss.acc.assign(n, 0.0f);
  ss.centroid_sims.resize(C);
  float norm_sum = 0;
  const int64_t lists = AccumulateLists(q, &norm_sum);
  // Forced tokens: sinks and the recent window (§3.3 (4)).
  std::vector<int32_t>& forced = *selected;
  forced.clear();
  const int64_t n_sinks = std::min<int64_t>(options_.sinks, n);
  const int64_t recent_start = std::max<int64_t>(n_sinks, n - options_.recent);
  for (int64_t i = 0; i < n_sinks; ++i) forced.push_back(static_cast<int32_t>(i));
  for (int64_t i = recent_start; i < n; ++i) forced.push_back(static_cast<int32_t>(i));
  const int64_t k = BudgetFor(budget_, options_.rho, n);
  // Logit estimates for the page cap: acc approximates q.k with norm/proj
  // weights; with uniform weights it lacks the sub-query norms, so scale by
  // their mean. Forced tokens keep their accumulated estimate.
  const float to_logit = (options_.norm_weights || options_.proj_weights ? 1.0f : norm_sum / m) /
                         std::sqrt(static_cast<float>(d_));
  if (options_.rerank > 0 && has_sketch()) {
    SelectBySketch(q, k, to_logit, selected, logits, log_normalizer, stats);
  } else {
    SelectByAccumulators(k, to_logit, n_sinks, recent_start, selected, logits, log_normalizer);
  }
  std::fill(ss.acc.begin(), ss.acc.end(), 0.0f);
  if (stats) {
    stats->entries_touched += static_cast<uint64_t>(lists) * L_ + static_cast<uint64_t>(m) * C;
    stats->bytes_touched += static_cast<uint64_t>(lists) * L_ * kEntryBytes +
                            static_cast<uint64_t>(m) * C * ds * sizeof(float);
  }
}

Status CsaSelector::Select(const SelectInput& in, Selection* out, WorkStats* stats) {
  RETURN_IF_ERROR(ValidateSelectInput("csa", in, d_, n_tokens_, /*need_keys=*/false));
  if (stats) *stats = WorkStats{};
  out->estimated_mass = -1.0;
  const bool reuse = options_.period > 1 && steps_since_search_ > 0 &&
                     steps_since_search_ < options_.period &&
                     static_cast<int>(last_per_head_.size()) == in.n_queries;
  if (reuse) {
    out->per_head_logits.clear();  // no estimates for a reused selection
    // Keep the last search's selection; add the tokens appended since.
    out->per_head = last_per_head_;
    out->per_head_log_normalizer.clear();
    for (auto& h : out->per_head) {
      for (int64_t i = n_at_last_search_; i < n_tokens_; ++i) h.push_back(static_cast<int32_t>(i));
      SortUnique(&h);
    }
    ++steps_since_search_;
  } else {
    budget_ = in.budget;
    out->per_head.resize(in.n_queries);
    out->per_head_logits.resize(in.n_queries);
    out->per_head_log_normalizer.resize(in.want_log_normalizer ? in.n_queries : 0);
    for (int h = 0; h < in.n_queries; ++h) {
      SearchOne(in.queries + static_cast<int64_t>(h) * d_, &out->per_head[h],
                &out->per_head_logits[h],
                in.want_log_normalizer ? &out->per_head_log_normalizer[h] : nullptr, stats);
    }
    if (options_.period > 1) {
      last_per_head_ = out->per_head;
      n_at_last_search_ = n_tokens_;
      steps_since_search_ = 1;
    }
  }
  out->merged.clear();
  for (const auto& h : out->per_head) out->merged = UnionSorted(out->merged, h);
  return Status::OK();
}

const int8_t* CsaSelector::sketch_codes(int64_t id) const {
  if (id < n_base_) return base_->sketch.data() + id * d_;
  return overlay_.sketch.data() + (id - n_base_) * d_;
}

float CsaSelector::sketch_scale(int64_t id) const {
  if (id < n_base_) return Half(base_->sketch_scale[static_cast<size_t>(id)]);
  return Half(overlay_.sketch_scale[static_cast<size_t>(id - n_base_)]);
}

void CsaSelector::SketchScores(const float* q, const int32_t* ids, int64_t n, float* out) const {
  std::vector<int16_t>& qi = Scratch().sketch_q;
  qi.resize(static_cast<size_t>(d_));
  const double qs = SketchQuery(q, d_, qi.data());
  // Rows are gathered (ids ascending but sparse): prefetch a few ahead.
  constexpr int64_t kAhead = 8;
  auto prefetch = [&](int64_t e) {
    const int8_t* next = sketch_codes(ids[e]);
    for (int off = 0; off < d_; off += 64) __builtin_prefetch(next + off);
  };
  int64_t e = 0;
#if defined(__AVX2__) && defined(__F16C__)
  // Blocks of 8 stored rows (ids ascending: the stored ones come first).
  if (d_ % 16 == 0) {
    const int8_t* rows[8];
    alignas(16) uint16_t scales[8];
    for (; e + 8 <= n && ids[e + 7] < n_base_; e += 8) {
      for (int64_t a = e + 8; a < std::min(n, e + 8 + kAhead); ++a) prefetch(a);
      for (int r = 0; r < 8; ++r) {
        rows[r] = sketch_codes(ids[e + r]);
        scales[r] = base_->sketch_scale[static_cast<size_t>(ids[e + r])];
      }
      SketchScores8(qi.data(), rows, scales, d_, qs, out + e);
    }
  }
#endif
  for (; e < n; ++e) {
    if (e + kAhead < n) prefetch(e + kAhead);
    const int32_t dot = SketchDot(qi.data(), sketch_codes(ids[e]), d_);
    out[e] = static_cast<float>(static_cast<double>(dot) * (qs * sketch_scale(ids[e])));
  }
}

float CsaSelector::WorstScore(int64_t list) const {
  const Tables& t = *base_;
  const int64_t off = list * L_;
  const ListOverlay* o = overlay(list);
  if (o == nullptr) return Half(t.scores[off]);
  if (o->live.empty()) return Half(t.scores[off + o->n_evicted]);
  const float ls = Half(o->live.front().score);
  if (o->n_evicted >= L_) return ls;
  const int64_t e = off + o->n_evicted;
  const float bs = Half(t.scores[e]);
  return Beats(bs, t.ids[e], ls, o->live.front().id) ? ls : bs;
}

void CsaSelector::MaterializeList(int64_t list, std::vector<int32_t>* ids,
                                  std::vector<uint16_t>* sc) const {
  const Tables& t = *base_;
  const int64_t off = list * L_;
  const ListOverlay* o = overlay(list);
  const int64_t k = o ? o->n_evicted : 0;
  std::vector<Entry> all;
  all.reserve(static_cast<size_t>(L_));
  for (int64_t e = off + k; e < off + L_; ++e) all.push_back(Entry{t.ids[e], t.scores[e]});
  if (o != nullptr) all.insert(all.end(), o->live.begin(), o->live.end());
  // Worst first: a before c when c beats a.
  std::sort(all.begin(), all.end(), [](const Entry& a, const Entry& c) {
    return Beats(Half(c.score), c.id, Half(a.score), a.id);
  });
  ids->resize(all.size());
  sc->resize(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    (*ids)[i] = all[i].id;
    (*sc)[i] = all[i].score;
  }
}

void CsaSelector::ListView(int64_t list, std::vector<int32_t>* ids, std::vector<uint16_t>* sc,
                           const int32_t** ids_out, const uint16_t** sc_out) const {
  if (overlay(list) == nullptr) {
    *ids_out = base_->ids.data() + list * L_;
    *sc_out = base_->scores.data() + list * L_;
    return;
  }
  MaterializeList(list, ids, sc);
  *ids_out = ids->data();
  *sc_out = sc->data();
}

void CsaSelector::AccumulateCurrent(int64_t list, float w, float bias, float* acc) const {
  const int32_t* ids = base_->ids.data() + list * L_;
  const uint16_t* sc = base_->scores.data() + list * L_;
  const ListOverlay* o = overlay(list);
  if (o == nullptr) {
    AccumulateList(ids, sc, L_, w, bias, acc);
    return;
  }
  // The base entries still in the list follow the n_evicted pushed out; the
  // appended ones add what AccumulateList adds (a fused multiply-add).
  const int64_t k = o->n_evicted;
  AccumulateList(ids + k, sc + k, L_ - k, w, bias, acc);
  for (const Entry& e : o->live) acc[e.id] += std::fma(Half(e.score), w, bias);
}

const int32_t* CsaSelector::list_ids(int b, int j) const {
  const int64_t list = static_cast<int64_t>(b) * options_.C + j;
  if (overlay(list) == nullptr) return base_->ids.data() + list * L_;
  for (const auto& v : views_) {
    if (v.first == list) return v.second.first.data();
  }
  views_.emplace_back(list, std::pair<std::vector<int32_t>, std::vector<uint16_t>>());
  MaterializeList(list, &views_.back().second.first, &views_.back().second.second);
  return views_.back().second.first.data();
}

const uint16_t* CsaSelector::list_scores(int b, int j) const {
  const int64_t list = static_cast<int64_t>(b) * options_.C + j;
  if (overlay(list) == nullptr) return base_->scores.data() + list * L_;
  list_ids(b, j);
  for (const auto& v : views_) {
    if (v.first == list) return v.second.second.data();
  }
  return nullptr;  // unreachable: list_ids materialized it
}

}  // namespace ctxcache::index
