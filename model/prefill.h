// Chunked prefill: runs token ids through the model chunk by chunk (default
// 512 tokens). Each chunk attends causally to every earlier token (held in a
// KvCache) plus itself. Per chunk and layer the post-RoPE Q, K and V go to the
// registered sinks (page writer, index builders, trace writer).
//
// Memory: the KvCache (the context's KV at its dtype; bf16 by default, so
// exactly 1x the context's bf16 KV size) plus per-chunk activations plus, per
// worker thread, one chunk x 1024 score tile and one 1024-token fp32 K/V tile
// (flash-style attention, see internal::ChunkAttention). Nothing but the
// cache grows with the context.
//
// Extend: if the cache already holds P tokens (a parent context), the new
// tokens are placed at positions P.. and attend to the parent's KV.
//
// Thread-safety: Prefill may run concurrently on distinct caches; sinks are
// called from the calling thread only, in order (chunk-major, layer-minor).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace ctxcache::model {

// Receives per-chunk, per-layer post-RoPE Q/K/V (fp32, head-major).
class PrefillSink {
 public:
  virtual ~PrefillSink() = default;
  // Before the first chunk: tokens [pos0, pos0 + n_tokens) will be prefilled.
  virtual Status OnBegin(const ModelSpec& spec, int64_t pos0, int64_t n_tokens) {
    (void)spec, (void)pos0, (void)n_tokens;
    return Status::OK();
  }
  // q: [n_q_heads][n][d], k and v: [n_kv_heads][n][d], for tokens
  // pos0..pos0+n-1 of `layer`. Valid only during the call.
  virtual Status OnChunk(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                         const float* v) = 0;
  // All chunks of `layer` have been delivered. Chunks are processed
  // chunk-major, so this is called for every layer (in order) after the last
  // chunk.
  virtual Status OnLayerDone(int layer) {
    (void)layer;
    return Status::OK();
  }
  // After the last OnLayerDone.
  virtual Status OnEnd() { return Status::OK(); }
};

struct PrefillProgress {
  int64_t tokens_done = 0;   // tokens fully through all layers
  int64_t tokens_total = 0;  // tokens in this prefill
  int layer = 0;             // layer just finished for the current chunk
  int n_layers = 0;
};

struct PrefillOptions {
  // Tokens per chunk. Default: 512.
  int chunk_size = 512;
  enum class LogitsMode { kNone, kLast, kAll, kPositions };
  // Which logits to compute. Default: the last token's.
  LogitsMode logits = LogitsMode::kLast;
  // kPositions: absolute positions (within the new tokens' range), any order.
  std::vector<int64_t> logit_positions;
  // Called after each (chunk, layer); may be empty.
  std::function<void(const PrefillProgress&)> progress;
  // Checked after each (chunk, layer); when set (true) Prefill returns
  // CANCELLED. The KvCache then holds a partial prefix (Truncate it).
  const std::atomic<bool>* cancel = nullptr;
};

struct PrefillResult {
  std::vector<int64_t> logit_positions;  // absolute positions of the logits rows
  std::vector<float> logits;             // [logit_positions.size()][vocab]
  double seconds = 0;                    // wall time of the prefill
};

// Prefills `tokens` at positions cache->n_tokens().. and appends their KV to
// `cache` (whose layout must match the model). InvalidArgument for an empty
// input, bad token id, bad chunk size or logit position; CANCELLED when
// cancelled; a sink's error is returned as is.
Status Prefill(const Model& model, std::span<const int32_t> tokens, KvCache* cache,
               const std::vector<PrefillSink*>& sinks, const PrefillOptions& options,
               PrefillResult* result);

}  // namespace ctxcache::model
