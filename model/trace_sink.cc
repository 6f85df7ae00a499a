#include "model/trace_sink.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace ctxcache::model {

Status TraceSink::OnBegin(const ModelSpec& spec, int64_t pos0, int64_t n_tokens) {
  trace_.n_layers_total = spec.n_layers;
  trace_.n_q_heads = spec.n_q_heads;
  trace_.n_kv_heads = spec.n_kv_heads;
  trace_.head_dim = spec.head_dim;
  trace_.rope_theta = spec.rope.theta;
  if (trace_.model_fingerprint.empty()) trace_.model_fingerprint = spec.fingerprint;
  trace_.layers = options_.layers;
  if (trace_.layers.empty()) {
    trace_.layers.resize(spec.n_layers);
    std::iota(trace_.layers.begin(), trace_.layers.end(), 0);
  }
  trace_.kv_heads = options_.kv_heads;
  if (trace_.kv_heads.empty()) {
    trace_.kv_heads.resize(spec.n_kv_heads);
    std::iota(trace_.kv_heads.begin(), trace_.kv_heads.end(), 0);
  }
  std::sort(trace_.layers.begin(), trace_.layers.end());
  std::sort(trace_.kv_heads.begin(), trace_.kv_heads.end());
  for (int l : trace_.layers) {
    if (l < 0 || l >= spec.n_layers) {
      return InvalidArgumentError("trace sink: layer " + std::to_string(l) + " outside [0, " +
                                  std::to_string(spec.n_layers) + ")");
    }
  }
  for (int h : trace_.kv_heads) {
    if (h < 0 || h >= spec.n_kv_heads) {
      return InvalidArgumentError("trace sink: kv head " + std::to_string(h) + " outside [0, " +
                                  std::to_string(spec.n_kv_heads) + ")");
    }
  }
  pos0_ = pos0;
  n_ = n_tokens;
  q_first_ = options_.q_last > 0 ? std::max<int64_t>(0, n_tokens - options_.q_last) : 0;
  trace_.q_positions.resize(n_tokens - q_first_);
  std::iota(trace_.q_positions.begin(), trace_.q_positions.end(), q_first_);
  const size_t L = trace_.layers.size();
  const int d = spec.head_dim;
  trace_.q.assign(L, std::vector<float>(static_cast<size_t>(trace_.n_stored_q_heads()) *
                                        trace_.q_positions.size() * d));
  trace_.k.assign(L,
                  std::vector<float>(static_cast<size_t>(trace_.kv_heads.size()) * n_tokens * d));
  trace_.v.assign(L,
                  std::vector<float>(static_cast<size_t>(trace_.kv_heads.size()) * n_tokens * d));
  return Status::OK();
}

Status TraceSink::OnChunk(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                          const float* v) {
  const int slot = trace_.LayerSlot(layer);
  if (slot < 0) return Status::OK();
  const int d = trace_.head_dim, G = trace_.group_size();
  const int64_t t0 = pos0 - pos0_;  // index within the traced tokens
  const int64_t R = trace_.n_q_rows();
  for (size_t hs = 0; hs < trace_.kv_heads.size(); ++hs) {
    const int g = trace_.kv_heads[hs];
    std::copy_n(k + (int64_t{g} * n) * d, n * d, trace_.k[slot].data() + (hs * n_ + t0) * d);
    std::copy_n(v + (int64_t{g} * n) * d, n * d, trace_.v[slot].data() + (hs * n_ + t0) * d);
    for (int i = 0; i < G; ++i) {
      const int h = g * G + i;
      const int64_t qs = static_cast<int64_t>(hs) * G + i;
      for (int64_t t = std::max<int64_t>(0, q_first_ - t0); t < n; ++t) {
        const int64_t row = t0 + t - q_first_;
        std::copy_n(q + (int64_t{h} * n + t) * d, d, trace_.q[slot].data() + (qs * R + row) * d);
      }
    }
  }
  return Status::OK();
}

}  // namespace ctxcache::model
