// Top-K selection over dense score arrays, and sorted-id set helpers.
//
// Order is deterministic: larger score first, ties broken by the lower id.
// Scores must be finite (callers validate inputs). For large n the selection
// estimates a threshold from a strided sample, keeps the candidates at or
// above it in one pass and runs nth_element on those only; if the sample was
// unlucky it falls back to a full nth_element, so the result is always exact.
//
// Thread-safety: free functions are reentrant; a TopKScratch must not be
// shared between threads.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace ctxcache::index {

// Reusable buffers so hot paths do not allocate per call.
struct TopKScratch {
  std::vector<std::pair<float, int32_t>> candidates;
  std::vector<float> sample;
  std::vector<uint64_t> bits;  // kById: a bitmap over the id range
};

enum class TopKOrder {
  kByScore,  // descending score, ties by ascending id
  kById,     // ascending id
  kAny,      // unspecified (cheapest)
};

// Writes the ids of the min(k, n) largest scores[0..n) to *ids (resized).
// `scratch` may be null.
void SelectTopK(const float* scores, int64_t n, int64_t k, TopKOrder order,
                std::vector<int32_t>* ids, TopKScratch* scratch = nullptr);

// Same over a subset: only ids in `allowed` (any order, unique) compete.
void SelectTopKAmong(const float* scores, const std::vector<int32_t>& allowed, int64_t k,
                     TopKOrder order, std::vector<int32_t>* ids, TopKScratch* scratch = nullptr);

// Sorted-unique union of two sorted-unique id lists.
std::vector<int32_t> UnionSorted(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

// |a ∩ b| for two sorted-unique id lists.
int64_t IntersectionSize(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

// Sorts and removes duplicates in place.
void SortUnique(std::vector<int32_t>* ids);

}  // namespace ctxcache::index
