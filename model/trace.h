// .ctxtrace: token ids plus the post-RoPE Q, K and V of chosen layers and kv
// heads from one prefill, for the fidelity harness and the index benchmarks
// (`ctxcache-bench index --trace FILE`). The on-disk layout is documented in
// docs/trace-format.md (magic "CTXTRACE", format version 1, JSON header,
// little-endian payload in f32 or bf16, crc32c trailer).
//
// In memory a Trace always holds fp32. Stored heads: `kv_heads` lists the kv
// heads kept (ascending); for each kept kv head h, the q heads of its GQA
// group (h*G .. h*G+G-1, G = n_q_heads / n_kv_heads) are kept, in that order.
// Stored query rows: `q_positions` lists the token positions whose queries
// are kept (ascending); it equals 0..T-1 when all queries are kept.
//
// Array layout, per stored layer slot s (layers[s] is the model layer):
//   q[s]: [n_stored_q_heads][n_q_rows][head_dim]   (row-major)
//   k[s]: [n_stored_kv_heads][T][head_dim]
//   v[s]: [n_stored_kv_heads][T][head_dim]
//
// Thread-safety: Trace is a plain value; ReadTrace/WriteTrace are reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace ctxcache::model {

inline constexpr uint32_t kTraceFormatVersion = 1;

struct Trace {
  std::vector<int32_t> tokens;    // T token ids
  int n_layers_total = 0;         // layers in the model
  int n_q_heads = 0;              // q heads in the model
  int n_kv_heads = 0;             // kv heads in the model
  int head_dim = 0;               // d
  double rope_theta = 0.0;        // informational
  std::string model_fingerprint;  // ModelSpec::fingerprint (hex); may be empty

  std::vector<int> layers;           // stored model layers, ascending
  std::vector<int> kv_heads;         // stored kv heads, ascending
  std::vector<int64_t> q_positions;  // stored query positions, ascending

  // One entry per stored layer slot; layouts in the file comment.
  std::vector<std::vector<float>> q;
  std::vector<std::vector<float>> k;
  std::vector<std::vector<float>> v;

  int64_t n_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int group_size() const { return n_kv_heads > 0 ? n_q_heads / n_kv_heads : 0; }
  int n_stored_kv_heads() const { return static_cast<int>(kv_heads.size()); }
  int n_stored_q_heads() const { return n_stored_kv_heads() * group_size(); }
  int64_t n_q_rows() const { return static_cast<int64_t>(q_positions.size()); }

  // Slot of a model layer in `layers`, or -1 if not stored.
  int LayerSlot(int layer) const;
  // Slot of a model kv head in `kv_heads`, or -1 if not stored.
  int KvHeadSlot(int kv_head) const;

  // Pointers into the arrays: queries of stored q head `q_slot` (n_q_rows x d),
  // keys / values of stored kv head `kv_slot` (T x d). Slots are not checked.
  const float* Q(int layer_slot, int q_slot) const {
    return q[layer_slot].data() + static_cast<size_t>(q_slot) * n_q_rows() * head_dim;
  }
  const float* K(int layer_slot, int kv_slot) const {
    return k[layer_slot].data() + static_cast<size_t>(kv_slot) * n_tokens() * head_dim;
  }
  const float* V(int layer_slot, int kv_slot) const {
    return v[layer_slot].data() + static_cast<size_t>(kv_slot) * n_tokens() * head_dim;
  }

  // Checks dims, slot lists and array sizes; InvalidArgument naming the field.
  Status Validate() const;
};

// Writes `trace` to `path`, storing the tensors as `dtype` (kF32 or kBF16;
// kF16 is accepted too). Overwrites an existing file (written to path.tmp,
// then renamed).
Status WriteTrace(const std::string& path, const Trace& trace, DType dtype = DType::kBF16);

// Reads a trace written by WriteTrace. NotFound if the file is missing;
// DataLoss on bad magic, truncation or checksum mismatch; InvalidArgument on
// an unsupported version or inconsistent header.
StatusOr<Trace> ReadTrace(const std::string& path);

}  // namespace ctxcache::model
