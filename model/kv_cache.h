// KvCache: the local K/V of one sequence, per (layer, kv head), stored
// head-major ([layer][kv_head][token][d]) in bf16 (default), fp16 or fp32.
//
// Memory: exactly KvBytesPerToken(dtype) * capacity bytes, i.e. the context's
// KV size at the storage dtype (bf16 halves it vs fp32). Attention reads a
// (layer, kv head) range back as fp32 into caller scratch.
//
// Each layer has its own length so a forward pass can append layer by layer;
// after a complete prefill or decode step all layers have the same length.
// Thread-safety: concurrent reads are safe; Append on a layer must not race
// with other access to the same layer.
#pragma once

#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "model/model.h"

namespace ctxcache::model {

class KvCache {
 public:
  KvCache(int n_layers, int n_kv_heads, int head_dim, DType dtype = DType::kBF16);
  KvCache(const ModelSpec& spec, DType dtype = DType::kBF16)
      : KvCache(spec.n_layers, spec.n_kv_heads, spec.head_dim, dtype) {}

  int n_layers() const { return n_layers_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  DType dtype() const { return dtype_; }
  // Tokens stored for `layer`.
  int64_t n_tokens(int layer) const { return len_[layer]; }
  // Tokens stored in every layer (the minimum over layers).
  int64_t n_tokens() const;

  // Reserves room for `n_tokens` tokens per (layer, head) (avoids regrowth).
  void Reserve(int64_t n_tokens);

  // Appends n tokens to `layer`. k and v are token-major fp32:
  // [n][n_kv_heads][d] with row stride `row_stride` floats between tokens
  // (n_kv_heads * d when packed).
  void Append(int layer, int n, const float* k, const float* v, int64_t row_stride);

  // Copies tokens [begin, end) of (layer, head) as fp32 to k_out / v_out
  // ((end-begin) * d floats each); either may be null.
  void Read(int layer, int kv_head, int64_t begin, int64_t end, float* k_out, float* v_out) const;
  // Gathers tokens ids[0..n) (each < n_tokens(layer)) as fp32.
  void Gather(int layer, int kv_head, const int32_t* ids, int64_t n, float* k_out,
              float* v_out) const;
  // Direct fp32 pointers (only when dtype() == kF32): [n_tokens][d].
  const float* KeysF32(int layer, int kv_head) const;
  const float* ValuesF32(int layer, int kv_head) const;

  // Drops tokens >= n_tokens from every layer.
  void Truncate(int64_t n_tokens);

  // Bytes held (capacity).
  uint64_t MemoryBytes() const;

 private:
  size_t Slot(int layer, int head) const { return static_cast<size_t>(layer) * n_kv_heads_ + head; }
  void ReadRows(const std::vector<uint8_t>& buf, int64_t row, int64_t n, float* out) const;
  int n_layers_, n_kv_heads_, head_dim_;
  DType dtype_;
  size_t elem_;
  std::vector<int64_t> len_;                 // per layer
  std::vector<std::vector<uint8_t>> k_, v_;  // per (layer, head)
};

}  // namespace ctxcache::model
