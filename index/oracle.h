// The reference selectors (DESIGN §5.5):
//   "full":   every token; no parameters.
//   "oracle": the exact top-K by q.k per q head, scoring every key through
//             SelectInput.keys (required). Parameters: rho (keep ratio,
//             default 0.05, in (0, 1]); K = SelectInput.budget or ceil(rho*N).
// Both keep no tables: their artifacts are a small header (n_tokens, head_dim,
// parameters).
//
// Thread-safety: as Selector (selector.h).
#pragma once

#include <memory>
#include <string_view>

#include "index/selector.h"

namespace ctxcache::index {

StatusOr<std::unique_ptr<Selector>> BuildFullSelector(const HeadPrefill& prefill,
                                                      const MethodParams& params);
StatusOr<std::unique_ptr<Selector>> LoadFullSelector(std::string_view bytes);

StatusOr<std::unique_ptr<Selector>> BuildOracleSelector(const HeadPrefill& prefill,
                                                        const MethodParams& params);
StatusOr<std::unique_ptr<Selector>> LoadOracleSelector(std::string_view bytes);

// K for a keep ratio: budget if > 0, else ceil(rho * n), clamped to [1, n].
int64_t BudgetFor(int64_t budget, double rho, int64_t n);

// Exact scores q_h . k_i for all n keys of `keys` into out (n floats), in
// chunks through GatherKeys (or directly for an ArrayKeySource).
Status ScoreAllKeys(const KeySource& keys, const float* q, int64_t n, float* out,
                    std::vector<float>* scratch);

}  // namespace ctxcache::index
