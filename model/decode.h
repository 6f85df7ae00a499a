// Decode step: one token through all layers, with an AttentionProvider per
// layer deciding which keys the new token attends to.
//
//   FullAttention   — appends the token's K/V to a local KvCache and attends
//                     over all of it (the dense reference).
//   SparseAttention — the sparse decode-session core (session/): per
//                     (layer, kv head) a Selector picks tokens, the page cap
//                     and block-union page tables pick the pages, a
//                     PageFetcher supplies them, and attention runs over the
//                     selected tokens plus every token appended during decode
//                     (always attended, as Tactic does for fresh tokens). New
//                     keys are streamed into the selectors.
//
// Thread-safety: providers hold per-session state and are not safe for
// concurrent use; use one per session. DecodeStep is reentrant.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "index/selector.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "session/attention.h"
#include "session/page_fetcher.h"
#include "session/sparse_session.h"

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
  AlignedFloats kbuf_, vbuf_, scores_;
};

// A session::PageFetcher over a KvCache (not owned), e.g. the prefill's: the
// embedded implementation of the pages a decode session fetches. The stored
// context is the cache's first n_tokens() tokens, frozen at construction.
class KvCachePageFetcher final : public session::PageFetcher {
 public:
  KvCachePageFetcher(const KvCache* cache, int page_size)
      : cache_(cache), page_size_(page_size), n_(cache->n_tokens()) {}
  int64_t n_tokens() const { return n_; }
  Status Fetch(int layer, int kv_head, std::span<const uint32_t> blocks,
               session::PageMap* out) override;

 private:
  const KvCache* cache_;
  int page_size_;
  int64_t n_;
};

struct SparseAttentionOptions {
  // Session params as a decode session takes them (session/session_params.h:
  // rho, budget, page_fraction, whole_pages, subgroup, recent_blocks,
  // estimate_mass).
  // Default: empty (each param's own default).
  std::map<std::string, std::string> params;
  // Tokens per page (B); must match the fetcher's. Default: 16.
  int page_size = 16;
};

// Counters accumulated over all Attend calls.
struct SparseAttentionStats {
  uint64_t steps = 0;           // Attend calls (layer-steps)
  uint64_t context_tokens = 0;  // context tokens attended, summed over q heads
  uint64_t fetched_tokens = 0;  // stored tokens of the pages fetched, summed over kv heads
  uint64_t fetched_pages = 0;   // pages with stored tokens fetched, summed over kv heads
  index::WorkStats work;        // from the selectors
};

// Embedded sparse decode: the session core (session/sparse_session.h) over a
// PageFetcher, attending each q head's pages plus every decoded token
// (session/attention.h), exactly as a ctxcached session and the reference
// worker do.
class SparseAttention final : public AttentionProvider {
 public:
  // selectors[layer][kv_head], not owned, one method; each must cover
  // exactly n_context tokens at construction. pages: not owned.
  static StatusOr<std::unique_ptr<SparseAttention>> Create(
      const ModelSpec& spec, std::vector<std::vector<index::Selector*>> selectors,
      session::PageFetcher* pages, int64_t n_context, const SparseAttentionOptions& options);
  Status Attend(int layer, int64_t pos, const float* q, const float* k, const float* v,
                float* out) override;
  const SparseAttentionStats& stats() const { return stats_; }
  // The HeadStep of each kv head of the last Attend of `layer`.
  const std::vector<session::HeadStep>& last_steps(int layer) const { return last_[layer]; }

 private:
  SparseAttention(const ModelSpec& spec, std::unique_ptr<session::SparseSession> session);
  const ModelSpec& spec_;
  std::unique_ptr<session::SparseSession> session_;
  std::vector<std::vector<session::HeadStep>> last_;  // [layer][kv_head]
  std::vector<session::PageMap> pages_;               // [kv_head], reused per step
  session::AttendScratch attend_;
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
