// A LLaMA-family model loaded from an HF model directory: config.json plus
// model.safetensors or a sharded model.safetensors.index.json, with weights in
// bf16, fp16 or fp32.
//
// Architectures: LlamaForCausalLM (incl. rope_scaling type "llama3" and
// optional attention_bias), MistralForCausalLM (sliding_window honoured),
// Qwen2ForCausalLM (q/k/v bias); tied or untied embeddings (SmolLM is Llama
// with tied embeddings).
//
// Weights are converted to fp32 at load: resident memory is 4 bytes per
// parameter (e.g. ~80 MB for a 20M-parameter model); the mmap of the
// safetensors files is released once loading finishes. All compute is fp32.
//
// ModelSpec::fingerprint is SHA-256 over a version tag, the canonical dump of
// config.json (keys sorted, no whitespace) and every tensor's name, dtype,
// shape and raw bytes in name order. Two KV caches are compatible iff the
// fingerprints are equal.
//
// Thread-safety: a loaded Model is immutable and safe for concurrent use.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "index/eigen_blocking.h"

namespace ctxcache::model {

// Float buffers that Eigen expressions write, aligned for its packets. An
// elementwise Eigen expression over an unaligned Map computes its first
// elements with the scalar functions (std::exp) and the rest with the packet
// ones (a different exp), so with plain std::vector storage the results
// would depend on where the heap put the buffer: the same text prefilled
// twice stored different KV (SiLU in the MLP), and decode's softmax varied.
using AlignedFloats = std::vector<float, Eigen::aligned_allocator<float>>;

struct RopeParams {
  double theta = 10000.0;        // rope_theta
  std::string type = "default";  // "default" or "llama3"
  // llama3 scaling (rope_scaling); unused for "default".
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelSpec {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  int n_layers = 0;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int hidden = 0;
  int intermediate = 0;
  int vocab = 0;
  double rms_norm_eps = 1e-6;
  RopeParams rope;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;       // q/k/v projections carry a bias (Qwen2; Llama attention_bias)
  bool o_bias = false;         // o_proj carries a bias (Llama attention_bias)
  int64_t sliding_window = 0;  // 0 = none; else key j visible from i iff i - j < sliding_window
  int64_t max_position_embeddings = 0;
  DType weight_dtype = DType::kF32;  // dtype of the weights on disk
  std::string fingerprint;           // 64 hex chars, see file comment

  int group_size() const { return n_q_heads / n_kv_heads; }
  // KV bytes per token for all layers at `dtype`.
  int64_t KvBytesPerToken(DType dtype) const {
    return int64_t{2} * n_layers * n_kv_heads * head_dim * static_cast<int64_t>(DTypeSize(dtype));
  }
};

// Parses config.json text into a spec (fingerprint and weight_dtype left
// empty). InvalidArgument naming the field on bad JSON, a missing or
// mistyped field, an inconsistent head layout or an unsupported architecture,
// hidden_act or rope type.
StatusOr<ModelSpec> ParseModelConfig(const std::string& json_text);

// Per-layer weights, fp32, row-major [out][in] as in HF.
struct LayerWeights {
  std::vector<float> attn_norm;       // [hidden]
  std::vector<float> wq, wk, wv, wo;  // [nq*d][hidden], [nkv*d][hidden] x2, [hidden][nq*d]
  std::vector<float> bq, bk, bv, bo;  // empty unless qkv_bias / o_bias
  std::vector<float> mlp_norm;        // [hidden]
  std::vector<float> w_gate, w_up;    // [intermediate][hidden]
  std::vector<float> w_down;          // [hidden][intermediate]
};

struct LoadOptions {
  // Compute ModelSpec::fingerprint (SHA-256 over all weight bytes).
  // Default: true.
  bool compute_fingerprint = true;
  // Threads for the forward pass; nullptr = ThreadPool::Default(). Not owned;
  // must outlive the Model.
  ThreadPool* pool = nullptr;
};

class Model {
 public:
  // Loads `dir`. NotFound for a missing config.json or weights; DataLoss for a
  // truncated or corrupt file; InvalidArgument naming the tensor for a
  // missing tensor or shape mismatch, or the field for config problems.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir,
                                               const LoadOptions& options = {});

  const ModelSpec& spec() const { return spec_; }
  const LayerWeights& layer(int i) const { return layers_[i]; }
  const float* embed() const { return embed_.data(); }            // [vocab][hidden]
  const float* final_norm() const { return final_norm_.data(); }  // [hidden]
  const float* lm_head() const {                                  // [vocab][hidden]
    return spec_.tie_word_embeddings ? embed_.data() : lm_head_.data();
  }
  // RoPE inverse frequencies [head_dim/2], computed as HF does in fp32
  // (incl. _compute_llama3_parameters).
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  ThreadPool* pool() const { return pool_; }
  // Resident bytes of the fp32 weights.
  uint64_t WeightBytes() const;

 private:
  Model() = default;
  ModelSpec spec_;
  std::vector<LayerWeights> layers_;
  std::vector<float> embed_, final_norm_, lm_head_;
  std::vector<float> inv_freq_;
  ThreadPool* pool_ = nullptr;
};

// RoPE inverse frequencies for `rope` and `head_dim` (fp32, HF semantics).
std::vector<float> ComputeInvFreq(const RopeParams& rope, int head_dim);

}  // namespace ctxcache::model
