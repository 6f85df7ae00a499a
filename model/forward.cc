#include "model/forward.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "index/eigen_blocking.h"

namespace ctxcache::model::internal {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRowMap = Eigen::Map<const RowMat>;
using StridedConstMap = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
using StridedMap = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;

}  // namespace

void Linear(ThreadPool* pool, const float* x, int64_t n, int64_t in, const float* w, int64_t out,
            const float* bias, float* y) {
  ConstRowMap X(x, n, in);
  auto block = [&](size_t c0, size_t c1) {
    const int64_t cols = static_cast<int64_t>(c1 - c0);
    ConstRowMap W(w + c0 * in, cols, in);
    StridedMap Y(y + c0, n, cols, Eigen::OuterStride<>(out));
    Y.noalias() = X * W.transpose();
    if (bias != nullptr) {
      Eigen::Map<const Eigen::RowVectorXf> b(bias + c0, cols);
      Y.rowwise() += b;
    }
  };
  const double flops = 2.0 * static_cast<double>(n) * in * out;
  if (pool == nullptr || pool->size() <= 1 || flops < 4e6) {
    block(0, static_cast<size_t>(out));
    return;
  }
  // Column blocks that are multiples of 16 keep the kernels aligned.
  const size_t parts = pool->size();
  const size_t per = ((static_cast<size_t>(out) + parts - 1) / parts + 15) / 16 * 16;
  const size_t n_blocks = (static_cast<size_t>(out) + per - 1) / per;
  pool->ParallelFor(n_blocks, [&](size_t b0, size_t b1) {
    for (size_t b = b0; b < b1; ++b) {
      block(b * per, std::min(static_cast<size_t>(out), (b + 1) * per));
    }
  });
}

void RmsNorm(const float* x, int64_t n, int64_t h, const float* w, double eps, float* y) {
  Eigen::Map<const Eigen::ArrayXf> wa(w, h);
  for (int64_t t = 0; t < n; ++t) {
    Eigen::Map<const Eigen::ArrayXf> xa(x + t * h, h);
    Eigen::Map<Eigen::ArrayXf> ya(y + t * h, h);
    const float var = xa.square().sum() / static_cast<float>(h);
    const float r = 1.0f / std::sqrt(var + static_cast<float>(eps));
    ya = wa * (xa * r);
  }
}

void ApplyRope(const std::vector<float>& inv_freq, int64_t pos0, int64_t n, int n_heads, int d,
               int64_t stride, float* x) {
  const int half = d / 2;
  std::vector<float> cs(half), sn(half);
  for (int64_t t = 0; t < n; ++t) {
    const float pos = static_cast<float>(pos0 + t);
    for (int i = 0; i < half; ++i) {
      const float a = pos * inv_freq[i];  // fp32, as HF computes freqs
      cs[i] = std::cos(a);
      sn[i] = std::sin(a);
    }
    float* row = x + t * stride;
    for (int h = 0; h < n_heads; ++h) {
      float* v = row + static_cast<int64_t>(h) * d;
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = b * cs[i] + a * sn[i];
      }
    }
  }
}

Status Embed(const Model& m, const int32_t* tokens, int64_t n, int64_t pos0, float* x) {
  const ModelSpec& s = m.spec();
  for (int64_t t = 0; t < n; ++t) {
    const int32_t id = tokens[t];
    if (id < 0 || id >= s.vocab) {
      return InvalidArgumentError("token id " + std::to_string(id) + " at position " +
                                  std::to_string(pos0 + t) +
                                  " is outside [0, vocab_size=" + std::to_string(s.vocab) + ")");
    }
    std::copy_n(m.embed() + static_cast<int64_t>(id) * s.hidden, s.hidden, x + t * s.hidden);
  }
  return Status::OK();
}

void Workspace::Resize(const ModelSpec& s, int64_t n) {
  const int64_t qd = int64_t{s.n_q_heads} * s.head_dim, kd = int64_t{s.n_kv_heads} * s.head_dim;
  norm.resize(n * s.hidden);
  q.resize(n * qd);
  k.resize(n * kd);
  v.resize(n * kd);
  attn.resize(n * qd);
  proj.resize(n * s.hidden);
  gate.resize(n * s.intermediate);
  up.resize(n * s.intermediate);
}

Status LayerForward(const Model& m, int layer, int64_t pos0, int64_t n, float* x, Workspace* ws,
                    const AttentionFn& attention) {
  const ModelSpec& s = m.spec();
  const LayerWeights& w = m.layer(layer);
  ThreadPool* pool = m.pool();
  const int64_t H = s.hidden, I = s.intermediate;
  const int64_t qd = int64_t{s.n_q_heads} * s.head_dim, kd = int64_t{s.n_kv_heads} * s.head_dim;
  ws->Resize(s, n);
  RmsNorm(x, n, H, w.attn_norm.data(), s.rms_norm_eps, ws->norm.data());
  Linear(pool, ws->norm.data(), n, H, w.wq.data(), qd, w.bq.empty() ? nullptr : w.bq.data(),
         ws->q.data());
  Linear(pool, ws->norm.data(), n, H, w.wk.data(), kd, w.bk.empty() ? nullptr : w.bk.data(),
         ws->k.data());
  Linear(pool, ws->norm.data(), n, H, w.wv.data(), kd, w.bv.empty() ? nullptr : w.bv.data(),
         ws->v.data());
  ApplyRope(m.inv_freq(), pos0, n, s.n_q_heads, s.head_dim, qd, ws->q.data());
  ApplyRope(m.inv_freq(), pos0, n, s.n_kv_heads, s.head_dim, kd, ws->k.data());
  RETURN_IF_ERROR(
      attention(layer, pos0, n, ws->q.data(), ws->k.data(), ws->v.data(), ws->attn.data()));
  Linear(pool, ws->attn.data(), n, qd, w.wo.data(), H, w.bo.empty() ? nullptr : w.bo.data(),
         ws->proj.data());
  Eigen::Map<Eigen::ArrayXf> xa(x, n * H);
  xa += Eigen::Map<const Eigen::ArrayXf>(ws->proj.data(), n * H);
  RmsNorm(x, n, H, w.mlp_norm.data(), s.rms_norm_eps, ws->norm.data());
  Linear(pool, ws->norm.data(), n, H, w.w_gate.data(), I, nullptr, ws->gate.data());
  Linear(pool, ws->norm.data(), n, H, w.w_up.data(), I, nullptr, ws->up.data());
  {
    Eigen::Map<Eigen::ArrayXf> g(ws->gate.data(), n * I);
    Eigen::Map<const Eigen::ArrayXf> u(ws->up.data(), n * I);
    g = g / (1.0f + (-g).exp()) * u;  // SiLU(gate) * up
  }
  Linear(pool, ws->gate.data(), n, I, w.w_down.data(), H, nullptr, ws->proj.data());
  xa += Eigen::Map<const Eigen::ArrayXf>(ws->proj.data(), n * H);
  return Status::OK();
}

void Logits(const Model& m, const float* x, const std::vector<int64_t>& rows, float* logits) {
  const ModelSpec& s = m.spec();
  if (rows.empty()) return;
  std::vector<float> h(rows.size() * s.hidden), normed(rows.size() * s.hidden);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::copy_n(x + rows[r] * s.hidden, s.hidden, h.data() + r * s.hidden);
  }
  RmsNorm(h.data(), static_cast<int64_t>(rows.size()), s.hidden, m.final_norm(), s.rms_norm_eps,
          normed.data());
  Linear(m.pool(), normed.data(), static_cast<int64_t>(rows.size()), s.hidden, m.lm_head(), s.vocab,
         nullptr, logits);
}

void ChunkAttention(ThreadPool* pool, const ModelSpec& s, const KvCache& cache, int layer,
                    int64_t n, int64_t L, const float* q, int64_t q_stride, float* out) {
  const int d = s.head_dim;
  const int G = s.group_size();
  const int64_t pos0 = L - n;
  const int64_t w = s.sliding_window;
  const int64_t kv_lo = w > 0 ? std::max<int64_t>(0, pos0 - w + 1) : 0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const bool f32 = cache.dtype() == DType::kF32;
  auto head = [&](int h) {
    const int g = h / G;
    StridedConstMap Q(q + static_cast<int64_t>(h) * d, n, d, Eigen::OuterStride<>(q_stride));
    // Per-thread scratch, reused across calls.
    thread_local RowMat S, Ktile, Vtile, Acc;
    thread_local Eigen::VectorXf m, l;
    Acc.setZero(n, d);
    m.setConstant(n, -std::numeric_limits<float>::infinity());
    l.setZero(n);
    for (int64_t j0 = kv_lo; j0 < L; j0 += kAttentionTile) {
      const int64_t j1 = std::min(L, j0 + kAttentionTile);
      const int64_t bt = j1 - j0;
      const float* kp;
      const float* vp;
      if (f32) {
        kp = cache.KeysF32(layer, g) + j0 * d;
        vp = cache.ValuesF32(layer, g) + j0 * d;
      } else {
        Ktile.resize(bt, d);
        Vtile.resize(bt, d);
        cache.Read(layer, g, j0, j1, Ktile.data(), Vtile.data());
        kp = Ktile.data();
        vp = Vtile.data();
      }
      ConstRowMap K(kp, bt, d), V(vp, bt, d);
      S.resize(n, bt);
      S.noalias() = Q * K.transpose();
      // Rows whose visible range [lo_t, p_t] misses this tile take no update.
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = pos0 + t;
        const int64_t lo = std::max(j0, w > 0 ? std::max<int64_t>(0, p - w + 1) : int64_t{0});
        const int64_t hi = std::min(j1, p + 1);  // exclusive
        auto row = S.row(t);
        if (hi <= lo) {
          row.setZero();
          continue;
        }
        auto seg = row.segment(lo - j0, hi - lo).array();
        seg *= scale;
        const float m_new = std::max(m[t], seg.maxCoeff());
        const float alpha = std::exp(m[t] - m_new);  // 0 on the first visible tile
        seg = (seg - m_new).exp();
        l[t] = l[t] * alpha + seg.sum();
        m[t] = m_new;
        if (alpha != 1.0f) Acc.row(t) *= alpha;
        if (lo > j0) row.head(lo - j0).setZero();
        if (hi < j1) row.tail(j1 - hi).setZero();
      }
      Acc.noalias() += S * V;
    }
    StridedMap O(out + static_cast<int64_t>(h) * d, n, d, Eigen::OuterStride<>(q_stride));
    O = Acc.array().colwise() / l.array();
  };
  if (pool == nullptr || pool->size() <= 1) {
    for (int h = 0; h < s.n_q_heads; ++h) head(h);
    return;
  }
  pool->ParallelFor(static_cast<size_t>(s.n_q_heads), [&](size_t h0, size_t h1) {
    for (size_t h = h0; h < h1; ++h) head(static_cast<int>(h));
  });
}

}  // namespace ctxcache::model::internal
