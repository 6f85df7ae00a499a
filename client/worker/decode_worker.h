// The reference decode worker: runs the embedded model's decode loop on the
// worker side while attention over the stored context goes through a
// ctxcached session (server- or client-side selection, pages on demand).
// The prompt and every generated token are appended to the session
// (streaming updates), and their K/V is also kept locally and always
// attended (the "tail").
//
// Speculative prefetch (client mode, SessionOptions::prefetch, methods that
// select by query): the attention input of layer l+1 is close to that of
// layer l (the residual stream changes little per layer; InfiniGen, OSDI
// '24). So before layer l runs, OnLayerInput computes a speculative query
// for layer l+1 from layer l's input hidden state (model::LayerQueries:
// layer l+1's attention RMSNorm, Wq, RoPE at the current position) and
// calls DecodeSession::Prefetch(l+1, q_spec); the SDK selects and fetches
// layer l+1's pages on its background thread while layer l computes. Layer
// 0 is never prefetched. Streaming and full need no speculation (the SDK
// prefetches layer l+1 from Step(l) itself). Results are identical with or
// without prefetch; only where the pages come from changes.
//
// This is the template for integrating a real serving engine: replace
// model::DecodeStep with the engine's layer loop and RemoteAttention with
// its attention kernel fed from SelectedKV.
//
// Thread-safety: one RemoteAttention / Generate call per session; not safe
// for concurrent use.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ctxcache/client.h"
#include "model/decode.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "session/attention.h"

namespace ctxcache::client {

// AttentionProvider whose context part comes from a DecodeSession.
class RemoteAttention final : public model::AttentionProvider {
 public:
  // n_context: tokens stored in the context (positions [0, n_context)).
  // speculate_with: the model whose weights give the speculative next-layer
  // queries for DecodeSession::Prefetch (not owned); null = no speculation.
  RemoteAttention(const model::ModelSpec& spec, DecodeSession* session, int64_t n_context,
                  const model::Model* speculate_with = nullptr);

  Status Attend(int layer, int64_t pos, const float* q, const float* k, const float* v,
                float* out) override;
  // With speculate_with: Prefetch(layer + 1, speculative queries).
  Status OnLayerInput(int layer, int64_t pos, const float* hidden) override;

  // Sends the last token's K/V/Q of every layer to the server (call after
  // each DecodeStep).
  Status FlushAppend();

  uint64_t bytes_received() const { return bytes_received_; }
  uint64_t context_tokens_attended() const { return context_tokens_; }
  // Distinct context pages (of the context's block_tokens) among the rows
  // the session returned, summed over every (layer, kv head) step: what a
  // page-granular fetch of the same selections reads.
  uint64_t context_pages_touched() const { return context_pages_; }
  // What the session returned for the last Attend of `layer`.
  const SelectedKV& last_selected(int layer) const { return last_[layer]; }

 private:
  const model::ModelSpec& spec_;
  DecodeSession* session_;
  int64_t n_context_;
  const model::Model* speculate_with_;
  std::vector<float> spec_q_;     // [n_q_heads][d]
  std::vector<float> spec_norm_;  // LayerQueries scratch [hidden]
  // Local tail K/V per [layer][kv head]: [n_tail][d].
  std::vector<std::vector<std::vector<float>>> tail_k_, tail_v_;
  // The pending token's K/V/Q, [layer][heads][d].
  std::vector<float> pend_k_, pend_v_, pend_q_;
  std::vector<SelectedKV> last_;            // [layer]
  session::AttendScratch attend_;
  uint64_t bytes_received_ = 0;
  uint64_t context_tokens_ = 0;
  uint64_t context_pages_ = 0;
};

struct GenerateOptions {
  SessionOptions session;
  int max_new_tokens = 64;
  // If non-empty, teacher forcing: feed these tokens instead of the argmax
  // (used to compare with a dense run on the same sequence).
  std::vector<int32_t> forced_tokens;
  // Keep the logits of each generated position (vocab floats each).
  bool keep_logits = false;
};

struct GenerateResult {
  std::vector<int32_t> tokens;             // generated (or forced) tokens
  std::vector<int32_t> argmax;             // the model's argmax at each position
  std::vector<std::vector<float>> logits;  // with keep_logits
  std::vector<double> step_seconds;        // wall time per decoded token
  uint64_t bytes_received = 0;             // page payload bytes over all steps
  int64_t steps = 0;                       // token steps (prompt + generated)
  // GenerateRemote: context tokens attended, summed over every q head of
  // every layer of every step (what the session selected; 0 for dense).
  uint64_t context_tokens_attended = 0;
  // GenerateRemote: distinct context pages among the selected rows, summed
  // over every (layer, kv head) step.
  uint64_t context_pages_touched = 0;
  PageCacheStats page_cache;               // GenerateRemote: the session's, at the end
};

// Sparse decode through a session: feeds `prompt` after the context, then
// greedily generates max_new_tokens tokens. In client mode with
// options.session.prefetch, speculative prefetch runs as described above.
StatusOr<GenerateResult> GenerateRemote(const model::Model& model, Client* client,
                                        const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options);

// Dense reference: fetches the whole context's KV once (FetchPages) into a
// local cache and decodes with full attention. Also returns the page bytes
// a dense worker would fetch per token step (all pages of all layers).
StatusOr<GenerateResult> GenerateDense(const model::Model& model, Client* client,
                                       const std::string& context_id,
                                       const std::vector<int32_t>& prompt,
                                       const GenerateOptions& options,
                                       uint64_t* dense_bytes_per_step);

// Fetches every stored page of the context `info` (FetchPages) into `cache`
// (empty, shaped like the context's model), as stored: what a dense worker
// holds. *bytes (may be null): page payload bytes received.
Status FetchContextKv(Client* client, const v1::ContextInfo& info, model::KvCache* cache,
                      uint64_t* bytes);

// Mean KL(p || q) over positions of the softmax of two logit sequences.
double MeanKl(const std::vector<std::vector<float>>& p, const std::vector<std::vector<float>>& q);

}  // namespace ctxcache::client
