#include "session/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ctxcache::session {

namespace {

float Dot(const float* a, const float* b, int d) {
  float s = 0;
  for (int j = 0; j < d; ++j) s += a[j] * b[j];
  return s;
}

}  // namespace

void AttendRows(const float* q, int d, std::span<const float* const> k_rows,
                std::span<const float* const> v_rows, const float* tail_k, const float* tail_v,
                int64_t n_tail, float* out, std::vector<float>* scratch) {
  const size_t n_rows = k_rows.size();
  const size_t n = n_rows + static_cast<size_t>(n_tail);
  std::fill(out, out + d, 0.f);
  if (n == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  scratch->resize(n);
  float* s = scratch->data();
  float mx = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n_rows; ++i) {
    s[i] = Dot(q, k_rows[i], d) * scale;
    mx = std::max(mx, s[i]);
  }
  for (int64_t t = 0; t < n_tail; ++t) {
    float& si = s[n_rows + static_cast<size_t>(t)];
    si = Dot(q, tail_k + t * d, d) * scale;
    mx = std::max(mx, si);
  }
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (size_t i = 0; i < n_rows; ++i) {
    const float p = s[i] * inv;
    const float* v = v_rows[i];
    for (int j = 0; j < d; ++j) out[j] += p * v[j];
  }
  for (int64_t t = 0; t < n_tail; ++t) {
    const float p = s[n_rows + static_cast<size_t>(t)] * inv;
    const float* v = tail_v + t * d;
    for (int j = 0; j < d; ++j) out[j] += p * v[j];
  }
}

}  // namespace ctxcache::session
