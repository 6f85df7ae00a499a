// Exact attention for one query and the fidelity metrics of DESIGN §5.5:
//   recall@K      = |S ∩ T_K| / K, with T_K the exact top-K by q.k
//   mass p(S)     = sum_{i in S} softmax(q.k / sqrt(d))_i
//   output error  = ||o - o_S|| / ||o||, with o_S attention restricted to S
//                   and renormalized.
// Everything is computed exactly (double accumulation), for evaluation only.
//
// Thread-safety: ExactAttention is an immutable value after Compute();
// functions are reentrant.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace ctxcache::index {

// out[i] = q . keys[i] for i < n (Eigen GEMV). keys: n x d row-major.
void ScoreKeys(const float* q, const float* keys, int64_t n, int d, float* out);

// Exact attention of one query over n keys (and values, if given).
class ExactAttention {
 public:
  // values may be null (then output-error metrics are unavailable).
  static StatusOr<ExactAttention> Compute(const float* q, const float* keys, const float* values,
                                          int64_t n, int d);

  int64_t n() const { return static_cast<int64_t>(logits_.size()); }
  const std::vector<float>& scores() const { return logits_; }   // q.k (unscaled)
  const std::vector<double>& probs() const { return probs_; }    // softmax(q.k/sqrt(d))
  const std::vector<double>& output() const { return output_; }  // o (d), empty without V

  // Exact top-k ids by q.k, ascending ids (ties: lower id).
  std::vector<int32_t> TopK(int64_t k) const;
  // Mass captured by a set of ids (any order; duplicates counted once if sorted-unique).
  double Mass(const std::vector<int32_t>& ids) const;
  // ||o - o_S|| / ||o||; -1 without values or for empty S.
  double OutputError(const std::vector<int32_t>& ids) const;

 private:
  int d_ = 0;
  const float* values_ = nullptr;  // borrowed; must outlive OutputError calls
  std::vector<float> logits_;
  std::vector<double> probs_;
  std::vector<double> output_;
};

// The attention mass that `attended` (sorted-unique ids) captures, estimated
// from a method's own logit estimates instead of the keys: `estimated` holds
// sorted-unique ids with their estimated logits (parallel, q.k/sqrt(d) scale)
// and log_normalizer = log sum_i exp(logit_i) over all n covered tokens. An
// attended id without an estimate (added by whole-page widening) counts as the
// average token outside `estimated`. Result in [0, 1].
double EstimateCapturedMass(const std::vector<int32_t>& estimated, const std::vector<float>& logits,
                            double log_normalizer, int64_t n, const std::vector<int32_t>& attended);

// log sum_i exp(x[i] * scale) for i < n, stable (max-shifted, double sums).
double LogSumExp(const float* x, int64_t n, float scale);

// |selected ∩ exact| / |exact|; both sorted-unique.
double RecallAtK(const std::vector<int32_t>& selected, const std::vector<int32_t>& exact_topk);

// Mean of per-query metrics, for reports.
struct FidelitySummary {
  double recall = 0;        // mean recall@K
  double mass = 0;          // mean attention mass captured
  double output_error = 0;  // mean output relative error (-1 if unavailable)
  int64_t count = 0;
  void Add(double r, double m, double e);
  void Finish();
};

}  // namespace ctxcache::index
