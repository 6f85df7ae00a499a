// CsaSelector::Build (k-means per subspace, the lists, the key sketch) and
// Append (a new token into every list and the sketch overlay).
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

using csa_internal::Half;
using csa_internal::Beats;
using csa_internal::Scratch;
using csa_internal::SketchKey;
using csa_internal::CheckOptions;

namespace csa_internal {

// The 8-bit sketch of one key: x = key - mean, scale = fp16(max|x| / 127),
// code_j = clamp(round(x_j / scale), -127, 127) (all 0 when the scale is 0).
void SketchKey(const float* key, const float* mean, int d, int8_t* code, uint16_t* scale) {
  float mx = 0;
  for (int j = 0; j < d; ++j) mx = std::max(mx, std::fabs(key[j] - mean[j]));
  const uint16_t h = FloatToHalf(mx / kSketchMaxCode);
  const float sc = Half(h);
  *scale = h;
  for (int j = 0; j < d; ++j) {
    const float v = sc > 0 ? std::nearbyint((key[j] - mean[j]) / sc) : 0.0f;
    code[j] = static_cast<int8_t>(std::clamp<float>(v, -kSketchMaxCode, kSketchMaxCode));
  }
}

}  // namespace csa_internal

namespace {

using StridedMap = Eigen::Map<const RowMatrixXf, 0, Eigen::OuterStride<>>;

// Order-preserving keys of fp16 bit patterns: a larger value has a larger
// key, and -0 and +0 (equal values) share one key. Branch-free (AVX2 for 16
// at a time): half the scores are negative, in no predictable order.
inline uint16_t HalfKey(uint16_t h) {
  h = h == 0x8000 ? 0 : h;
  const uint16_t flip = static_cast<uint16_t>(static_cast<int16_t>(h) >> 15) | 0x8000;
  return h ^ flip;
}

void HalfKeys(const uint16_t* h, int64_t n, uint16_t* key) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256i neg_zero = _mm256_set1_epi16(static_cast<int16_t>(0x8000));
  for (; i + 16 <= n; i += 16) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i));
    v = _mm256_andnot_si256(_mm256_cmpeq_epi16(v, neg_zero), v);
    const __m256i flip = _mm256_or_si256(_mm256_srai_epi16(v, 15), neg_zero);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(key + i), _mm256_xor_si256(v, flip));
  }
#endif
  for (; i < n; ++i) key[i] = HalfKey(h[i]);
}

// Sum of n floats, accumulated in double (AVX2: 4 independent 4-lane chains).
double SumAsDouble(const float* x, int64_t n) {
  int64_t i = 0;
  double total = 0;
#ifdef __AVX2__
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v0)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v0, 1)));
    a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(v1)));
    a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(v1, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
  total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) total += x[i];
  return total;
}

struct ListScratch {
  std::vector<uint16_t> half;    // n: fp16 scores
  std::vector<uint16_t> key;     // n: HalfKey of each
  std::vector<float> rounded;    // n: the fp16 scores as floats
  std::vector<uint16_t> sample;  // threshold sample
  std::vector<int32_t> cand;     // candidate ids (ascending)
  std::vector<int32_t> kept;     // the list's ids (ascending)
  std::vector<int32_t> sorted;   // the list's ids by (key, id desc)
};

// One list from a row of n fp32 scores: the top L by fp16-rounded score, ties
// to the lower id, written to ids/sc (L each) in ascending (score, -id) order
// (a binary heap with the worst entry at the root). A strided sample of the
// 16-bit order keys gives a threshold below the L-th key with high odds; the
// candidates at or above it (all keys if it was not) go through an exact
// radix select (high byte, then low byte of the boundary bucket), and an
// LSD radix sort orders the L kept entries. Returns the mean fp16 score of
// the n - L keys left out (0 when L == n).
float BuildList(const float* row, int64_t n, int64_t L, ListScratch* s, int32_t* ids,
                uint16_t* sc) {
  s->half.resize(n);
  s->key.resize(n);
  s->rounded.resize(n);
  FloatToHalf(row, s->half.data(), n);
  HalfToFloat(s->half.data(), s->rounded.data(), n);
  HalfKeys(s->half.data(), n, s->key.data());
  const uint16_t* h = s->half.data();
  const uint16_t* key = s->key.data();
  // Candidates: keys >= a sampled threshold (every key for short rows).
  uint16_t floor_key = 0;
  constexpr int64_t kSample = 512;
  if (n >= 8 * kSample && L < n) {
    auto& smp = s->sample;
    smp.resize(kSample);
    const int64_t stride = n / kSample;
    for (int64_t i = 0; i < kSample; ++i) smp[i] = key[i * stride];
    const int64_t expected = L * kSample / n;
    const int64_t rank = std::min<int64_t>(
        kSample - 1,
        expected + 4 * static_cast<int64_t>(std::sqrt(static_cast<double>(expected))) + 16);
    std::nth_element(smp.begin(), smp.begin() + rank, smp.end(), std::greater<uint16_t>());
    floor_key = smp[rank];
  }
  auto& cand = s->cand;
  cand.resize(n + 1);
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    cand[c] = static_cast<int32_t>(i);
    c += key[i] >= floor_key;
  }
  if (c < L) {  // unlucky sample: every key competes
    for (int64_t i = 0; i < n; ++i) cand[i] = static_cast<int32_t>(i);
    c = n;
  }
  // Exact radix select of the L-th largest key among the candidates.
  uint32_t hist[256] = {};
  for (int64_t e = 0; e < c; ++e) ++hist[key[cand[e]] >> 8];
  int64_t above = 0;  // keys in buckets above the boundary bucket
  int hi = 255;
  while (above + hist[hi] < L) above += hist[hi--];
  uint32_t hist_lo[256] = {};
  for (int64_t e = 0; e < c; ++e) {
    const uint16_t k = key[cand[e]];
    if ((k >> 8) == hi) ++hist_lo[k & 0xff];
  }
  int lo = 255;
  while (above + hist_lo[lo] < L) above += hist_lo[lo--];
  const uint16_t threshold = static_cast<uint16_t>((hi << 8) | lo);
  int64_t ties = L - above;  // keys equal to the threshold to keep, lowest ids first
  auto& kept = s->kept;
  kept.resize(c + 1);
  int64_t e_out = 0;
  for (int64_t e = 0; e < c; ++e) {
    const int32_t id = cand[e];
    const uint16_t k = key[id];
    const bool tie = k == threshold && ties > 0;
    ties -= tie;
    kept[e_out] = id;
    e_out += (k > threshold) | tie;
  }
  // LSD radix sort by key (low byte, then high byte), stable over descending
  // ids: ascending (key, -id) is "worst first", a valid binary min-heap.
  uint32_t cnt_lo[257] = {}, cnt_hi[257] = {};
  for (int64_t e = 0; e < L; ++e) {
    const uint16_t k = key[kept[e]];
    ++cnt_lo[(k & 0xff) + 1];
    ++cnt_hi[(k >> 8) + 1];
  }
  for (int b = 0; b < 256; ++b) {
    cnt_lo[b + 1] += cnt_lo[b];
    cnt_hi[b + 1] += cnt_hi[b];
  }
  auto& tmp = s->sorted;
  tmp.resize(L);
  for (int64_t e = L - 1; e >= 0; --e) {
    const int32_t id = kept[e];
    tmp[cnt_lo[key[id] & 0xff]++] = id;
  }
  for (int64_t e = 0; e < L; ++e) {
    const int32_t id = tmp[e];
    ids[cnt_hi[key[id] >> 8]++] = id;
  }
  double in_list[4] = {0, 0, 0, 0};
  for (int64_t e = 0; e < L; ++e) {
    const int32_t id = ids[e];
    sc[e] = h[id];
    in_list[e & 3] += s->rounded[id];
  }
  if (n == L) return 0.0f;
  const double total = SumAsDouble(s->rounded.data(), n);
  const double inside = (in_list[0] + in_list[1]) + (in_list[2] + in_list[3]);
  return static_cast<float>((total - inside) / static_cast<double>(n - L));
}

}  // namespace

StatusOr<std::unique_ptr<CsaSelector>> CsaSelector::Build(const HeadPrefill& p,
                                                          const CsaOptions& options) {
  // The prefill first: without queries the resolved C is 1, and the options'
  // error (tau > C) would hide the cause.
  RETURN_IF_ERROR(ValidatePrefill("csa", p, /*need_queries=*/true, /*need_values=*/false));
  RETURN_IF_ERROR(CheckOptions(options));
  const int d = p.head_dim;
  CsaOptions o = options;
  o.m = CsaSubspaces(o.m, d);
  if (d % o.m != 0) {
    return InvalidArgumentError("csa: m=" + std::to_string(o.m) +
                                " does not divide head_dim=" + std::to_string(d));
  }
  const int64_t n = p.n_tokens;
  if (o.C > n) {
    return InvalidArgumentError("csa: C=" + std::to_string(o.C) +
                                " exceeds n_tokens=" + std::to_string(n));
  }
  const int64_t pooled = static_cast<int64_t>(p.group_size) * p.n_queries;
  const int64_t rows = std::min(pooled, o.query_cap);
  if (o.C > rows) {
    return InvalidArgumentError("csa: C=" + std::to_string(o.C) +
                                " exceeds the pooled query rows (" + std::to_string(rows) +
                                " = min(group_size * n_queries, query_cap))");
  }

  std::unique_ptr<CsaSelector> s(new CsaSelector());
  auto t = std::make_shared<Tables>();
  s->options_ = o;
  s->d_ = d;
  s->n_tokens_ = n;
  s->n_built_ = n;
  s->L_ = o.fixed_L > 0 ? std::min<int64_t>(o.fixed_L, n)
                        : std::clamp<int64_t>(static_cast<int64_t>(std::ceil(o.alpha * n)), 1, n);
  const int m = o.m, C = o.C, ds = d / m;
  const int64_t L = s->L_;

  // Pool the group's queries; subsample deterministically to query_cap rows.
  std::vector<int64_t> rows_idx(pooled);
  std::iota(rows_idx.begin(), rows_idx.end(), 0);
  if (rows < pooled) {
    std::mt19937_64 rng(o.seed);
    for (int64_t i = 0; i < rows; ++i) {
      std::uniform_int_distribution<int64_t> pick(i, pooled - 1);
      std::swap(rows_idx[i], rows_idx[pick(rng)]);
    }
    rows_idx.resize(rows);
    std::sort(rows_idx.begin(), rows_idx.end());
  }
  RowMatrixXf Q(rows, d);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(Q.row(r).data(), p.queries + rows_idx[r] * d, sizeof(float) * d);
  }

  t->key_mean.assign(d, 0.0f);
  if (o.center_keys) {
    // Row by row (contiguous), accumulated in double.
    Eigen::RowVectorXd sum = Eigen::RowVectorXd::Zero(d);
    for (int64_t i = 0; i < n; ++i) {
      sum += Eigen::Map<const Eigen::RowVectorXf>(p.keys + i * d, d).cast<double>();
    }
    Eigen::Map<Eigen::RowVectorXf>(t->key_mean.data(), d) =
        (sum / static_cast<double>(n)).cast<float>();
  }
  t->centroids.resize(static_cast<size_t>(m) * C * ds);
  t->tail_mean.assign(static_cast<size_t>(m) * C, 0.0f);
  t->ids.resize(static_cast<size_t>(m) * C * L);
  t->scores.resize(static_cast<size_t>(m) * C * L);
  // Subspaces are independent: the pool's threads take them one at a time
  // (a nested call from a pool thread runs them all inline); every subspace
  // writes only its own slices.
  std::vector<Status> errs(m);
  std::atomic<int> next_subspace{0};
  ThreadPool* pool = ThreadPool::Default();
  pool->ParallelFor(std::min<size_t>(m, pool->size() + 1), [&](size_t, size_t) {
    RowMatrixXf S;
    ListScratch scratch;
    for (int b = next_subspace++; b < m; b = next_subspace++) {
      KMeansOptions ko;
      ko.k = C;
      ko.metric = KMeansMetric::kCosine;
      ko.init = KMeansInit::kPlusPlus;
      ko.max_iters = o.kmeans_iters;
      ko.seed = o.seed + 7919 * static_cast<uint64_t>(b);
      ko.parallel = false;  // the subspaces are the parallel loop
      auto km = KMeans(Q.data() + b * ds, rows, ds, d, ko);
      if (!km.ok()) {
        errs[b] = km.status().WithContext("csa: subspace " + std::to_string(b));
        continue;
      }
      const RowMatrixXf& cent = km->centroids;
      std::memcpy(t->centroids.data() + static_cast<size_t>(b) * C * ds, cent.data(),
                  sizeof(float) * C * ds);
      // CSAttention §3.2 (2): s_j^b(i) = c_j^b . k_i^b for all centroids and keys,
      // kRowsPerGemm centroids at a time (the score rows stay in cache for
      // BuildList).
      StridedMap Kb(p.keys + b * ds, n, ds, Eigen::OuterStride<>(d));
      Eigen::VectorXf shift = Eigen::VectorXf::Zero(C);
      if (o.center_keys) {
        Eigen::Map<const Eigen::VectorXf> kbar(t->key_mean.data() + b * ds, ds);
        shift = cent * kbar;
      }
      constexpr int kRowsPerGemm = 16;
      for (int j0 = 0; j0 < C; j0 += kRowsPerGemm) {
        const int rows_j = std::min(kRowsPerGemm, C - j0);
        S.noalias() = cent.middleRows(j0, rows_j) * Kb.transpose();
        if (o.center_keys) S.colwise() -= shift.segment(j0, rows_j);
        for (int r = 0; r < rows_j; ++r) {
          const int j = j0 + r;
          const int64_t off = s->ListOffset(b, j);
          t->tail_mean[b * C + j] = BuildList(S.row(r).data(), n, L, &scratch,
                                               t->ids.data() + off, t->scores.data() + off);
        }
      }
    }
  });
  for (const Status& e : errs) RETURN_IF_ERROR(e);
  if (o.rerank > 0) {
    t->sketch.resize(static_cast<size_t>(n) * d);
    t->sketch_scale.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      SketchKey(p.keys + i * d, t->key_mean.data(), d, t->sketch.data() + i * d,
                &t->sketch_scale[static_cast<size_t>(i)]);
    }
  }
  s->n_base_ = n;
  s->base_ = std::move(t);
  return s;
}

Status CsaSelector::Append(const float* key, const float* /*value*/, const float* /*queries*/) {
  if (key == nullptr) return InvalidArgumentError("csa: Append key is null");
  if (HasNonFinite(key, d_)) return InvalidArgumentError("csa: Append key has NaN/Inf");
  if (n_tokens_ >= INT32_MAX) return ResourceExhaustedError("csa: token ids exhausted");
  const int m = options_.m, C = options_.C, ds = sub_dim();
  const int32_t id = static_cast<int32_t>(n_tokens_);
  const Tables& t = *base_;
  std::vector<float>& sims_v = Scratch().centroid_sims;
  sims_v.resize(C);
  views_.clear();
  if (overlay_.lists.empty()) overlay_.lists.resize(static_cast<size_t>(m) * C);
  // Heap of appended entries with the worst in front: "less" is Beats.
  auto live_less = [](const Entry& x, const Entry& y) {
    return Beats(Half(x.score), x.id, Half(y.score), y.id);
  };
  for (int b = 0; b < m; ++b) {
    Eigen::Map<const RowMatrixXf> cent(centroid(b, 0), C, ds);
    Eigen::Map<const Eigen::VectorXf> kb(key + b * ds, ds);
    Eigen::Map<Eigen::VectorXf> sims(sims_v.data(), C);
    Eigen::Map<const Eigen::VectorXf> kbar(t.key_mean.data() + b * ds, ds);
    sims.noalias() = cent * kb - cent * kbar;
    for (int j = 0; j < C; ++j) {
      const uint16_t h = FloatToHalf(sims_v[j]);
      const int64_t list = static_cast<int64_t>(b) * C + j;
      // Try-insert (§3.3 (5)): the new id is the largest, so it must beat the
      // worst entry's score strictly; it replaces that entry.
      if (!(Half(h) > WorstScore(list))) continue;
      ListOverlay& o = overlay_.lists[static_cast<size_t>(list)];
      const int64_t off = list * L_;
      const bool worst_is_base =
          o.n_evicted < L_ &&
          (o.live.empty() || !Beats(Half(t.scores[off + o.n_evicted]), t.ids[off + o.n_evicted],
                                    Half(o.live.front().score), o.live.front().id));
      if (worst_is_base) {
        ++o.n_evicted;
      } else {
        std::pop_heap(o.live.begin(), o.live.end(), live_less);
        o.live.pop_back();
      }
      o.live.push_back(Entry{id, h});
      std::push_heap(o.live.begin(), o.live.end(), live_less);
    }
  }
  if (has_sketch()) {
    const size_t at = overlay_.sketch.size();
    overlay_.sketch.resize(at + d_);
    overlay_.sketch_scale.emplace_back();
    SketchKey(key, t.key_mean.data(), d_, overlay_.sketch.data() + at,
              &overlay_.sketch_scale.back());
  }
  ++n_tokens_;
  return Status::OK();
}

}  // namespace ctxcache::index
