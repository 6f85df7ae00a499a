// Decode step: one token through all layers, with an AttentionProvider per
// layer deciding which keys the new token attends to.
//
//   FullAttention   — appends the token's K/V to a local KvCache and attends
//                     over all of it (the dense reference).
//   SparseAttention — per (layer, kv head) an index::Selector picks context
//                     tokens, a PageSource supplies their K/V, and attention
//                     runs over those plus every token appended during decode
//                     (kept locally, always attended, as Tactic does for
//                     fresh tokens). New keys are streamed into the selectors
//                     (Selector::Append).
//
// Thread-safety: providers hold per-session state and are not safe for
// concurrent use; use one per session. DecodeStep is reentrant.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "common/status.h"
#include "index/selector.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace ctxcache::model {

class AttentionProvider {
 public:
  virtual ~AttentionProvider() = default;
  // The token at position `pos` in `layer`: q [n_q_heads][d], k and v
  // [n_kv_heads][d] (post-RoPE). Must make the token's own K/V visible to
  // itself and to later steps. Writes out [n_q_heads][d].
  virtual Status Attend(int layer, int64_t pos, const float* q, const float* k, const float* v,
                        float* out) = 0;
  // Called by DecodeStep before `layer` runs, with the layer's input hidden
  // state (the residual stream, [hidden], before the attention norm) of the
  // token at `pos`; e.g. to speculate on the next layer's queries and
  // prefetch its KV while this layer computes. An error fails the step.
  // Default: does nothing.
  virtual Status OnLayerInput(int layer, int64_t pos, const float* hidden) {
    (void)layer;
    (void)pos;
    (void)hidden;
    return Status::OK();
  }
};

// Dense attention over a local KvCache (not owned; typically the cache a
// Prefill filled). Honours the model's sliding window.
class FullAttention final : public AttentionProvider {
 public:
  FullAttention(const ModelSpec& spec, KvCache* cache) : spec_(spec), cache_(cache) {}
  Status Attend(int layer, int64_t pos, const float* q, const float* k, const float* v,
                float* out) override;

 private:
  const ModelSpec& spec_;
  KvCache* cache_;
  std::vector<float> kbuf_, vbuf_, scores_;
};

// Supplies K/V of context tokens, e.g. from stored KV pages.
class PageSource {
 public:
  virtual ~PageSource() = default;
  // Tokens available: ids must lie in [0, n_tokens()).
  virtual int64_t n_tokens() const = 0;
  // Writes K and V (n * d floats each; either may be null) of tokens
  // ids[0..n) of (layer, kv_head). ids are sorted ascending.
  virtual Status GetKV(int layer, int kv_head, const int32_t* ids, int64_t n, float* k_out,
                       float* v_out) = 0;
};

// A PageSource over a KvCache (not owned), e.g. the prefill's.
class KvCachePageSource final : public PageSource {
 public:
  explicit KvCachePageSource(const KvCache* cache) : cache_(cache), n_(cache->n_tokens()) {}
  int64_t n_tokens() const override { return n_; }
  Status GetKV(int layer, int kv_head, const int32_t* ids, int64_t n, float* k_out,
               float* v_out) override;

 private:
  const KvCache* cache_;
  int64_t n_;  // frozen at construction
};

struct SparseAttentionOptions {
  // Tokens per q head passed to Select (0 = the method's default budget).
  // Default: 0.
  int64_t budget = 0;
  // Stream each new key into the selectors (Selector::Append). Default: true.
  bool append_to_selectors = true;
};

// Counters accumulated over all Attend calls.
struct SparseAttentionStats {
  uint64_t steps = 0;           // Attend calls (layer-steps)
  uint64_t context_tokens = 0;  // context tokens attended, summed over q heads
  uint64_t fetched_tokens = 0;  // tokens fetched from the PageSource (merged per kv head)
  index::WorkStats work;        // from the selectors
};

class SparseAttention final : public AttentionProvider {
 public:
  // selectors[layer][kv_head], not owned; each must cover exactly
  // pages->n_tokens() tokens at construction. pages not owned.
  static StatusOr<std::unique_ptr<SparseAttention>> Create(
      const ModelSpec& spec, std::vector<std::vector<index::Selector*>> selectors,
      PageSource* pages, const SparseAttentionOptions& options);
  Status Attend(int layer, int64_t pos, const float* q, const float* k, const float* v,
                float* out) override;
  const SparseAttentionStats& stats() const { return stats_; }

 private:
  class TailKeySource;
  SparseAttention(const ModelSpec& spec, std::vector<std::vector<index::Selector*>> selectors,
                  PageSource* pages, const SparseAttentionOptions& options);
  const ModelSpec& spec_;
  std::vector<std::vector<index::Selector*>> selectors_;
  PageSource* pages_;
  SparseAttentionOptions options_;
  int64_t n_context_;
  // Keys/values appended during decode: [layer][kv_head] -> [n_tail][d].
  std::vector<std::vector<std::vector<float>>> tail_k_, tail_v_;
  SparseAttentionStats stats_;
};

// Runs `token` at position `pos` through all layers. `providers` has one
// entry per layer, or a single entry used for every layer. Writes
// logits (vocab floats).
Status DecodeStep(const Model& model, int32_t token, int64_t pos,
                  const std::vector<AttentionProvider*>& providers, std::vector<float>* logits);

// The post-RoPE queries [n_q_heads][d] that `layer` would compute at `pos`
// from the input hidden state `hidden` [hidden]: attention RMSNorm with the
// layer's weight, Wq (+ bias), RoPE (the same functions the forward pass
// uses). With the previous layer's input this is the InfiniGen-style
// speculative query used to prefetch the layer's KV. Writes q; `scratch`
// holds the normed input and is reused across calls (no allocation per step
// once sized). InvalidArgument for a layer out of range.
Status LayerQueries(const Model& model, int layer, int64_t pos, const float* hidden, float* q,
                    std::vector<float>* scratch);

struct SamplingOptions {
  // <= 0 means greedy (argmax, lowest id on ties). Default: 0.
  float temperature = 0.0f;
  // Nucleus sampling: smallest set of top tokens with mass >= top_p. Default: 1.
  float top_p = 1.0f;
  // RNG seed (std::mt19937_64). Default: 0.
  uint64_t seed = 0;
};

// Greedy or temperature / top-p sampling; deterministic for a seed.
class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {}
  int32_t Sample(const float* logits, int vocab);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

// Index of the largest logit (lowest on ties).
int32_t Argmax(const float* logits, int vocab);

// Prefills `prompt` into a fresh cache (dtype `kv_dtype`) and decodes
// `n_new` tokens with FullAttention; returns the new tokens.
StatusOr<std::vector<int32_t>> Generate(const Model& model, const std::vector<int32_t>& prompt,
                                        int n_new, const SamplingOptions& sampling,
                                        DType kv_dtype = DType::kBF16);

}  // namespace ctxcache::model
