// The one attention routine of a sparse decode step: a q head attends a set
// of context rows (each a pointer to d floats of K and of V, e.g. rows of
// fetched pages) followed by a contiguous tail (the tokens appended during
// decode, always attended, as Tactic does for fresh tokens). The embedded
// decode (model/decode.h) and the reference worker (client/worker/) both call
// it, so the same inputs give bit-identical outputs in every mode.
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

}  // namespace ctxcache::session
