#include "index/topk.h"

#include <algorithm>

namespace ctxcache::index {
namespace {

inline bool Better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Sorts unique ids in [0, n) ascending: a bitmap walk when the range is
// small against the count (n / 64 words), else a comparison sort.
void SortIdsInRange(std::vector<int32_t>* ids, int64_t n, std::vector<uint64_t>* bits) {
  const int64_t k = static_cast<int64_t>(ids->size());
  if (n <= 0 || n > 64 * 16 * k) {
    std::sort(ids->begin(), ids->end());
    return;
  }
  bits->assign(static_cast<size_t>((n + 63) / 64), 0);
  for (int32_t id : *ids) (*bits)[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63);
  size_t e = 0;
  for (size_t w = 0; w < bits->size(); ++w) {
    for (uint64_t word = (*bits)[w]; word != 0; word &= word - 1) {
      (*ids)[e++] = static_cast<int32_t>(w * 64 + static_cast<size_t>(__builtin_ctzll(word)));
    }
  }
}

// Keeps the best k of *c (unordered) and writes their ids in `order`; the
// ids lie in [0, range) (0: unknown).
void Finish(std::vector<std::pair<float, int32_t>>* c, int64_t k, TopKOrder order,
            std::vector<int32_t>* ids, int64_t range, std::vector<uint64_t>* bits) {
  k = std::min<int64_t>(k, static_cast<int64_t>(c->size()));
  if (k < static_cast<int64_t>(c->size())) {
    std::nth_element(c->begin(), c->begin() + k, c->end(), Better);
  }
  if (order == TopKOrder::kByScore) std::sort(c->begin(), c->begin() + k, Better);
  ids->resize(k);
  for (int64_t i = 0; i < k; ++i) (*ids)[i] = (*c)[i].second;
  if (order == TopKOrder::kById) SortIdsInRange(ids, range, bits);
}

constexpr int64_t kSampleSize = 1024;
constexpr int64_t kDirectThreshold = 8192;

}  // namespace

void SelectTopK(const float* scores, int64_t n, int64_t k, TopKOrder order,
                std::vector<int32_t>* ids, TopKScratch* scratch) {
  TopKScratch local;
  TopKScratch& s = scratch ? *scratch : local;
  auto& c = s.candidates;
  c.clear();
  k = std::max<int64_t>(0, std::min(k, n));
  if (k == 0) {
    ids->clear();
    return;
  }
  if (n > kDirectThreshold && k * 4 < n) {
    // Threshold from a strided sample: the sample rank of the k-th largest,
    // plus a margin so the candidate set contains the top-k with high odds.
    s.sample.resize(kSampleSize);
    const int64_t stride = n / kSampleSize;
    for (int64_t i = 0; i < kSampleSize; ++i) s.sample[i] = scores[i * stride];
    const int64_t expected = k * kSampleSize / n;
    const int64_t rank = std::min<int64_t>(kSampleSize - 1, expected + expected / 2 + 16);
    std::nth_element(s.sample.begin(), s.sample.begin() + rank, s.sample.end(),
                     std::greater<float>());
    const float threshold = s.sample[rank];
    c.reserve(static_cast<size_t>(std::min<int64_t>(n, 3 * k + 64)));
    for (int64_t i = 0; i < n; ++i) {
      if (scores[i] >= threshold) c.emplace_back(scores[i], static_cast<int32_t>(i));
    }
    // Exact iff every element >= the k-th largest is in c, i.e. |c| >= k.
    if (static_cast<int64_t>(c.size()) >= k) {
      Finish(&c, k, order, ids, n, &s.bits);
      return;
    }
    c.clear();
  }
  c.resize(n);
  for (int64_t i = 0; i < n; ++i) c[i] = {scores[i], static_cast<int32_t>(i)};
  Finish(&c, k, order, ids, n, &s.bits);
}

void SelectTopKAmong(const float* scores, const std::vector<int32_t>& allowed, int64_t k,
                     TopKOrder order, std::vector<int32_t>* ids, TopKScratch* scratch) {
  TopKScratch local;
  TopKScratch& s = scratch ? *scratch : local;
  auto& c = s.candidates;
  c.resize(allowed.size());
  for (size_t i = 0; i < allowed.size(); ++i) c[i] = {scores[allowed[i]], allowed[i]};
  Finish(&c, std::max<int64_t>(0, k), order, ids, /*range=*/0, &s.bits);
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
