// Top-K selection over dense score arrays, and sorted-id set helpers.
//
// Order is deterministic: larger score first, ties broken by the lower id;
// -0 and +0 are equal. Scores must not be NaN (±inf is fine). SelectTopK is
// a radix select: the scores' order-preserving 32-bit images go through
// histogram passes of up to 11 bits each, most significant first, starting
// below the bits that every key shares (so a narrow score range needs few
// passes), the later passes only over the ids that share the k-th's prefix,
// to the k-th largest key; then one pass in id order takes the keys above it
// and the lowest ids equal to it, so kById needs no sort and the cost is O(n).
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
  std::vector<uint32_t> keys;    // SelectTopK: the scores' order-preserving keys
  std::vector<int32_t> prefix;   // SelectTopK: ids sharing the k-th key's prefix
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
