#include "model/prefill.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "model/forward.h"

namespace ctxcache::model {

namespace {

// [n][heads*d] token-major -> [heads][n][d] head-major.
void ToHeadMajor(const float* x, int64_t n, int heads, int d, float* out) {
  for (int h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(x + (t * heads + h) * d, d, out + (static_cast<int64_t>(h) * n + t) * d);
    }
  }
}

}  // namespace

Status Prefill(const Model& model, std::span<const int32_t> tokens, KvCache* cache,
               const std::vector<PrefillSink*>& sinks, const PrefillOptions& options,
               PrefillResult* result) {
  const auto t_start = std::chrono::steady_clock::now();
  const ModelSpec& s = model.spec();
  if (tokens.empty()) return InvalidArgumentError("prefill: no tokens");
  if (options.chunk_size <= 0) {
    return InvalidArgumentError("prefill: chunk_size must be > 0, got " +
                                std::to_string(options.chunk_size));
  }
  if (cache->n_layers() != s.n_layers || cache->n_kv_heads() != s.n_kv_heads ||
      cache->head_dim() != s.head_dim) {
    return InvalidArgumentError("prefill: KvCache layout does not match the model");
  }
  const int64_t base = cache->n_tokens();
  for (int l = 0; l < s.n_layers; ++l) {
    if (cache->n_tokens(l) != base) {
      return FailedPreconditionError("prefill: KvCache layers have different lengths");
    }
  }
  const int64_t T = static_cast<int64_t>(tokens.size());
  // Logit rows wanted, as absolute positions.
  std::vector<int64_t> want;
  switch (options.logits) {
    case PrefillOptions::LogitsMode::kNone:
      break;
    case PrefillOptions::LogitsMode::kLast:
      want.push_back(base + T - 1);
      break;
    case PrefillOptions::LogitsMode::kAll:
      for (int64_t p = base; p < base + T; ++p) want.push_back(p);
      break;
    case PrefillOptions::LogitsMode::kPositions:
      for (int64_t p : options.logit_positions) {
        if (p < base || p >= base + T) {
          return InvalidArgumentError("prefill: logit position " + std::to_string(p) +
                                      " outside [" + std::to_string(base) + ", " +
                                      std::to_string(base + T) + ")");
        }
        want.push_back(p);
      }
      break;
  }
  result->logit_positions = want;
  result->logits.assign(want.size() * static_cast<size_t>(s.vocab), 0.0f);

  cache->Reserve(base + T);
  for (PrefillSink* sink : sinks) RETURN_IF_ERROR(sink->OnBegin(s, base, T));

  const int d = s.head_dim;
  const int64_t qd = int64_t{s.n_q_heads} * d, kd = int64_t{s.n_kv_heads} * d;
  std::vector<float> x, hq, hk, hv;
  internal::Workspace ws;
  PrefillProgress prog;
  prog.tokens_total = T;
  prog.n_layers = s.n_layers;

  internal::AttentionFn attention = [&](int layer, int64_t pos0, int64_t n, const float* q,
                                        const float* k, const float* v, float* out) -> Status {
    if (!sinks.empty()) {
      hq.resize(n * qd);
      hk.resize(n * kd);
      hv.resize(n * kd);
      ToHeadMajor(q, n, s.n_q_heads, d, hq.data());
      ToHeadMajor(k, n, s.n_kv_heads, d, hk.data());
      ToHeadMajor(v, n, s.n_kv_heads, d, hv.data());
      for (PrefillSink* sink : sinks) {
        RETURN_IF_ERROR(sink->OnChunk(layer, pos0, n, hq.data(), hk.data(), hv.data()));
      }
    }
    // Attention always reads K/V back from the cache, so results do not
    // depend on the chunking even when the cache rounds to bf16.
    cache->Append(layer, static_cast<int>(n), k, v, kd);
    const int64_t L = pos0 + n;
    internal::ChunkAttention(model.pool(), s, *cache, layer, n, L, q, qd, out);
    return Status::OK();
  };

  for (int64_t c0 = 0; c0 < T; c0 += options.chunk_size) {
    const int64_t n = std::min<int64_t>(options.chunk_size, T - c0);
    const int64_t pos0 = base + c0;
    x.resize(n * s.hidden);
    RETURN_IF_ERROR(internal::Embed(model, tokens.data() + c0, n, pos0, x.data()));
    for (int l = 0; l < s.n_layers; ++l) {
      RETURN_IF_ERROR(internal::LayerForward(model, l, pos0, n, x.data(), &ws, attention));
      if (options.cancel != nullptr && options.cancel->load(std::memory_order_relaxed)) {
        return CancelledError("prefill cancelled at position " + std::to_string(pos0) + ", layer " +
                              std::to_string(l));
      }
      if (options.progress) {
        prog.layer = l;
        prog.tokens_done = c0 + (l + 1 == s.n_layers ? n : 0);
        options.progress(prog);
      }
    }
    // Logits for wanted rows in this chunk.
    std::vector<int64_t> rows, slots;
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i] >= pos0 && want[i] < pos0 + n) {
        rows.push_back(want[i] - pos0);
        slots.push_back(static_cast<int64_t>(i));
      }
    }
    if (!rows.empty()) {
      std::vector<float> lg(rows.size() * static_cast<size_t>(s.vocab));
      internal::Logits(model, x.data(), rows, lg.data());
      for (size_t r = 0; r < rows.size(); ++r) {
        std::copy_n(lg.data() + r * s.vocab, s.vocab, result->logits.data() + slots[r] * s.vocab);
      }
    }
  }
  for (int l = 0; l < s.n_layers; ++l) {
    for (PrefillSink* sink : sinks) RETURN_IF_ERROR(sink->OnLayerDone(l));
  }
  for (PrefillSink* sink : sinks) RETURN_IF_ERROR(sink->OnEnd());
  result->seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return Status::OK();
}

}  // namespace ctxcache::model
