#include "index/topk.h"

#include <algorithm>
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
    // The k-th largest key, digit by digit; `need` counts the keys still to
    // take at or below the digits fixed so far.
    uint32_t hist[2048];
    auto pick = [&](int size, int64_t* need) {
      int d = size - 1;
      while (*need > hist[d]) *need -= hist[d--];
      return static_cast<uint32_t>(d);
    };
    int64_t need = k;
    std::fill(hist, hist + 2048, 0u);
    for (int64_t i = 0; i < n; ++i) {
      key[i] = OrderKey(scores[i]);
      ++hist[key[i] >> 21];
    }
    const uint32_t d1 = pick(2048, &need);
    auto& pre = s.prefix;
    pre.resize(static_cast<size_t>(hist[d1]) + 1);  // branch-free: one slot past the last
    int64_t n_pre = 0;
    for (int64_t i = 0; i < n; ++i) {
      pre[n_pre] = static_cast<int32_t>(i);
      n_pre += (key[i] >> 21) == d1;
    }
    pre.resize(n_pre);
    std::fill(hist, hist + 2048, 0u);
    for (int32_t i : pre) ++hist[(key[i] >> 10) & 2047];
    const uint32_t d2 = pick(2048, &need);
    std::fill(hist, hist + 1024, 0u);
    for (int32_t i : pre) {
      if (((key[i] >> 10) & 2047) == d2) ++hist[key[i] & 1023];
    }
    const uint32_t d3 = pick(1024, &need);
    const uint32_t kth = (d1 << 21) | (d2 << 10) | d3;
    // `need` keys equal to the k-th are taken, the lowest ids first (a
    // branch-free compaction: one slot past the k kept ones is written).
    ids->resize(k + 1);
    int32_t* out = ids->data();
    int64_t e = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool tie = key[i] == kth && need > 0;
      need -= tie;
      out[e] = static_cast<int32_t>(i);
      e += (key[i] > kth) | tie;
    }
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
