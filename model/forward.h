// Internal building blocks of the forward pass, shared by prefill and decode.
// Activations are token-major row-major fp32: x[n][width].
//
// Thread-safety: functions are reentrant; they use the model's thread pool.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/status.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace ctxcache::model::internal {

// y[n][out] = x[n][in] * W[out][in]^T (+ bias[out]); parallel over output
// column blocks when the product is large enough.
void Linear(ThreadPool* pool, const float* x, int64_t n, int64_t in, const float* w, int64_t out,
            const float* bias, float* y);

// y[n][h] = x / sqrt(mean(x^2) + eps) * w (HF LlamaRMSNorm, fp32).
void RmsNorm(const float* x, int64_t n, int64_t h, const float* w, double eps, float* y);

// Rotates heads in place: x[n][n_heads][d] (row stride `stride` floats),
// token t at position pos0 + t. HF rotate_half convention, fp32 angles.
void ApplyRope(const std::vector<float>& inv_freq, int64_t pos0, int64_t n, int n_heads, int d,
               int64_t stride, float* x);

// Embedding rows for tokens; InvalidArgument naming position and id when an
// id is outside [0, vocab).
Status Embed(const Model& m, const int32_t* tokens, int64_t n, int64_t pos0, float* x);

// Attention callback for one layer: given q[n][nq*d], k[n][nkv*d], v[n][nkv*d]
// (post-RoPE) of tokens pos0..pos0+n-1, writes out[n][nq*d].
using AttentionFn = std::function<Status(int layer, int64_t pos0, int64_t n, const float* q,
                                         const float* k, const float* v, float* out)>;

// Scratch buffers reused across layers and calls, aligned for Eigen's
// packets (AlignedFloats, model.h).
struct Workspace {
  AlignedFloats norm, q, k, v, attn, proj, gate, up;
  void Resize(const ModelSpec& s, int64_t n);
};

// One transformer layer over n tokens in place on x[n][hidden]. After the
// Q/K/V projections and RoPE, `attention` produces the attention output;
// `on_qkv` (optional) sees q/k/v first.
Status LayerForward(const Model& m, int layer, int64_t pos0, int64_t n, float* x, Workspace* ws,
                    const AttentionFn& attention);

// Final norm + lm_head for rows[0..n_rows) of x (row indexes into x);
// logits[n_rows][vocab].
void Logits(const Model& m, const float* x, const std::vector<int64_t>& rows, float* logits);

// Causal attention of one chunk of n tokens (positions L-n .. L-1) over the
// keys/values 0..L-1 of `layer` in `cache` (which already holds the chunk).
// Token t sees keys j <= L-n+t and, with sliding_window w > 0, j > L-n+t-w.
// q: [n][q_stride] (head h at q + h*d); out: same layout.
//
// Flash-style: keys are processed in tiles of kAttentionTile tokens with an
// online softmax, so per worker thread only one n x tile score block and
// one tile of fp32 K/V (converted from the cache dtype) are live; nothing
// grows with L except the cache itself.
inline constexpr int64_t kAttentionTile = 1024;
void ChunkAttention(ThreadPool* pool, const ModelSpec& s, const KvCache& cache, int layer,
                    int64_t n, int64_t L, const float* q, int64_t q_stride, float* out);

}  // namespace ctxcache::model::internal
