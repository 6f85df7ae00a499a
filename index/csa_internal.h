// Internals shared by the csa translation units (csa.cc: options and the
// registry hooks; csa_build.cc: Build and Append; csa_search.cc: Select and
// the list views; csa_format.cc: Serialize and Load). Not part of index/csa.h's
// contract; nothing outside index/csa*.cc includes it.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "index/csa.h"
#include "index/topk.h"

namespace ctxcache::index::csa_internal {

// CSAP version 1: no key sketch; version 2 (written): the sketch section
// follows the lists. CSAC version 1: 8-bit scores in [lo, hi], delta-varint
// ids; version 2: per-list 4-bit score codebooks, ids as a bitmap or delta
// varints, whichever is smaller; version 3: as 2, with Elias-Fano ids as a
// third choice; version 4 (written): as 3, then the sketch section
// (docs/storage-format.md).
inline constexpr uint32_t kPlainVersion = 2;
inline constexpr uint32_t kCompactVersion = 4;
inline constexpr uint32_t kPlainSketchVersion = 2;
inline constexpr uint32_t kCompactSketchVersion = 4;
inline constexpr uint8_t kSketchBits = 8;
inline constexpr int kSketchMaxCode = 127;
inline constexpr int kSketchQueryMaxCode = 2047;
inline constexpr int kCompactScoreBits = 4;
inline constexpr uint8_t kIdsVarint = 0;
inline constexpr uint8_t kIdsBitmap = 1;
inline constexpr uint8_t kIdsEliasFano = 2;  // version >= 3

inline constexpr size_t kEntryBytes = sizeof(int32_t) + sizeof(uint16_t);

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
SearchScratch& Scratch();

// The 8-bit sketch of one key: x = key - mean, scale = fp16(max|x| / 127),
// code_j = clamp(round(x_j / scale), -127, 127) (all 0 when the scale is 0).
void SketchKey(const float* key, const float* mean, int d, int8_t* code, uint16_t* scale);

// InvalidArgument naming the first option out of range (index/csa.h).
Status CheckOptions(const CsaOptions& o);

}  // namespace ctxcache::index::csa_internal
