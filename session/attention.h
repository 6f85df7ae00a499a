// The one attention routine of a sparse decode step: a q head attends a set
// of context rows (each a pointer to d floats of K and of V, e.g. rows of
// fetched pages) followed by a contiguous tail (the tokens appended during
// decode, always attended, as Tactic does for fresh tokens). The embedded
// decode (model/decode.h) and the reference worker (client/worker/) both call
// it through AttendSelected, which gathers a q head's rows from its
// selection, so the same inputs give bit-identical outputs in every mode.
//
// Thread-safety: reentrant; `scratch` is the caller's.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ctxcache::session {

// out[0..d) = softmax(q . K^T / sqrt(d)) V over the rows k_rows/v_rows (same
// length) followed by the n_tail rows of tail_k/tail_v ([n_tail][d] each; may
// be null when n_tail is 0). With no rows at all, out is zero. scratch holds
// the scores and is resized as needed (no allocation once large enough).
void AttendRows(const float* q, int d, std::span<const float* const> k_rows,
                std::span<const float* const> v_rows, const float* tail_k, const float* tail_v,
                int64_t n_tail, float* out, std::vector<float>* scratch);

// The K and V rows (d floats each) of one stored token.
struct StoredRow {
  const float* k;
  const float* v;
};

// AttendSelected's buffers, reused from call to call.
struct AttendScratch {
  std::vector<const float*> k_rows, v_rows;  // the rows a q head attends
  std::vector<float> scores;                 // AttendRows' scratch
};

// One q head's attention in a sparse step: the rows of the stored tokens it
// selected (the ids of `selected`, ascending, below n_stored, each found by
// row_of(id) -> StoredRow; ids from n_stored on are appended tokens, which
// the tail holds), then AttendRows over those rows and the n_tail tail rows.
// Returns the stored rows attended.
template <typename RowOf>
size_t AttendSelected(const float* q, int d, std::span<const int32_t> selected, int64_t n_stored,
                      RowOf&& row_of, const float* tail_k, const float* tail_v, int64_t n_tail,
                      float* out, AttendScratch* scratch) {
  scratch->k_rows.clear();
  scratch->v_rows.clear();
  for (int32_t id : selected) {
    if (id >= n_stored) break;  // sorted; appended tokens are the tail
    const StoredRow row = row_of(id);
    scratch->k_rows.push_back(row.k);
    scratch->v_rows.push_back(row.v);
  }
  AttendRows(q, d, scratch->k_rows, scratch->v_rows, tail_k, tail_v, n_tail, out,
             &scratch->scores);
  return scratch->k_rows.size();
}

}  // namespace ctxcache::session
