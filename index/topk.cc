#include "index/topk.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>

namespace ctxcache::index {
namespace {

inline bool Better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Keeps the best k of *c (unordered) and writes their ids in `order`.
void Finish(std::vector<std::pair<float, int32_t>>* c, int64_t k, TopKOrder order,
            std::vector<int32_t>* ids) {
  k = std::min<int64_t>(k, static_cast<int64_t>(c->size()));
  if (k < static_cast<int64_t>(c->size())) {
    std::nth_element(c->begin(), c->begin() + k, c->end(), Better);
  }
  if (order == TopKOrder::kByScore) std::sort(c->begin(), c->begin() + k, Better);
  ids->resize(k);
  for (int64_t i = 0; i < k; ++i) (*ids)[i] = (*c)[i].second;
  if (order == TopKOrder::kById) std::sort(ids->begin(), ids->end());
}

// An order-preserving unsigned image of a float: a larger float has a larger
// key; -0 and +0 share one.
inline uint32_t OrderKey(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  b = b == 0x80000000u ? 0 : b;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// AVX2 stream compaction (x86-64-v3 is the build baseline): for each block
// of 8 keys, vec(keys, ids) gives the 8-bit mask of the ids to keep, and
// kCompress packs them in ascending order; scalar(key, i) does the tail.
// Writes up to 8 ints past the kept ones; returns how many were kept.
struct CompressTable {
  alignas(32) int32_t lanes[256][8];
};
constexpr CompressTable MakeCompressTable() {
  CompressTable t{};
  for (int m = 0; m < 256; ++m) {
    int c = 0;
    for (int b = 0; b < 8; ++b) {
      if ((m >> b) & 1) t.lanes[m][c++] = b;
    }
  }
  return t;
}
constexpr CompressTable kCompress = MakeCompressTable();

template <typename Vec, typename Scalar>
int64_t CompactIds(const uint32_t* key, int64_t n, Vec vec, Scalar scalar, int32_t* out) {
  int64_t e = 0, i = 0;
  const __m256i step = _mm256_set1_epi32(8);
  __m256i ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; i + 8 <= n; i += 8) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + i));
    const int m = vec(k, ids);
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompress.lanes[m]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e),
                        _mm256_permutevar8x32_epi32(ids, perm));
    e += std::popcount(static_cast<unsigned>(m));
    ids = _mm256_add_epi32(ids, step);
  }
  for (; i < n; ++i) {
    out[e] = static_cast<int32_t>(i);
    e += scalar(key[i], i);
  }
  return e;
}

inline int MaskOf(__m256i cond) { return _mm256_movemask_ps(_mm256_castsi256_ps(cond)); }

// hist[0..mask] = counts of the digit (key >> shift) & mask over key[ids[j]]
// (ids null: over key[0..n)). Four interleaved partial histograms, so runs of
// equal digits (a narrow or clustered score range) do not serialize on one
// counter's store-to-load latency.
void DigitHistogram(const uint32_t* key, const int32_t* ids, int64_t n, int shift, uint32_t mask,
                    uint32_t* hist) {
  uint32_t part[4][2048];
  const size_t buckets = static_cast<size_t>(mask) + 1;
  for (auto& p : part) std::fill(p, p + buckets, 0u);
  auto at = [&](int64_t j) { return ids ? key[ids[j]] : key[j]; };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    ++part[0][(at(j) >> shift) & mask];
    ++part[1][(at(j + 1) >> shift) & mask];
    ++part[2][(at(j + 2) >> shift) & mask];
    ++part[3][(at(j + 3) >> shift) & mask];
  }
  for (; j < n; ++j) ++part[0][(at(j) >> shift) & mask];
  for (size_t b = 0; b < buckets; ++b) hist[b] = part[0][b] + part[1][b] + part[2][b] + part[3][b];
}

}  // namespace

void SelectTopK(const float* scores, int64_t n, int64_t k, TopKOrder order,
                std::vector<int32_t>* ids, TopKScratch* scratch) {
  TopKScratch local;
  TopKScratch& s = scratch ? *scratch : local;
  k = std::max<int64_t>(0, std::min(k, n));
  ids->resize(k);
  if (k == 0) return;
  if (k == n) {
    std::iota(ids->begin(), ids->end(), 0);
  } else {
    auto& key = s.keys;
    key.resize(n);
    uint32_t lo = ~0u, hi = 0;
    for (int64_t i = 0; i < n; ++i) {
      key[i] = OrderKey(scores[i]);
      lo = std::min(lo, key[i]);
      hi = std::max(hi, key[i]);
    }
    // Bits above the highest one where the smallest and the largest key
    // differ are the same in every key, so the digits (11 bits, most
    // significant first) start below them and a narrow score range still
    // spreads over the buckets. The k-th largest key is found digit by
    // digit; `need` counts the keys still to take at or below the digits
    // fixed so far, `pre` holds the ids that share them.
    const int top = lo == hi ? -1 : 31 - std::countl_zero(lo ^ hi);
    uint32_t kth = top < 0 ? lo : lo & ~static_cast<uint32_t>((uint64_t{2} << top) - 1);
    int64_t need = k;
    int64_t ties = n;  // keys equal to the k-th
    uint32_t hist[2048];
    auto& pre = s.prefix;
    int64_t n_pre = n;
    bool have_pre = false;  // pre[0..n_pre) holds the ids sharing every digit but the last
    for (int shift = top + 1; shift > 0;) {
      const bool first = shift == top + 1;
      const int next = std::max(0, shift - 11);
      const uint32_t mask = (1u << (shift - next)) - 1;
      DigitHistogram(key.data(), first ? nullptr : pre.data(), n_pre, next, mask, hist);
      uint32_t d = mask;
      while (need > hist[d]) need -= hist[d--];
      kth |= d << next;
      ties = hist[d];
      if (next > 0) {  // keep the ids with this digit
        if (first) {
          pre.resize(static_cast<size_t>(hist[d]) + 8);
          const __m256i vmask = _mm256_set1_epi32(static_cast<int32_t>(mask));
          const __m256i vd = _mm256_set1_epi32(static_cast<int32_t>(d));
          const __m128i vshift = _mm_cvtsi32_si128(next);
          CompactIds(
              key.data(), n,
              [&](__m256i k, __m256i) {
                return MaskOf(
                    _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_srl_epi32(k, vshift), vmask), vd));
              },
              [&](uint32_t k, int64_t) { return ((k >> next) & mask) == d; }, pre.data());
        } else {  // in place (branch-free: one slot past the last kept is written)
          int64_t e = 0;
          for (int64_t j = 0; j < n_pre; ++j) {
            const int32_t i = pre[j];
            pre[e] = i;
            e += ((key[i] >> next) & mask) == d;
          }
        }
        n_pre = hist[d];
        have_pre = true;
      }
      shift = next;
    }
    // Of the `ties` keys equal to the k-th, the `need` lowest ids are taken:
    // those up to `last_tie`. Found before the pass below, so that pass has
    // no loop-carried count besides its output position.
    int64_t last_tie = n - 1;
    if (need < ties) {
      int64_t seen = 0;
      if (have_pre) {
        for (int64_t j = 0; j < n_pre; ++j) {
          if (key[pre[j]] == kth && ++seen == need) {
            last_tie = pre[j];
            break;
          }
        }
      } else {
        for (int64_t i = 0; i < n; ++i) {
          if (key[i] == kth && ++seen == need) {
            last_tie = i;
            break;
          }
        }
      }
    }
    // Keys above the k-th, and the k-th's up to last_tie. Unsigned order
    // through signed compares: both sides with the top bit flipped.
    ids->resize(k + 8);
    const __m256i flip = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
    const __m256i vkth = _mm256_set1_epi32(static_cast<int32_t>(kth));
    const __m256i vkth_s = _mm256_xor_si256(vkth, flip);
    const __m256i vlast = _mm256_set1_epi32(static_cast<int32_t>(last_tie));
    CompactIds(
        key.data(), n,
        [&](__m256i kv, __m256i iv) {
          const __m256i gt = _mm256_cmpgt_epi32(_mm256_xor_si256(kv, flip), vkth_s);
          const __m256i tie =
              _mm256_andnot_si256(_mm256_cmpgt_epi32(iv, vlast), _mm256_cmpeq_epi32(kv, vkth));
          return MaskOf(_mm256_or_si256(gt, tie));
        },
        [&](uint32_t kv, int64_t i) { return (kv > kth) | ((kv == kth) & (i <= last_tie)); },
        ids->data());
    ids->resize(k);
  }
  if (order == TopKOrder::kByScore) {
    std::sort(ids->begin(), ids->end(), [&](int32_t a, int32_t b) {
      return Better({scores[a], a}, {scores[b], b});
    });
  }
}

void SelectTopKAmong(const float* scores, const std::vector<int32_t>& allowed, int64_t k,
                     TopKOrder order, std::vector<int32_t>* ids, TopKScratch* scratch) {
  TopKScratch local;
  auto& c = (scratch ? *scratch : local).candidates;
  c.resize(allowed.size());
  for (size_t i = 0; i < allowed.size(); ++i) c[i] = {scores[allowed[i]], allowed[i]};
  Finish(&c, std::max<int64_t>(0, k), order, ids);
}

std::vector<int32_t> UnionSorted(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> out;
  out.reserve(a.size() + b.size());
  std::set_union(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

int64_t IntersectionSize(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  int64_t count = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] < b[j]) {
      ++i;
    } else if (b[j] < a[i]) {
      ++j;
    } else {
      ++count;
      ++i;
      ++j;
    }
  }
  return count;
}

void SortUnique(std::vector<int32_t>* ids) {
  std::sort(ids->begin(), ids->end());
  ids->erase(std::unique(ids->begin(), ids->end()), ids->end());
}

}  // namespace ctxcache::index
