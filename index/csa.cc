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
#include "index/metrics.h"
#include "index/oracle.h"
#include "index/params.h"

namespace ctxcache::index {
namespace {

// CSAP version 1: no key sketch; version 2 (written): the sketch section
// follows the lists. CSAC version 1: 8-bit scores in [lo, hi], delta-varint
// ids; version 2: per-list 4-bit score codebooks, ids as a bitmap or delta
// varints, whichever is smaller; version 3: as 2, with Elias-Fano ids as a
// third choice; version 4 (written): as 3, then the sketch section
// (docs/storage-format.md).
constexpr uint32_t kPlainVersion = 2;
constexpr uint32_t kCompactVersion = 4;
constexpr uint32_t kPlainSketchVersion = 2;
constexpr uint32_t kCompactSketchVersion = 4;
constexpr uint8_t kSketchBits = 8;
constexpr int kSketchMaxCode = 127;
constexpr int kSketchQueryMaxCode = 2047;
constexpr int kCompactScoreBits = 4;
constexpr uint8_t kIdsVarint = 0;
constexpr uint8_t kIdsBitmap = 1;
constexpr uint8_t kIdsEliasFano = 2;  // version >= 3

// Elias-Fano coding of L strictly increasing ids in [0, n): with k low bits,
// the low parts packed (L * k bits), then an upper bitmap of L + ((n - 1) >> k)
// + 1 bits where entry e sets bit (id_e >> k) + e. Bits are little-endian
// (bit i is byte i / 8, bit i % 8).
struct EliasFanoShape {
  int k = 0;
  uint64_t low_bytes = 0, upper_bits = 0, upper_bytes = 0;
  uint64_t bytes() const { return 1 + low_bytes + upper_bytes; }  // + the k byte
};

EliasFanoShape EliasFanoFor(int k, int64_t L, int64_t n) {
  EliasFanoShape s;
  s.k = k;
  s.low_bytes = (static_cast<uint64_t>(L) * k + 7) / 8;
  s.upper_bits = static_cast<uint64_t>(L) + (static_cast<uint64_t>(n - 1) >> k) + 1;
  s.upper_bytes = (s.upper_bits + 7) / 8;
  return s;
}

// The k that minimizes the coded size (the smaller k on ties).
EliasFanoShape BestEliasFano(int64_t L, int64_t n) {
  EliasFanoShape best = EliasFanoFor(0, L, n);
  for (int k = 1; k <= 31; ++k) {
    const EliasFanoShape s = EliasFanoFor(k, L, n);
    if (s.bytes() < best.bytes()) best = s;
  }
  return best;
}
constexpr size_t kEntryBytes = sizeof(int32_t) + sizeof(uint16_t);

using StridedMap = Eigen::Map<const RowMatrixXf, 0, Eigen::OuterStride<>>;

inline float Half(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return HalfToFloat(h);
#endif
}

// Heap order: the root is the worst entry (lowest score; among equal scores
// the highest id), so "a beats b" is score_a > score_b or a tie with id_a < id_b.
inline bool Beats(float sa, int32_t ia, float sb, int32_t ib) {
  return sa > sb || (sa == sb && ia < ib);
}

// Sorts a list worst entry first (ascending score, among equal scores the
// higher id first): the order Build writes, and a heap with the worst entry
// at the root. ids_ascending: the ids come in ascending order (the compact
// loader's), which a stable radix sort on the fp16 order keys keeps for ties;
// otherwise a comparison sort.
void SortWorstFirst(int32_t* ids, uint16_t* sc, int64_t L, bool ids_ascending,
                    std::vector<uint64_t>* a, std::vector<uint64_t>* b) {
  if (!ids_ascending) {
    bool sorted = true;
    for (int64_t e = 1; e < L && sorted; ++e) {
      sorted = Beats(Half(sc[e]), ids[e], Half(sc[e - 1]), ids[e - 1]);
    }
    if (sorted) return;
  }
  a->resize(static_cast<size_t>(L));
  b->resize(static_cast<size_t>(L));
  for (int64_t e = 0; e < L; ++e) {
    // Descending order key on top, then the payload.
    const uint16_t h = sc[e] == 0x8000 ? 0 : sc[e];
    const uint16_t key = static_cast<uint16_t>(
        ~(h ^ (static_cast<uint16_t>(static_cast<int16_t>(h) >> 15) | 0x8000)));
    (*a)[e] = (uint64_t{key} << 48) | (uint64_t{sc[e]} << 32) | static_cast<uint32_t>(ids[e]);
  }
  if (ids_ascending) {
    for (int shift = 48; shift < 64; shift += 8) {
      size_t count[257] = {};
      for (uint64_t v : *a) ++count[((v >> shift) & 0xFF) + 1];
      for (int k = 0; k < 256; ++k) count[k + 1] += count[k];
      for (uint64_t v : *a) (*b)[count[(v >> shift) & 0xFF]++] = v;
      a->swap(*b);
    }
    std::reverse(a->begin(), a->end());  // ascending key, ties: descending id
  } else {
    std::sort(a->begin(), a->end(), [](uint64_t x, uint64_t y) {
      const uint16_t kx = static_cast<uint16_t>(x >> 48), ky = static_cast<uint16_t>(y >> 48);
      if (kx != ky) return kx > ky;  // descending key: ascending score
      return static_cast<int32_t>(x) > static_cast<int32_t>(y);
    });
  }
  for (int64_t e = 0; e < L; ++e) {
    ids[e] = static_cast<int32_t>(static_cast<uint32_t>((*a)[e]));
    sc[e] = static_cast<uint16_t>((*a)[e] >> 32);
  }
}

// Select() scratch, per thread: a session's selectors run one at a time on
// its thread, so one dense accumulator serves them all.
struct SearchScratch {
  std::vector<float> acc;            // dense accumulator, zero between searches
  std::vector<float> forced_acc;     // acc of the forced tokens
  std::vector<float> centroid_sims;  // C
  std::vector<int> order;            // C (backoff ranking)
  std::vector<int32_t> topk_ids;
  TopKScratch topk;
  std::vector<int32_t> cand;     // rerank candidates (ascending ids)
  std::vector<float> cand_r;     // their sketch scores
  std::vector<float> forced_r;   // the forced tokens' sketch scores
  std::vector<int16_t> sketch_q;  // the query's int16 codes
};
SearchScratch& Scratch() {
  static thread_local SearchScratch scratch;
  return scratch;
}

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

Status CheckOptions(const CsaOptions& o) {
  auto bad = [](const std::string& field, const std::string& msg) {
    return InvalidArgumentError("csa: " + field + " " + msg);
  };
  if (o.m < 0) return bad("m=" + std::to_string(o.m), "expected >= 0 (0 = by head_dim)");
  if (o.C < 1) return bad("C=" + std::to_string(o.C), "expected >= 1");
  if (!(o.alpha > 0 && o.alpha <= 1))
    return bad("alpha=" + std::to_string(o.alpha), "expected in (0, 1]");
  if (o.fixed_L < 0) return bad("L=" + std::to_string(o.fixed_L), "expected >= 0");
  if (o.kmeans_iters < 1) return bad("iters=" + std::to_string(o.kmeans_iters), "expected >= 1");
  if (!(o.rho > 0 && o.rho <= 1)) return bad("rho=" + std::to_string(o.rho), "expected in (0, 1]");
  if (o.recent < 0) return bad("R=" + std::to_string(o.recent), "expected >= 0");
  if (o.sinks < 0) return bad("sinks=" + std::to_string(o.sinks), "expected >= 0");
  if (o.tau < 1 || o.tau > o.C) {
    return bad("tau=" + std::to_string(o.tau), "expected in [1, C=" + std::to_string(o.C) + "]");
  }
  if (!(o.backoff_cos >= -1 && o.backoff_cos <= 1)) {
    return bad("backoff_cos=" + std::to_string(o.backoff_cos), "expected in [-1, 1]");
  }
  if (o.period < 1) return bad("period=" + std::to_string(o.period), "expected >= 1");
  if (!IsValidCsaRerank(o.rerank)) {
    return bad("rerank=" + std::to_string(o.rerank), "expected 0 or in [1, 64]");
  }
  return Status::OK();
}

}  // namespace

bool IsValidCsaRerank(double rerank) { return rerank == 0 || (rerank >= 1 && rerank <= 64); }

StatusOr<CsaOptions> ParseCsaOptions(const MethodParams& params) {
  CsaOptions o;
  ParamReader pr("csa", params);
  ASSIGN_OR_RETURN(int64_t m, pr.Int("m", o.m, 0, 4096));
  ASSIGN_OR_RETURN(int64_t C, pr.Int("C", o.C, 1, 1 << 20));
  ASSIGN_OR_RETURN(o.alpha, pr.Ratio("alpha", o.alpha));
  ASSIGN_OR_RETURN(o.fixed_L, pr.Int("L", o.fixed_L, 0, INT32_MAX));
  ASSIGN_OR_RETURN(o.query_cap, pr.Int("query_cap", o.query_cap, 1, INT64_MAX));
  ASSIGN_OR_RETURN(int64_t iters, pr.Int("iters", o.kmeans_iters, 1, 1000));
  ASSIGN_OR_RETURN(int64_t seed, pr.Int("seed", static_cast<int64_t>(o.seed), 0, INT64_MAX));
  ASSIGN_OR_RETURN(o.center_keys, pr.Bool("center", o.center_keys));
  ASSIGN_OR_RETURN(o.rho, pr.Ratio("rho", o.rho));
  ASSIGN_OR_RETURN(int64_t R, pr.Int("R", o.recent, 0, INT32_MAX));
  ASSIGN_OR_RETURN(int64_t sinks, pr.Int("sinks", o.sinks, 0, INT32_MAX));
  ASSIGN_OR_RETURN(int64_t tau, pr.Int("tau", o.tau, 1, 1 << 20));
  ASSIGN_OR_RETURN(o.backoff_cos, pr.Double("backoff_cos", o.backoff_cos, -1.0, 1.0));
  ASSIGN_OR_RETURN(std::string weights, pr.Enum("weights",
                                                o.proj_weights   ? "proj"
                                                : o.norm_weights ? "norm"
                                                                 : "uniform",
                                                {"uniform", "norm", "proj"}));
  ASSIGN_OR_RETURN(std::string missing, pr.Enum("missing", "zero", {"zero", "min", "mean"}));
  o.impute_min = missing == "min";
  o.impute_tail_mean = missing == "mean";
  ASSIGN_OR_RETURN(int64_t period, pr.Int("period", o.period, 1, 1 << 20));
  ASSIGN_OR_RETURN(o.rerank, pr.Double("rerank", o.rerank, 0.0, 64.0));
  ASSIGN_OR_RETURN(std::string format,
                   pr.Enum("format", o.compact ? "compact" : "plain", {"plain", "compact"}));
  if (pr.Has("schedule")) {
    ASSIGN_OR_RETURN(std::string schedule,
                     pr.Enum("schedule", "", {"0.05/1", "0.15/4", "0.20/8", "0.2/8"}));
    const size_t slash = schedule.find('/');
    o.rho = std::stod(schedule.substr(0, slash));
    period = std::stoi(schedule.substr(slash + 1));
  }
  RETURN_IF_ERROR(pr.Finish());
  o.m = static_cast<int>(m);
  o.C = static_cast<int>(C);
  o.kmeans_iters = static_cast<int>(iters);
  o.seed = static_cast<uint64_t>(seed);
  o.recent = static_cast<int>(R);
  o.sinks = static_cast<int>(sinks);
  o.tau = static_cast<int>(tau);
  o.norm_weights = weights == "norm";
  o.proj_weights = weights == "proj";
  o.period = static_cast<int>(period);
  o.compact = format == "compact";
  return o;
}

int CsaSubspaces(int m, int head_dim) {
  if (m > 0) return m;
  int best = 1;
  for (int s = 1; s <= std::min(16, head_dim / 4); ++s) {
    if (head_dim % s == 0) best = s;
  }
  return best;
}

StatusOr<std::unique_ptr<CsaSelector>> CsaSelector::Build(const HeadPrefill& p,
                                                          const CsaOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  RETURN_IF_ERROR(ValidatePrefill("csa", p, /*need_queries=*/true, /*need_values=*/false));
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

void CsaSelector::SearchOne(const float* q, std::vector<int32_t>* selected,
                            std::vector<float>* logits, double* log_normalizer, WorkStats* stats) {
  const int m = options_.m, C = options_.C, ds = sub_dim();
  const int64_t n = n_tokens_;
  SearchScratch& ss = Scratch();
  if (static_cast<int64_t>(ss.acc.size()) != n) ss.acc.assign(n, 0.0f);
  ss.centroid_sims.resize(C);
  int64_t lists = 0;
  float norm_sum = 0;
  for (int b = 0; b < m; ++b) {
    const float* qb = q + b * ds;
    Eigen::Map<const Eigen::VectorXf> qv(qb, ds);
    const float norm = qv.norm();
    norm_sum += norm;
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
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d_));
  const float to_logit = (options_.norm_weights || options_.proj_weights ? 1.0f : norm_sum / m) /
                         std::sqrt(static_cast<float>(d_));
  const bool rerank = options_.rerank > 0 && has_sketch();
  if (rerank) {
    // Stage 2: the sketch re-scores the forced tokens and the top
    // ceil(rerank * k) - |forced| others by acc; the best of those by the
    // sketch fill the budget.
    const int64_t n_forced = static_cast<int64_t>(forced.size());
    std::vector<int32_t>& cand = ss.cand;
    cand.clear();
    if (k > n_forced) {
      const int64_t want =
          std::min<int64_t>(n - n_forced,
                            static_cast<int64_t>(std::ceil(options_.rerank * static_cast<double>(k))) -
                                n_forced);
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
  } else {
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

namespace {

// Codebook entries per list: 2^bits, or L when the list is shorter.
int CodebookLevels(int bits, int64_t L) {
  return static_cast<int>(std::min<int64_t>(int64_t{1} << bits, L));
}

uint64_t VarintSize(uint64_t v) {
  uint64_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// The index of the level nearest to v in the ascending book (the lower one
// on a tie). Distances fall towards v's insertion point from both sides, so
// the nearest level is one of its two neighbours; equal distances further
// down (duplicate levels, or float rounding) are walked to the first.
uint32_t NearestLevel(const float* book, int levels, float v) {
  int best = 0;  // lower_bound by counting (branch-free over <= 16 levels)
  for (int i = 0; i < levels; ++i) best += book[i] < v ? 1 : 0;
  if (best == levels) {
    best = levels - 1;
  } else if (best > 0 && !(std::abs(v - book[best]) < std::abs(v - book[best - 1]))) {
    --best;
  }
  while (best > 0 && std::abs(v - book[best - 1]) <= std::abs(v - book[best])) --best;
  return static_cast<uint32_t>(best);
}

// The order-preserving 16-bit image of fp16 bits h (negatives' bits
// inverted, positives' sign bit set): a < b as halves iff image(a) < image(b)
// (+0 and -0 apart).
uint16_t HalfOrderKey(uint16_t h) {
  return (h & 0x8000u) ? static_cast<uint16_t>(~h) : static_cast<uint16_t>(h | 0x8000u);
}

// The n fp16 values h ascending, as floats, by a two-pass LSD radix sort of
// their HalfOrderKey images; those sorted images are left in `keys`. `keys`
// and `tmp` hold n entries each.
void SortHalves(const uint16_t* h, int64_t n, uint16_t* keys, uint16_t* tmp, float* out) {
  for (int64_t i = 0; i < n; ++i) keys[i] = HalfOrderKey(h[i]);
  for (int shift = 0; shift < 16; shift += 8) {
    int64_t count[257] = {};
    for (int64_t i = 0; i < n; ++i) ++count[((keys[i] >> shift) & 0xFF) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (int64_t i = 0; i < n; ++i) tmp[count[(keys[i] >> shift) & 0xFF]++] = keys[i];
    std::swap(keys, tmp);
  }
  // Two passes: the sorted keys are back in the caller's `keys`.
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t k = keys[i];
    out[i] = Half((k & 0x8000u) ? static_cast<uint16_t>(k & 0x7FFFu) : static_cast<uint16_t>(~k));
  }
}

// A 1-D Lloyd-Max codebook of `levels` fp16 values (ascending) for the n
// ascending scores: equal-count groups' means, then Lloyd iterations (each
// level the mean of the scores nearest to it).
void ScoreCodebook(const float* sorted, int64_t n, int levels, uint16_t* book) {
  std::vector<double> level(levels);
  for (int g = 0; g < levels; ++g) {
    const int64_t a = g * n / levels, b = (g + 1) * n / levels;
    if (b > a) {
      double sum = 0;
      for (int64_t i = a; i < b; ++i) sum += sorted[i];
      level[g] = sum / static_cast<double>(b - a);
    } else {
      level[g] = sorted[std::min<int64_t>(a, n - 1)];
    }
  }
  std::vector<double> sum(levels);
  std::vector<int64_t> count(levels);
  // Whether score x is strictly nearer to level g + 1 than to level g.
  auto nearer_next = [&](float x, int g) {
    return std::abs(x - level[g + 1]) < std::abs(x - level[g]);
  };
  // The scores are fp16 values (multiples of 2^-24): while n * max|score| <
  // 2^29 every partial sum of them is exact in a double, so a run's sum is
  // a difference of two prefix sums, bit for bit the sum the walk below
  // accumulates, and each run's end is found by binary search instead of a
  // test per score (nearer_next is monotone in x over ascending scores).
  const double max_abs = n > 0 ? std::max(std::abs(sorted[0]), std::abs(sorted[n - 1])) : 0.0;
  const bool exact_prefix = static_cast<double>(n) * max_abs < 536870912.0;  // 2^29
  std::vector<double> prefix;
  if (exact_prefix) {
    prefix.resize(n + 1);
    prefix[0] = 0;
    for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + sorted[i];
  }
  for (int it = 0; it < 8; ++it) {
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(count.begin(), count.end(), 0);
    // Levels ascend, scores ascend: the nearest level only moves up, so each
    // level's scores are one run.
    int g = 0;
    if (exact_prefix) {
      for (int64_t i = 0;;) {
        int64_t j = n;  // the first score of [i, n) nearer to level g + 1
        if (g + 1 < levels) {
          int64_t lo = i, hi = n;
          while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (nearer_next(sorted[mid], g)) {
              hi = mid;
            } else {
              lo = mid + 1;
            }
          }
          j = lo;
        }
        sum[g] = prefix[j] - prefix[i];
        count[g] = j - i;
        if (j == n) break;
        while (g + 1 < levels && nearer_next(sorted[j], g)) ++g;
        i = j;
      }
    } else {  // the walk, summed in a register
      double run = 0;
      int64_t run_n = 0;
      for (int64_t i = 0; i < n; ++i) {
        while (g + 1 < levels && nearer_next(sorted[i], g)) {
          sum[g] = run;
          count[g] = run_n;
          run = 0;
          run_n = 0;
          ++g;
        }
        run += sorted[i];
        ++run_n;
      }
      sum[g] = run;
      count[g] = run_n;
    }
    for (int k = 0; k < levels; ++k) {
      if (count[k] > 0) level[k] = sum[k] / static_cast<double>(count[k]);
    }
    std::sort(level.begin(), level.end());
  }
  for (int k = 0; k < levels; ++k) book[k] = FloatToHalf(static_cast<float>(level[k]));
  std::sort(book, book + levels, [](uint16_t a, uint16_t b) { return Half(a) < Half(b); });
}

void PutOptions(ByteWriter* w, const CsaOptions& o) {
  w->Put<int32_t>(o.m);
  w->Put<int32_t>(o.C);
  w->Put<double>(o.alpha);
  w->Put<int64_t>(o.fixed_L);
  w->Put<int64_t>(o.query_cap);
  w->Put<int32_t>(o.kmeans_iters);
  w->Put<uint8_t>(o.center_keys ? 1 : 0);
  w->Put<uint64_t>(o.seed);
  w->Put<double>(o.rho);
  w->Put<int32_t>(o.recent);
  w->Put<int32_t>(o.sinks);
  w->Put<int32_t>(o.tau);
  w->Put<double>(o.backoff_cos);
  w->Put<uint8_t>(o.norm_weights ? 1 : 0);
  w->Put<uint8_t>(o.proj_weights ? 1 : 0);
  w->Put<uint8_t>(o.impute_min ? 1 : 0);
  w->Put<uint8_t>(o.impute_tail_mean ? 1 : 0);
  w->Put<int32_t>(o.period);
  w->Put<uint8_t>(o.compact ? 1 : 0);
}

bool GetOptions(ByteReader* r, CsaOptions* o) {
  uint8_t norm = 0, proj = 0, compact = 0, center = 0, impute = 0, tail = 0;
  bool ok = r->Get(&o->m) && r->Get(&o->C) && r->Get(&o->alpha) && r->Get(&o->fixed_L) &&
            r->Get(&o->query_cap) && r->Get(&o->kmeans_iters) && r->Get(&center) &&
            r->Get(&o->seed) && r->Get(&o->rho) && r->Get(&o->recent) && r->Get(&o->sinks) &&
            r->Get(&o->tau) && r->Get(&o->backoff_cos) && r->Get(&norm) && r->Get(&proj) &&
            r->Get(&impute) && r->Get(&tail) && r->Get(&o->period) && r->Get(&compact);
  o->norm_weights = norm != 0;
  o->proj_weights = proj != 0;
  o->center_keys = center != 0;
  o->impute_min = impute != 0;
  o->impute_tail_mean = tail != 0;
  o->compact = compact != 0;
  return ok;
}

}  // namespace

void CsaSelector::PutSketch(ByteWriter* w) const {
  w->Put<double>(options_.rerank);
  if (!has_sketch()) {
    w->Put<uint8_t>(0);
    return;
  }
  w->Put<uint8_t>(kSketchBits);
  const Tables& t = *base_;
  w->PutArray(t.sketch.data(), t.sketch.size());
  w->PutArray(overlay_.sketch.data(), overlay_.sketch.size());
  w->PutArray(t.sketch_scale.data(), t.sketch_scale.size());
  w->PutArray(overlay_.sketch_scale.data(), overlay_.sketch_scale.size());
}

void CsaSelector::SerializePlain(std::string* out) const {
  out->clear();
  ByteWriter w(out);
  const Tables& t = *base_;
  w.PutHeader("CSAP", kPlainVersion);
  PutOptions(&w, options_);
  w.Put<int32_t>(d_);
  w.Put<int64_t>(n_tokens_);
  w.Put<int64_t>(n_built_);
  w.Put<int64_t>(L_);
  w.PutArray(t.centroids.data(), t.centroids.size());
  w.PutArray(t.key_mean.data(), t.key_mean.size());
  w.PutArray(t.tail_mean.data(), t.tail_mean.size());
  if (overlay_.lists.empty()) {
    w.PutArray(t.ids.data(), t.ids.size());
    w.PutArray(t.scores.data(), t.scores.size());
    PutSketch(&w);
    return;
  }
  std::vector<int32_t> ids(t.ids.size());
  std::vector<uint16_t> scores(t.scores.size()), list_sc;
  std::vector<int32_t> list_ids;
  for (int64_t l = 0; l < static_cast<int64_t>(options_.m) * options_.C; ++l) {
    MaterializeList(l, &list_ids, &list_sc);
    std::copy(list_ids.begin(), list_ids.end(), ids.begin() + l * L_);
    std::copy(list_sc.begin(), list_sc.end(), scores.begin() + l * L_);
  }
  w.PutArray(ids.data(), ids.size());
  w.PutArray(scores.data(), scores.size());
  PutSketch(&w);
}

void CsaSelector::SerializeCompact(std::string* out) const {
  out->clear();
  ByteWriter w(out);
  const Tables& t = *base_;
  w.PutHeader("CSAC", kCompactVersion);
  PutOptions(&w, options_);
  w.Put<int32_t>(d_);
  w.Put<int64_t>(n_tokens_);
  w.Put<int64_t>(n_built_);
  w.Put<int64_t>(L_);
  w.PutArray(t.centroids.data(), t.centroids.size());
  w.PutArray(t.key_mean.data(), t.key_mean.size());
  w.PutArray(t.tail_mean.data(), t.tail_mean.size());
  w.Put<uint8_t>(kCompactScoreBits);
  const int levels = CodebookLevels(kCompactScoreBits, L_);
  // Sorting by id and by score without comparison sorts (they were most of
  // a commit's CPU): ids are unique in [0, n_tokens), so a bitmap walk
  // orders them; fp16 scores sort by a two-pass radix on their bits.
  std::vector<std::pair<int32_t, uint16_t>> list(L_);
  std::vector<uint64_t> seen((n_tokens_ + 63) / 64);
  std::vector<uint16_t> score_of(static_cast<size_t>(n_tokens_));
  std::vector<uint16_t> keys(L_), keys_tmp(L_);
  std::vector<float> sorted(L_);
  std::vector<uint16_t> book(levels);
  std::vector<float> book_f(levels);
  std::vector<uint16_t> thresholds(levels);
  std::vector<uint8_t> bitmap((n_tokens_ + 7) / 8);
  const EliasFanoShape ef = BestEliasFano(L_, n_tokens_);
  std::vector<uint8_t> ef_buf(ef.low_bytes + ef.upper_bytes);
  std::vector<uint8_t> packed((L_ * kCompactScoreBits + 7) / 8);
  std::vector<int32_t> view_ids;
  std::vector<uint16_t> view_sc;
  const int64_t n_lists = static_cast<int64_t>(options_.m) * options_.C;
  for (int64_t l = 0; l < n_lists; ++l) {
    const int32_t* ids = nullptr;
    const uint16_t* sc = nullptr;
    ListView(l, &view_ids, &view_sc, &ids, &sc);
    for (int64_t e = 0; e < L_; ++e) {
      seen[static_cast<size_t>(ids[e]) >> 6] |= uint64_t{1} << (ids[e] & 63);
      score_of[static_cast<size_t>(ids[e])] = sc[e];
    }
    for (size_t wi = 0, e = 0; wi < seen.size(); ++wi) {
      for (uint64_t word = seen[wi]; word != 0; word &= word - 1) {
        const int32_t id = static_cast<int32_t>(wi * 64 + std::countr_zero(word));
        list[e++] = {id, score_of[static_cast<size_t>(id)]};
      }
      seen[wi] = 0;
    }
    // Ids: a bitmap over n_tokens, delta varints or Elias-Fano, whichever is
    // smallest (ties: bitmap, then varints).
    uint64_t varint_bytes = 0;
    for (int64_t e = 0, prev = -1; e < L_; prev = list[e].first, ++e) {
      varint_bytes += VarintSize(static_cast<uint64_t>(list[e].first - prev));
    }
    if (ef.bytes() < std::min<uint64_t>(bitmap.size(), varint_bytes)) {
      w.Put<uint8_t>(kIdsEliasFano);
      w.Put<uint8_t>(static_cast<uint8_t>(ef.k));
      std::fill(ef_buf.begin(), ef_buf.end(), 0);
      uint8_t* low = ef_buf.data();
      uint8_t* upper = low + ef.low_bytes;
      const uint64_t low_mask = (uint64_t{1} << ef.k) - 1;
      uint64_t acc = 0;  // low parts not yet written, < 8 + 31 bits
      int acc_bits = 0;
      size_t out = 0;
      for (int64_t e = 0; e < L_; ++e) {
        const uint32_t id = static_cast<uint32_t>(list[e].first);
        acc |= (id & low_mask) << acc_bits;
        for (acc_bits += ef.k; acc_bits >= 8; acc_bits -= 8, acc >>= 8) {
          low[out++] = static_cast<uint8_t>(acc);
        }
        const uint64_t u = (static_cast<uint64_t>(id) >> ef.k) + static_cast<uint64_t>(e);
        upper[u >> 3] |= static_cast<uint8_t>(1u << (u & 7));
      }
      if (acc_bits > 0) low[out] = static_cast<uint8_t>(acc);
      w.PutArray(ef_buf.data(), ef_buf.size());
    } else if (bitmap.size() < varint_bytes) {
      w.Put<uint8_t>(kIdsBitmap);
      std::fill(bitmap.begin(), bitmap.end(), 0);
      for (const auto& [id, h] : list) bitmap[id >> 3] |= static_cast<uint8_t>(1u << (id & 7));
      w.PutArray(bitmap.data(), bitmap.size());
    } else {
      w.Put<uint8_t>(kIdsVarint);
      int32_t prev = -1;
      for (const auto& [id, h] : list) {
        w.PutVarint(static_cast<uint64_t>(id - prev));  // >= 1: ids are unique
        prev = id;
      }
    }
    // Scores: a codebook of `levels` fp16 values and one code per entry.
    SortHalves(sc, L_, keys.data(), keys_tmp.data(), sorted.data());
    ScoreCodebook(sorted.data(), L_, levels, book.data());
    for (int i = 0; i < levels; ++i) book_f[i] = Half(book[i]);
    w.PutArray(book.data(), book.size());
    // NearestLevel is non-decreasing in the score, so over the ascending
    // scores each code is one run: its first score, found by binary search,
    // gives a threshold on the order-preserving 16-bit image (`keys`, from
    // SortHalves), and an entry's code is the number of thresholds at or
    // below its image.
    int n_thr = 0;
    int64_t lo = 0;
    for (int c = 1; c < levels; ++c) {
      int64_t a = lo, b = L_;  // the first sorted score whose code is >= c
      while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        if (NearestLevel(book_f.data(), levels, sorted[mid]) >= static_cast<uint32_t>(c)) {
          b = mid;
        } else {
          a = mid + 1;
        }
      }
      if (a == L_) break;
      thresholds[n_thr++] = keys[a];
      lo = a;
    }
    std::fill(packed.begin(), packed.end(), 0);
    for (int64_t e = 0; e < L_; ++e) {
      const uint16_t key = HalfOrderKey(list[e].second);
      uint32_t code = 0;
      for (int t = 0; t < n_thr; ++t) code += key >= thresholds[t] ? 1 : 0;
      packed[e >> 1] |= static_cast<uint8_t>(code << (4 * (e & 1)));
    }
    w.PutArray(packed.data(), packed.size());
  }
  PutSketch(&w);
}

Status CsaSelector::Serialize(std::string* out) const {
  if (options_.compact) {
    SerializeCompact(out);
  } else {
    SerializePlain(out);
  }
  return Status::OK();
}

Status CsaSelector::ReadTables(std::string_view bytes) {
  ByteReader r(bytes);
  auto t = std::make_shared<Tables>();
  std::vector<uint64_t> sort_a, sort_b;  // SortWorstFirst scratch
  const bool compact = bytes.substr(0, 4) == "CSAC";
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader(compact ? "CSAC" : "CSAP", compact ? kCompactVersion : kPlainVersion,
                              &version, "csa"));
  auto loss = [](const std::string& what) { return DataLossError("csa artifact: " + what); };
  if (!GetOptions(&r, &options_)) return loss("truncated options");
  if (!CheckOptions(options_).ok() || options_.m < 1) return loss("corrupt options");
  if (!r.Get(&d_) || !r.Get(&n_tokens_) || !r.Get(&n_built_) || !r.Get(&L_)) {
    return loss("truncated header");
  }
  if (d_ < 1 || d_ > 4096 || d_ % options_.m != 0 || n_tokens_ < 1 || n_tokens_ > INT32_MAX ||
      n_built_ < 1 || n_built_ > n_tokens_ || L_ < 1 || L_ > n_built_ || options_.C > n_built_) {
    return loss("corrupt shape fields");
  }
  const int64_t n_lists = static_cast<int64_t>(options_.m) * options_.C;
  const size_t n_cent = static_cast<size_t>(options_.C) * d_;
  if (n_cent * sizeof(float) > r.remaining()) return loss("truncated centroids");
  t->centroids.resize(n_cent);
  if (!r.GetArray(t->centroids.data(), n_cent)) return loss("truncated centroids");
  t->key_mean.resize(d_);
  if (!r.GetArray(t->key_mean.data(), d_) || HasNonFinite(t->key_mean.data(), d_) ||
      HasNonFinite(t->centroids.data(), n_cent)) {
    return loss("bad centroids or key mean");
  }
  t->tail_mean.resize(static_cast<size_t>(options_.m) * options_.C);
  if (!r.GetArray(t->tail_mean.data(), t->tail_mean.size()) ||
      HasNonFinite(t->tail_mean.data(), t->tail_mean.size())) {
    return loss("bad list tail means");
  }
  const uint64_t entries = static_cast<uint64_t>(n_lists) * L_;
  uint8_t bits = 0;
  if (compact && version >= 2) {
    if (!r.Get(&bits) || bits != kCompactScoreBits) return loss("bad score bits");
    // >= 1 coding byte, the codebook and the packed codes per list.
    const uint64_t min_list = 1 + 2 * CodebookLevels(bits, L_) + (L_ * bits + 7) / 8;
    if (static_cast<uint64_t>(n_lists) * min_list > r.remaining()) return loss("truncated lists");
  } else if (entries > r.remaining()) {
    return loss("truncated lists");  // >= 1 byte per entry
  }
  t->ids.resize(entries);
  t->scores.resize(entries);
  if (!compact) {
    if (!r.GetArray(t->ids.data(), entries) || !r.GetArray(t->scores.data(), entries)) {
      return loss("truncated lists");
    }
    for (int32_t id : t->ids) {
      if (id < 0 || id >= n_tokens_) return loss("list id out of range");
    }
    for (int64_t l = 0; l < n_lists; ++l) {
      SortWorstFirst(t->ids.data() + l * L_, t->scores.data() + l * L_, L_,
                     /*ids_ascending=*/false, &sort_a, &sort_b);
    }
  } else if (version >= 2) {
    const int levels = CodebookLevels(bits, L_);
    std::vector<uint16_t> book(levels);
    // Sized on first use, after the bytes for it are known to be there: a
    // corrupt n_tokens must not allocate.
    std::vector<uint8_t> bitmap, ef_buf;
    const size_t bitmap_bytes = static_cast<size_t>((n_tokens_ + 7) / 8);
    std::vector<uint8_t> packed((L_ * bits + 7) / 8);
    std::vector<uint8_t> codes(static_cast<size_t>(L_));
    std::vector<int32_t> id_copy;
    std::vector<int> code_rank(levels);
    std::vector<int64_t> rank_start(levels + 1);
    for (int64_t l = 0; l < n_lists; ++l) {
      int32_t* ids = t->ids.data() + l * L_;
      uint8_t coding = 0;
      if (!r.Get(&coding)) return loss("truncated lists");
      if (coding == kIdsBitmap) {
        if (r.remaining() < bitmap_bytes) return loss("truncated list bitmap");
        bitmap.resize(bitmap_bytes);
        if (!r.GetArray(bitmap.data(), bitmap.size())) return loss("truncated list bitmap");
        int64_t e = 0;
        for (size_t byte = 0; byte < bitmap.size(); ++byte) {
          for (uint32_t v = bitmap[byte]; v != 0; v &= v - 1) {
            const int64_t id = static_cast<int64_t>(byte) * 8 + __builtin_ctz(v);
            if (id >= n_tokens_ || e >= L_) return loss("bad list bitmap");
            ids[e++] = static_cast<int32_t>(id);
          }
        }
        if (e != L_) return loss("bad list bitmap");
      } else if (coding == kIdsVarint) {
        int64_t prev = -1;
        for (int64_t e = 0; e < L_; ++e) {
          uint64_t delta = 0;
          // Unsigned compare: a huge delta must not wrap prev (signed overflow).
          if (!r.GetVarint(&delta) || delta == 0 ||
              delta > static_cast<uint64_t>(n_tokens_ - 1 - prev)) {
            return loss("bad list ids");
          }
          prev += static_cast<int64_t>(delta);
          ids[e] = static_cast<int32_t>(prev);
        }
      } else if (coding == kIdsEliasFano && version >= 3) {
        uint8_t k = 0;
        if (!r.Get(&k) || k > 31) return loss("bad Elias-Fano low bits");
        const EliasFanoShape ef = EliasFanoFor(k, L_, n_tokens_);
        if (r.remaining() < ef.low_bytes + ef.upper_bytes) return loss("truncated Elias-Fano ids");
        ef_buf.resize(ef.low_bytes + ef.upper_bytes);
        if (!r.GetArray(ef_buf.data(), ef_buf.size())) return loss("truncated Elias-Fano ids");
        const uint8_t* low = ef_buf.data();
        const uint8_t* upper = low + ef.low_bytes;
        int64_t e = 0, prev = -1;
        for (uint64_t byte = 0; byte < ef.upper_bytes; ++byte) {
          for (uint32_t v = upper[byte]; v != 0; v &= v - 1) {
            const uint64_t bit = byte * 8 + static_cast<uint64_t>(__builtin_ctz(v));
            if (bit >= ef.upper_bits || e >= L_) return loss("bad Elias-Fano ids");
            // Entry e's k low bits start at bit e * k: up to 5 bytes.
            const uint64_t at = static_cast<uint64_t>(e) * k;
            uint64_t window = 0;
            const uint64_t first = at >> 3;
            if (first + 8 <= ef.low_bytes) {
              static_assert(std::endian::native == std::endian::little);
              std::memcpy(&window, low + first, 8);  // the bytes are little-endian
            } else {
              const uint64_t last = std::min<uint64_t>(first + 5, ef.low_bytes);
              for (uint64_t i = first; i < last; ++i) window |= uint64_t{low[i]} << (8 * (i - first));
            }
            const uint64_t lo = (window >> (at & 7)) & ((uint64_t{1} << k) - 1);
            const int64_t id = static_cast<int64_t>(((bit - static_cast<uint64_t>(e)) << k) | lo);
            if (id <= prev || id >= n_tokens_) return loss("bad Elias-Fano ids");
            ids[e++] = static_cast<int32_t>(id);
            prev = id;
          }
        }
        if (e != L_) return loss("bad Elias-Fano ids");
      } else {
        return loss("bad list id coding");
      }
      if (!r.GetArray(book.data(), book.size())) return loss("truncated score codebook");
      for (uint16_t h : book) {
        if (!std::isfinite(Half(h))) return loss("bad score codebook");
      }
      if (!r.GetArray(packed.data(), packed.size())) return loss("truncated scores");
      // Worst entry first (SortWorstFirst's order) straight from the codes:
      // a counting sort over the codebook values' ranks (equal values, +0
      // and -0 included, share a rank), each rank's entries by descending
      // id (the ids arrive ascending).
      for (int c = 0; c < levels; ++c) {
        int rank = 0;
        for (int o = 0; o < levels; ++o) rank += Half(book[o]) < Half(book[c]);
        code_rank[c] = rank;
      }
      std::fill(rank_start.begin(), rank_start.end(), 0);
      for (int64_t e = 0; e < L_; ++e) {
        const int code = (packed[e >> 1] >> (4 * (e & 1))) & 0xf;
        if (code >= levels) return loss("bad score code");
        codes[e] = static_cast<uint8_t>(code);
        ++rank_start[code_rank[code] + 1];
      }
      for (int k = 0; k < levels; ++k) rank_start[k + 1] += rank_start[k];
      id_copy.assign(ids, ids + L_);
      uint16_t* sc = t->scores.data() + l * L_;
      for (int64_t e = L_ - 1; e >= 0; --e) {
        const int64_t at = rank_start[code_rank[codes[e]]]++;
        ids[at] = id_copy[e];
        sc[at] = book[codes[e]];
      }
    }
  } else {
    std::vector<uint8_t> q(L_);
    for (int64_t l = 0; l < n_lists; ++l) {
      float lo = 0, hi = 0;
      if (!r.Get(&lo) || !r.Get(&hi) || !std::isfinite(lo) || !std::isfinite(hi) || hi < lo) {
        return loss("bad list range");
      }
      int64_t prev = -1;
      for (int64_t e = 0; e < L_; ++e) {
        uint64_t delta = 0;
        // Unsigned compare: a huge delta must not wrap prev (signed overflow).
        if (!r.GetVarint(&delta) || delta == 0 ||
            delta > static_cast<uint64_t>(n_tokens_ - 1 - prev)) {
          return loss("bad list ids");
        }
        prev += static_cast<int64_t>(delta);
        t->ids[l * L_ + e] = static_cast<int32_t>(prev);
      }
      if (!r.GetArray(q.data(), L_)) return loss("truncated scores");
      const float step = hi > lo ? (hi - lo) / 255.0f : 0.0f;
      for (int64_t e = 0; e < L_; ++e) t->scores[l * L_ + e] = FloatToHalf(lo + q[e] * step);
      SortWorstFirst(t->ids.data() + l * L_, t->scores.data() + l * L_, L_,
                     /*ids_ascending=*/true, &sort_a, &sort_b);
    }
  }
  options_.rerank = 0;
  if (version >= (compact ? kCompactSketchVersion : kPlainSketchVersion)) {
    uint8_t bits = 0;
    if (!r.Get(&options_.rerank) || !r.Get(&bits)) return loss("truncated key sketch header");
    if (!CheckOptions(options_).ok()) return loss("bad rerank");
    if (bits != 0 && bits != kSketchBits) return loss("bad key sketch bits");
    if ((bits != 0) != (options_.rerank > 0)) return loss("rerank and key sketch disagree");
    if (bits != 0) {
      const uint64_t cells = static_cast<uint64_t>(n_tokens_) * d_;
      if (cells + 2 * static_cast<uint64_t>(n_tokens_) > r.remaining()) {
        return loss("truncated key sketch");
      }
      t->sketch.resize(cells);
      t->sketch_scale.resize(static_cast<size_t>(n_tokens_));
      if (!r.GetArray(t->sketch.data(), cells) ||
          !r.GetArray(t->sketch_scale.data(), t->sketch_scale.size())) {
        return loss("truncated key sketch");
      }
      for (int8_t c : t->sketch) {
        if (c < -kSketchMaxCode) return loss("bad key sketch code");
      }
      for (uint16_t h : t->sketch_scale) {
        const float v = Half(h);
        if (!std::isfinite(v) || v < 0) return loss("bad key sketch scale");
      }
    }
  }
  if (r.remaining() != 0) return loss("trailing bytes");
  n_base_ = n_tokens_;
  base_ = std::move(t);
  return Status::OK();
}

StatusOr<std::unique_ptr<CsaSelector>> CsaSelector::Load(std::string_view bytes) {
  std::unique_ptr<CsaSelector> s(new CsaSelector());
  RETURN_IF_ERROR(s->ReadTables(bytes));
  return s;
}

std::unique_ptr<Selector> CsaSelector::Clone() const {
  return std::unique_ptr<Selector>(new CsaSelector(*this));
}

uint64_t CsaSelector::MemoryBytes() const {
  return TableBytes() + SessionBytes();
}

uint64_t CsaSelector::TableBytes() const {
  const Tables& t = *base_;
  return (t.centroids.size() + t.key_mean.size() + t.tail_mean.size()) * sizeof(float) +
         t.ids.size() * sizeof(int32_t) + t.scores.size() * sizeof(uint16_t) + t.sketch.size() +
         t.sketch_scale.size() * sizeof(uint16_t);
}

uint64_t CsaSelector::SessionBytes() const {
  uint64_t bytes = sizeof(*this) + overlay_.lists.capacity() * sizeof(ListOverlay);
  for (const auto& o : overlay_.lists) bytes += o.live.capacity() * sizeof(Entry);
  for (const auto& h : last_per_head_) bytes += h.capacity() * sizeof(int32_t);
  bytes += overlay_.sketch.capacity() + overlay_.sketch_scale.capacity() * sizeof(uint16_t);
  for (const auto& v : views_) {
    bytes += v.second.first.capacity() * sizeof(int32_t) +
             v.second.second.capacity() * sizeof(uint16_t);
  }
  return bytes;
}

double CsaSelector::PlainBytesPerToken() const {
  return static_cast<double>(base_->ids.size() * kEntryBytes +
                             base_->centroids.size() * sizeof(float) + base_->sketch.size() +
                             base_->sketch_scale.size() * sizeof(uint16_t)) /
         static_cast<double>(n_tokens_);
}

MethodParams CsaOptionsToParams(const CsaOptions& o) {
  auto num = [](double v) {
    char buf[32];
    auto r = std::to_chars(buf, buf + sizeof(buf), v);
    return std::string(buf, r.ptr);
  };
  MethodParams p;
  p["m"] = std::to_string(o.m);
  p["C"] = std::to_string(o.C);
  p["alpha"] = num(o.alpha);
  p["L"] = std::to_string(o.fixed_L);
  p["query_cap"] = std::to_string(o.query_cap);
  p["iters"] = std::to_string(o.kmeans_iters);
  p["seed"] = std::to_string(o.seed);
  p["center"] = o.center_keys ? "true" : "false";
  p["rho"] = num(o.rho);
  p["R"] = std::to_string(o.recent);
  p["sinks"] = std::to_string(o.sinks);
  p["tau"] = std::to_string(o.tau);
  p["backoff_cos"] = num(o.backoff_cos);
  p["weights"] = o.proj_weights ? "proj" : o.norm_weights ? "norm" : "uniform";
  p["missing"] = o.impute_tail_mean ? "mean" : o.impute_min ? "min" : "zero";
  p["period"] = std::to_string(o.period);
  p["format"] = o.compact ? "compact" : "plain";
  p["rerank"] = num(o.rerank);
  return p;
}

double CsaSelector::CompactBytesPerToken() const {
  std::string bytes;
  SerializeCompact(&bytes);
  return static_cast<double>(bytes.size()) / static_cast<double>(n_tokens_);
}

StatusOr<std::unique_ptr<Selector>> BuildCsaSelector(const HeadPrefill& prefill,
                                                     const MethodParams& params) {
  ASSIGN_OR_RETURN(CsaOptions o, ParseCsaOptions(params));
  ASSIGN_OR_RETURN(std::unique_ptr<CsaSelector> s, CsaSelector::Build(prefill, o));
  return std::unique_ptr<Selector>(std::move(s));
}

StatusOr<std::unique_ptr<Selector>> LoadCsaSelector(std::string_view bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<CsaSelector> s, CsaSelector::Load(bytes));
  return std::unique_ptr<Selector>(std::move(s));
}

}  // namespace ctxcache::index
