// Workload: one (layer, kv head) for the selector benches (fidelity, index):
// the keys/values, the prefill queries a selector is built on and the unseen
// evaluation queries (decode steps at or after the end of the context), from
// a synthetic head (index/synthetic.h) or a .ctxtrace (model/trace.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "index/selector.h"
#include "index/synthetic.h"

namespace ctxcache::bench {

// Keys/values of all tokens; the context is the first n; the evaluation
// queries sit at eval_pos (>= n) and see the context plus the tokens between.
struct Workload {
  std::string source;  // "synthetic" or the trace path
  int64_t n = 0;       // context tokens (what the selectors are built on)
  int64_t n_all = 0;   // tokens with keys available (context + later tokens)
  int d = 0;
  int G = 0;
  std::vector<float> keys, values;   // n_all x d
  std::vector<int64_t> prefill_pos;  // ascending, < n
  std::vector<float> prefill_q;      // [G][rows][d]
  std::vector<int64_t> eval_pos;     // ascending, >= n
  std::vector<float> eval_q;         // [row][G][d]

  // A HeadPrefill view over the first n tokens (pointers into this object).
  index::HeadPrefill Prefill() const;
  // Evaluation rows (decode steps); row t holds G query vectors at EvalQ(t).
  int n_eval_rows() const { return static_cast<int>(eval_pos.size()); }
  const float* EvalQ(int t) const { return eval_q.data() + static_cast<size_t>(t) * G * d; }
  // Evaluation query vectors, one q head each (n_eval_rows() * G, row-major
  // over rows and heads): Q(i) is head i % G of row i / G.
  int n_eval_queries() const { return n_eval_rows() * G; }
  const float* Q(int i) const { return eval_q.data() + static_cast<size_t>(i) * d; }
};

// The context is h's n_tokens; its decode steps are the evaluation rows (at
// positions n, n+1, ...) and its decode keys/values the tokens after the
// context (n_all = n + n_decode). Pass an rvalue to avoid copying h.
Workload FromSynthetic(index::SyntheticHead h);

// One (layer_slot, kv_slot) of a .ctxtrace: the last `eval_rows` stored query
// rows are the evaluation rows; the context is the tokens before the first of
// them, built on the earlier rows (at least `min_prefill_rows`); n_all is
// every token of the trace. `eval_flag` names the bench's option that sets
// eval_rows, for the error messages. InvalidArgument on slots out of range,
// too few rows, or fewer than 64 context tokens.
StatusOr<Workload> FromTrace(const std::string& path, int layer_slot, int kv_slot, int eval_rows,
                             int min_prefill_rows, const std::string& eval_flag);

}  // namespace ctxcache::bench
