// LFPS: Learn From the Past for Sparse indexing (seed 002, DESIGN §5.3).
//
// A per-session predictor for one (layer, kv head) and the G q heads of its
// group. Each q head keeps a vertical table Φver (attention that position i
// received in past steps) and a slash table Φsla (attention at a fixed
// distance from the query, shifted by one position per step). The initial
// tables come from the attention weights of the last s prefill queries
// (LFPS Eq. 4); K̄, V̄ (per kv head) and σ̂² = σ²/‖q‖² (per q head, from the
// last prefill query) feed the sink-bypass estimate.
//
// Per Select() and q head (LFPS Alg. 1):
//  1. ρ = w_sink / (w_sink + w_global + w_local) (Eq. 5-6); if ρ > ε the head
//     is "bypassed": it gets sinks + the local window only, tables unchanged.
//  2. C0 = {i: Φver(i) > τ(Φver)} ∪ {i: Φsla(i) > τ(Φsla)}, τ(x) = a·mean(x)/κ(x),
//     κ(x) = Σ(x−x̄)⁴ / (Σ(x−x̄)²)² (Eq. 7-8).
//  3. C1 = C0 expanded by {−1,0,1,2}, kept where Φver > mean or Φsla > mean (Eq. 9);
//     then, when C1 has fewer than floor·(budget − sinks) positions, topped up
//     with the positions of largest max(|Φver|, |Φsla|) (ctxcache addition:
//     LfpsTopUp; floor 0 = the seed's C1).
//  4. Exact q·k over C1 ∪ local window; top-(budget − sinks) gives C2; the
//     head's selection is sinks ∪ C2.
//  5. Tables updated with decay r and the softmax weights over C2 (Eq. 10).
// The sink tokens (first n_sink) are kept outside the tables, as in the seed
// (its footnote 1): always selected, never table candidates.
//
// Params: "s" (history rows, default 32), "r" (decay, 0.95), "eps" (bypass
// threshold, 0.85), "a" (threshold scale, 0.2), "sink" (4), "local" (recent
// tokens scored every step, 6), "rho" (default budget fraction, 0.02),
// "floor" (candidate floor, a multiple of the top-k size, 6).
// Unknown keys -> InvalidArgument.
//
// Select() needs SelectInput::keys and MUTATES the tables: one instance per
// decode session (Clone()). Not safe for concurrent use.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "index/selector.h"

namespace ctxcache::index {

struct LfpsOptions {
  // s: prefill query rows (the last ones) used for the initial tables. Default: 32.
  int history = 32;
  // r: table decay per step. Default: 0.95.
  double decay = 0.95;
  // ε: sink-bypass threshold on ρ. Default: 0.85.
  double epsilon = 0.85;
  // a: candidate threshold scale. Default: 0.2.
  double a = 0.2;
  // Sink tokens (always selected, kept out of the tables). Default: 4.
  int n_sink = 4;
  // Most recent tokens scored every step (w_local and candidates). Default: 6.
  int local_window = 6;
  // Default budget as a fraction of N when SelectInput::budget == 0. Default: 0.02.
  double rho = 0.02;
  // Candidate floor: C1 is topped up to at least floor x (budget - sinks)
  // positions (LfpsTopUp). Default: 6. The seed has none (0): on the reference
  // model its C1 is smaller than the top-k it must fill (0.8-2.2% of the keys
  // at a 2% budget) and its overlap with the exact top-k is 0.22-0.34; with 6
  // it is 0.87-0.91 at ~12% of the keys scored (5: 0.84-0.89 at ~10%;
  // docs/algorithms.md, "LFPS: today's defaults and why").
  double candidate_floor = 6;
};

// Per-call counters, cumulative over the life of the instance.
struct LfpsCounters {
  uint64_t head_steps = 0;   // (q head, Select) pairs
  uint64_t bypassed = 0;     // of which took the sink bypass
  uint64_t keys_scored = 0;  // exact q.k products
  uint64_t keys_total = 0;   // Σ n_tokens over head_steps
};

class LfpsSelector final : public Selector {
 public:
  // 2 adds the candidate floor; a version 1 artifact loads with floor 0 (as built).
  static constexpr uint32_t kFormatVersion = 2;

  // Needs keys, values and queries (G rows per position) in `prefill`.
  static StatusOr<std::unique_ptr<LfpsSelector>> Build(const HeadPrefill& prefill,
                                                       const LfpsOptions& options);
  static StatusOr<std::unique_ptr<LfpsSelector>> Load(std::string_view bytes);

  std::string_view method() const override { return "lfps"; }
  int64_t n_tokens() const override { return n_tokens_; }
  int head_dim() const override { return head_dim_; }
  Status Select(const SelectInput& in, Selection* out, WorkStats* stats) override;
  Status Append(const float* key, const float* value, const float* queries) override;
  Status Serialize(std::string* out) const override;
  std::unique_ptr<Selector> Clone() const override;
  uint64_t MemoryBytes() const override;

  int group_size() const { return group_size_; }
  const LfpsOptions& options() const { return options_; }
  const LfpsCounters& counters() const { return counters_; }
  const std::vector<float>& vertical(int q_head) const { return ver_[q_head]; }
  const std::vector<float>& slash(int q_head) const { return sla_[q_head]; }

 private:
  LfpsSelector() = default;
  Status SelectHead(int h, const float* q, int64_t budget, const KeySource& keys,
                    std::vector<int32_t>* ids, WorkStats* stats);

  int64_t n_tokens_ = 0;
  int head_dim_ = 0;
  int group_size_ = 0;
  LfpsOptions options_;
  std::vector<float> key_mean_;          // K̄, d
  std::vector<float> value_mean_;        // V̄, d (zeros when values were not given)
  std::vector<float> sigma_hat2_;        // σ̂² per q head
  std::vector<std::vector<float>> ver_;  // per q head, n_tokens entries
  std::vector<std::vector<float>> sla_;
  LfpsCounters counters_;
};

// κ(x) = Σ(x−x̄)⁴ / (Σ(x−x̄)²)² (LFPS Eq. 8); 0 when x is constant.
double LfpsKurtosis(const float* x, int64_t n);
// τ(x) = a·mean(x)/κ(x); +inf when κ(x) is 0 (no candidates from a flat table).
double LfpsThreshold(const float* x, int64_t n, double a);

// Initial tables from attention rows (LFPS Eq. 4). weights: rows × n, row j
// holds the attention of the query at position positions[j] (< n) over keys
// 0..n−1. Φver(i) = c·Σ_j w_j(i); Φsla(i) = c·Σ_j w_j(i − (n−1−positions[j]))
// (0 for negative indices), c = 1 / (2·rows·(1−r)).
void LfpsInitialTables(const std::vector<std::vector<float>>& weights,
                       const std::vector<int64_t>& positions, int64_t n, double r,
                       std::vector<float>* ver, std::vector<float>* sla);

// C1 from C0 (LFPS Eq. 9): offsets {−1,0,1,2}, kept where Φver(j) > mean(Φver)
// or Φsla(j) > mean(Φsla), restricted to [lo, n). Sorted, unique.
std::vector<int32_t> LfpsExpand(const std::vector<float>& ver, const std::vector<float>& sla,
                                const std::vector<int32_t>& c0, int64_t lo);

// C1 topped up to at least `want` positions of [lo, end) with the positions
// of largest max(|Φver(i)|, |Φsla(i)|) not in c1 (ties: the lower position).
// A negative entry is a recent top-k member that held less than half the
// average weight (Eq. 10): it was relevant, so it ranks by magnitude. Sorted.
std::vector<int32_t> LfpsTopUp(const std::vector<float>& ver, const std::vector<float>& sla,
                               std::vector<int32_t> c1, int64_t lo, int64_t end, int64_t want);

// Table update (LFPS Eq. 10). c2: the selected positions; w: their normalized
// attention (sums to 1). Φver'(i) = r·Φver(i) + w_i − 1/(2|C2|) and
// Φsla'(i) = r·Φsla(i−1) + w_i − 1/(2|C2|), with w_i = 1/(2|C2|) off C2.
void LfpsUpdateTables(double r, const std::vector<int32_t>& c2, const std::vector<float>& w,
                      std::vector<float>* ver, std::vector<float>* sla);

StatusOr<LfpsOptions> ParseLfpsParams(const MethodParams& params);

// Registry entry points (index/selector.cc).
StatusOr<std::unique_ptr<Selector>> BuildLfpsSelector(const HeadPrefill& prefill,
                                                      const MethodParams& params);
StatusOr<std::unique_ptr<Selector>> LoadLfpsSelector(std::string_view bytes);

}  // namespace ctxcache::index
