#include "index/metrics.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/dtype.h"
#include "index/eigen_blocking.h"
#include "index/topk.h"

namespace ctxcache::index {

using RowMajorMap =
    Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

void ScoreKeys(const float* q, const float* keys, int64_t n, int d, float* out) {
  RowMajorMap K(keys, n, d);
  Eigen::Map<const Eigen::VectorXf> qv(q, d);
  Eigen::Map<Eigen::VectorXf> o(out, n);
  o.noalias() = K * qv;
}

StatusOr<ExactAttention> ExactAttention::Compute(const float* q, const float* keys,
                                                 const float* values, int64_t n, int d) {
  if (q == nullptr || keys == nullptr || n < 1 || d < 1) {
    return InvalidArgumentError("ExactAttention: need q, keys, n >= 1, d >= 1");
  }
  if (HasNonFinite(q, d)) return InvalidArgumentError("ExactAttention: q has NaN/Inf");
  ExactAttention a;
  a.d_ = d;
  a.values_ = values;
  a.logits_.resize(n);
  ScoreKeys(q, keys, n, d, a.logits_.data());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double mx = -INFINITY;
  for (float s : a.logits_) mx = std::max(mx, s * scale);
  a.probs_.resize(n);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    a.probs_[i] = std::exp(a.logits_[i] * scale - mx);
    total += a.probs_[i];
  }
  for (double& p : a.probs_) p /= total;
  if (values != nullptr) {
    a.output_.assign(d, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = values + i * d;
      for (int j = 0; j < d; ++j) a.output_[j] += a.probs_[i] * v[j];
    }
  }
  return a;
}

std::vector<int32_t> ExactAttention::TopK(int64_t k) const {
  std::vector<int32_t> ids;
  SelectTopK(logits_.data(), n(), k, TopKOrder::kById, &ids);
  return ids;
}

double ExactAttention::Mass(const std::vector<int32_t>& ids) const {
  double m = 0;
  for (int32_t i : ids) {
    if (i >= 0 && i < n()) m += probs_[i];
  }
  return m;
}

double ExactAttention::OutputError(const std::vector<int32_t>& ids) const {
  if (values_ == nullptr || ids.empty()) return -1.0;
  std::vector<double> o(d_, 0.0);
  double total = 0;
  for (int32_t i : ids) {
    if (i < 0 || i >= n()) continue;
    total += probs_[i];
    const float* v = values_ + static_cast<int64_t>(i) * d_;
    for (int j = 0; j < d_; ++j) o[j] += probs_[i] * v[j];
  }
  if (total <= 0) return -1.0;
  double num = 0, den = 0;
  for (int j = 0; j < d_; ++j) {
    const double diff = o[j] / total - output_[j];
    num += diff * diff;
    den += output_[j] * output_[j];
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

double LogSumExp(const float* x, int64_t n, float scale) {
  if (n <= 0) return -std::numeric_limits<double>::infinity();
  // Vectorized float exp (one pass per decode step and q head); the shift by
  // the maximum keeps every term in (0, 1].
  Eigen::Map<const Eigen::ArrayXf> a(x, n);
  const float mx = scale >= 0 ? a.maxCoeff() * scale : a.minCoeff() * scale;
  if (!std::isfinite(mx)) return mx;
  const double sum = (a * scale - mx).exp().cast<double>().sum();
  return static_cast<double>(mx) + std::log(sum);
}

double EstimateCapturedMass(const std::vector<int32_t>& estimated, const std::vector<float>& logits,
                            double log_normalizer, int64_t n,
                            const std::vector<int32_t>& attended) {
  if (n <= 0 || !std::isfinite(log_normalizer)) return 0.0;
  // Mass of the estimated tokens, and of those among them that are attended.
  double est_all = 0, captured = 0;
  size_t a = 0;
  int64_t unestimated_attended = 0;
  for (size_t e = 0; e < estimated.size(); ++e) {
    const double p = std::exp(static_cast<double>(logits[e]) - log_normalizer);
    est_all += p;
    while (a < attended.size() && attended[a] < estimated[e]) {
      ++unestimated_attended;
      ++a;
    }
    if (a < attended.size() && attended[a] == estimated[e]) {
      captured += p;
      ++a;
    }
  }
  unestimated_attended += static_cast<int64_t>(attended.size() - a);
  const int64_t rest = n - static_cast<int64_t>(estimated.size());
  if (rest > 0 && unestimated_attended > 0) {
    captured += std::max(0.0, 1.0 - est_all) * static_cast<double>(unestimated_attended) /
                static_cast<double>(rest);
  }
  return std::clamp(captured, 0.0, 1.0);
}

double RecallAtK(const std::vector<int32_t>& selected, const std::vector<int32_t>& exact_topk) {
  if (exact_topk.empty()) return 1.0;
  return static_cast<double>(IntersectionSize(selected, exact_topk)) /
         static_cast<double>(exact_topk.size());
}

void FidelitySummary::Add(double r, double m, double e) {
  recall += r;
  mass += m;
  if (e < 0 || output_error < 0) {
    output_error = -1;
  } else {
    output_error += e;
  }
  ++count;
}

void FidelitySummary::Finish() {
  if (count == 0) return;
  recall /= count;
  mass /= count;
  if (output_error >= 0) output_error /= count;
}

}  // namespace ctxcache::index
