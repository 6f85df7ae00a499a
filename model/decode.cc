#include "model/decode.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "model/forward.h"
#include "model/prefill.h"

namespace ctxcache::model {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRowMap = Eigen::Map<const RowMat>;

// In-place softmax of scores[0..n) after scaling.
void ScaledSoftmax(float* scores, int64_t n, float scale) {
  Eigen::Map<Eigen::ArrayXf> s(scores, n);
  s *= scale;
  const float mx = s.maxCoeff();
  s = (s - mx).exp();
  s /= s.sum();
}

}  // namespace

// ---------------------------------------------------------------- full ----

Status FullAttention::Attend(int layer, int64_t pos, const float* q, const float* k, const float* v,
                             float* out) {
  const int d = spec_.head_dim, G = spec_.group_size();
  if (cache_->n_tokens(layer) != pos) {
    return FailedPreconditionError("full attention: layer " + std::to_string(layer) + " holds " +
                                   std::to_string(cache_->n_tokens(layer)) +
                                   " tokens but the step is at position " + std::to_string(pos));
  }
  cache_->Append(layer, 1, k, v, int64_t{spec_.n_kv_heads} * d);
  const int64_t L = pos + 1;
  const int64_t lo = spec_.sliding_window > 0 ? std::max<int64_t>(0, L - spec_.sliding_window) : 0;
  const int64_t n = L - lo;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  scores_.resize(n);
  for (int g = 0; g < spec_.n_kv_heads; ++g) {
    const float* kp;
    const float* vp;
    if (cache_->dtype() == DType::kF32) {
      kp = cache_->KeysF32(layer, g) + lo * d;
      vp = cache_->ValuesF32(layer, g) + lo * d;
    } else {
      kbuf_.resize(n * d);
      vbuf_.resize(n * d);
      cache_->Read(layer, g, lo, L, kbuf_.data(), vbuf_.data());
      kp = kbuf_.data();
      vp = vbuf_.data();
    }
    ConstRowMap K(kp, n, d), V(vp, n, d);
    for (int i = 0; i < G; ++i) {
      const int h = g * G + i;
      Eigen::Map<const Eigen::VectorXf> qv(q + int64_t{h} * d, d);
      Eigen::Map<Eigen::VectorXf> sv(scores_.data(), n);
      sv.noalias() = K * qv;
      ScaledSoftmax(scores_.data(), n, scale);
      Eigen::Map<Eigen::VectorXf> ov(out + int64_t{h} * d, d);
      ov.noalias() = V.transpose() * sv;
    }
  }
  return Status::OK();
}

// --------------------------------------------------------- page source ----

Status KvCachePageSource::GetKV(int layer, int kv_head, const int32_t* ids, int64_t n, float* k_out,
                                float* v_out) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= n_) {
      return InvalidArgumentError("page source: token id " + std::to_string(ids[i]) +
                                  " outside [0, " + std::to_string(n_) + ")");
    }
  }
  cache_->Gather(layer, kv_head, ids, n, k_out, v_out);
  return Status::OK();
}

// -------------------------------------------------------------- sparse ----

// Keys of context tokens (from the PageSource) and of decoded tokens (from
// the local tail), as one id space, for selectors that score exactly.
class SparseAttention::TailKeySource final : public index::KeySource {
 public:
  TailKeySource(PageSource* pages, int layer, int kv_head, int64_t n_context,
                const std::vector<float>* tail_k, int64_t n_tail, int d)
      : pages_(pages),
        layer_(layer),
        kv_head_(kv_head),
        n_context_(n_context),
        tail_k_(tail_k),
        n_tail_(n_tail),
        d_(d) {}
  int64_t n_tokens() const override { return n_context_ + n_tail_; }
  int head_dim() const override { return d_; }
  Status GatherKeys(const int32_t* ids, int64_t n, float* out) const override {
    std::vector<std::pair<int32_t, int64_t>> ctx;  // (id, output row)
    for (int64_t i = 0; i < n; ++i) {
      const int32_t id = ids[i];
      if (id < 0 || id >= n_tokens()) {
        return InvalidArgumentError("key source: token id " + std::to_string(id) + " outside [0, " +
                                    std::to_string(n_tokens()) + ")");
      }
      if (id < n_context_) {
        ctx.emplace_back(id, i);
      } else {
        std::copy_n(tail_k_->data() + (id - n_context_) * d_, d_, out + i * d_);
      }
    }
    if (ctx.empty()) return Status::OK();
    std::sort(ctx.begin(), ctx.end());
    std::vector<int32_t> sorted(ctx.size());
    for (size_t i = 0; i < ctx.size(); ++i) sorted[i] = ctx[i].first;
    std::vector<float> buf(ctx.size() * d_);
    RETURN_IF_ERROR(pages_->GetKV(layer_, kv_head_, sorted.data(),
                                  static_cast<int64_t>(sorted.size()), buf.data(), nullptr));
    for (size_t i = 0; i < ctx.size(); ++i) {
      std::copy_n(buf.data() + i * d_, d_, out + ctx[i].second * d_);
    }
    return Status::OK();
  }

 private:
  PageSource* pages_;
  int layer_, kv_head_;
  int64_t n_context_;
  const std::vector<float>* tail_k_;
  int64_t n_tail_;
  int d_;
};

SparseAttention::SparseAttention(const ModelSpec& spec,
                                 std::vector<std::vector<index::Selector*>> selectors,
                                 PageSource* pages, const SparseAttentionOptions& options)
    : spec_(spec),
      selectors_(std::move(selectors)),
      pages_(pages),
      options_(options),
      n_context_(pages->n_tokens()),
      tail_k_(spec.n_layers, std::vector<std::vector<float>>(spec.n_kv_heads)),
      tail_v_(spec.n_layers, std::vector<std::vector<float>>(spec.n_kv_heads)) {}

StatusOr<std::unique_ptr<SparseAttention>> SparseAttention::Create(
    const ModelSpec& spec, std::vector<std::vector<index::Selector*>> selectors, PageSource* pages,
    const SparseAttentionOptions& options) {
  if (pages == nullptr) return InvalidArgumentError("sparse attention: page source is null");
  if (static_cast<int>(selectors.size()) != spec.n_layers) {
    return InvalidArgumentError("sparse attention: selectors has " +
                                std::to_string(selectors.size()) + " layers, expected " +
                                std::to_string(spec.n_layers));
  }
  for (int l = 0; l < spec.n_layers; ++l) {
    if (static_cast<int>(selectors[l].size()) != spec.n_kv_heads) {
      return InvalidArgumentError("sparse attention: selectors[" + std::to_string(l) + "] has " +
                                  std::to_string(selectors[l].size()) + " kv heads, expected " +
                                  std::to_string(spec.n_kv_heads));
    }
    for (int g = 0; g < spec.n_kv_heads; ++g) {
      const index::Selector* s = selectors[l][g];
      if (s == nullptr) return InvalidArgumentError("sparse attention: null selector");
      if (s->n_tokens() != pages->n_tokens() || s->head_dim() != spec.head_dim) {
        return InvalidArgumentError(
            "sparse attention: selector (layer " + std::to_string(l) + ", kv head " +
            std::to_string(g) + ") covers " + std::to_string(s->n_tokens()) + " tokens of dim " +
            std::to_string(s->head_dim()) + "; expected " + std::to_string(pages->n_tokens()) +
            " of dim " + std::to_string(spec.head_dim));
      }
    }
  }
  return std::unique_ptr<SparseAttention>(
      new SparseAttention(spec, std::move(selectors), pages, options));
}

Status SparseAttention::Attend(int layer, int64_t pos, const float* q, const float* k,
                               const float* v, float* out) {
  const int d = spec_.head_dim, G = spec_.group_size();
  const int64_t n_tail_before =
      static_cast<int64_t>(tail_k_[layer][0].size()) / d;  // decoded tokens so far
  if (pos != n_context_ + n_tail_before) {
    return FailedPreconditionError(
        "sparse attention: layer " + std::to_string(layer) + " expects position " +
        std::to_string(n_context_ + n_tail_before) + ", got " + std::to_string(pos));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ++stats_.steps;
  for (int g = 0; g < spec_.n_kv_heads; ++g) {
    std::vector<float>& tk = tail_k_[layer][g];
    std::vector<float>& tv = tail_v_[layer][g];
    index::Selector* sel = selectors_[layer][g];
    const float* gq = q + int64_t{g} * G * d;
    TailKeySource keys(pages_, layer, g, n_context_, &tk, n_tail_before, d);
    index::SelectInput in;
    in.queries = gq;
    in.n_queries = G;
    in.budget = options_.budget;
    in.keys = &keys;
    index::Selection selection;
    index::WorkStats work;
    RETURN_IF_ERROR(sel->Select(in, &selection, &work));
    stats_.work.Add(work);
    // Context tokens to fetch: the merged selection below n_context.
    std::vector<int32_t> ctx;
    for (int32_t id : selection.merged) {
      if (id >= 0 && id < n_context_) ctx.push_back(id);
    }
    const int64_t m = static_cast<int64_t>(ctx.size());
    std::vector<float> ck(m * d), cv(m * d);
    if (m > 0) RETURN_IF_ERROR(pages_->GetKV(layer, g, ctx.data(), m, ck.data(), cv.data()));
    stats_.fetched_tokens += static_cast<uint64_t>(m);
    // The new token joins the tail before attending (it sees itself).
    tk.insert(tk.end(), k + int64_t{g} * d, k + int64_t{g + 1} * d);
    tv.insert(tv.end(), v + int64_t{g} * d, v + int64_t{g + 1} * d);
    const int64_t n_tail = n_tail_before + 1;
    ConstRowMap CK(ck.data(), m, d), CV(cv.data(), m, d);
    ConstRowMap TK(tk.data(), n_tail, d), TV(tv.data(), n_tail, d);
    for (int i = 0; i < G; ++i) {
      // Rows of `ctx` this head attends to.
      std::vector<int64_t> rows;
      const bool have_head = static_cast<int>(selection.per_head.size()) > i;
      if (have_head) {
        for (int32_t id : selection.per_head[i]) {
          if (id < 0 || id >= n_context_) continue;
          auto it = std::lower_bound(ctx.begin(), ctx.end(), id);
          if (it != ctx.end() && *it == id) rows.push_back(it - ctx.begin());
        }
      } else {
        rows.resize(m);
        std::iota(rows.begin(), rows.end(), 0);
      }
      const int64_t r = static_cast<int64_t>(rows.size());
      stats_.context_tokens += static_cast<uint64_t>(r);
      Eigen::Map<const Eigen::VectorXf> qv(gq + int64_t{i} * d, d);
      Eigen::VectorXf all_ctx = CK * qv;  // scores against every fetched key
      std::vector<float> scores(r + n_tail);
      for (int64_t j = 0; j < r; ++j) scores[j] = all_ctx[rows[j]];
      Eigen::Map<Eigen::VectorXf>(scores.data() + r, n_tail).noalias() = TK * qv;
      ScaledSoftmax(scores.data(), r + n_tail, scale);
      Eigen::Map<Eigen::VectorXf> ov(out + int64_t{g * G + i} * d, d);
      ov.setZero();
      for (int64_t j = 0; j < r; ++j) ov += scores[j] * CV.row(rows[j]).transpose();
      ov.noalias() += TV.transpose() * Eigen::Map<const Eigen::VectorXf>(scores.data() + r, n_tail);
    }
    if (options_.append_to_selectors) {
      RETURN_IF_ERROR(sel->Append(k + int64_t{g} * d, v + int64_t{g} * d, gq));
    }
  }
  return Status::OK();
}

// ---------------------------------------------------------- decode step ---

Status DecodeStep(const Model& model, int32_t token, int64_t pos,
                  const std::vector<AttentionProvider*>& providers, std::vector<float>* logits) {
  const ModelSpec& s = model.spec();
  if (providers.size() != 1 && static_cast<int>(providers.size()) != s.n_layers) {
    return InvalidArgumentError("decode: need 1 or n_layers=" + std::to_string(s.n_layers) +
                                " attention providers, got " + std::to_string(providers.size()));
  }
  std::vector<float> x(s.hidden);
  RETURN_IF_ERROR(internal::Embed(model, &token, 1, pos, x.data()));
  internal::Workspace ws;
  internal::AttentionFn attention = [&](int layer, int64_t p, int64_t n, const float* q,
                                        const float* k, const float* v, float* out) -> Status {
    (void)n;
    AttentionProvider* ap = providers.size() == 1 ? providers[0] : providers[layer];
    if (ap == nullptr) return InvalidArgumentError("decode: null attention provider");
    return ap->Attend(layer, p, q, k, v, out);
  };
  for (int l = 0; l < s.n_layers; ++l) {
    AttentionProvider* ap = providers.size() == 1 ? providers[0] : providers[l];
    if (ap != nullptr) RETURN_IF_ERROR(ap->OnLayerInput(l, pos, x.data()));
    RETURN_IF_ERROR(internal::LayerForward(model, l, pos, 1, x.data(), &ws, attention));
  }
  logits->resize(s.vocab);
  internal::Logits(model, x.data(), {0}, logits->data());
  return Status::OK();
}

Status LayerQueries(const Model& model, int layer, int64_t pos, const float* hidden, float* q,
                    std::vector<float>* scratch) {
  const ModelSpec& s = model.spec();
  if (layer < 0 || layer >= s.n_layers) {
    return InvalidArgumentError("LayerQueries: layer " + std::to_string(layer) + " out of range");
  }
  const LayerWeights& w = model.layer(layer);
  const int64_t qd = int64_t{s.n_q_heads} * s.head_dim;
  scratch->resize(static_cast<size_t>(s.hidden));
  internal::RmsNorm(hidden, 1, s.hidden, w.attn_norm.data(), s.rms_norm_eps, scratch->data());
  internal::Linear(model.pool(), scratch->data(), 1, s.hidden, w.wq.data(), qd,
                   w.bq.empty() ? nullptr : w.bq.data(), q);
  internal::ApplyRope(model.inv_freq(), pos, 1, s.n_q_heads, s.head_dim, qd, q);
  return Status::OK();
}

// ------------------------------------------------------------ sampling ----

int32_t Argmax(const float* logits, int vocab) {
  return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
}

int32_t Sampler::Sample(const float* logits, int vocab) {
  if (options_.temperature <= 0.0f) return Argmax(logits, vocab);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<double> p(vocab);
  const double mx = logits[order[0]];
  double sum = 0;
  for (int i = 0; i < vocab; ++i) {
    p[i] = std::exp((logits[order[i]] - mx) / options_.temperature);
    sum += p[i];
  }
  int keep = vocab;
  if (options_.top_p < 1.0f) {
    double acc = 0;
    for (int i = 0; i < vocab; ++i) {
      acc += p[i] / sum;
      if (acc >= options_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (int i = 0; i < keep; ++i) kept += p[i];
  std::uniform_real_distribution<double> u(0.0, kept);
  double r = u(rng_);
  for (int i = 0; i < keep; ++i) {
    r -= p[i];
    if (r <= 0) return order[i];
  }
  return order[keep - 1];
}

StatusOr<std::vector<int32_t>> Generate(const Model& model, const std::vector<int32_t>& prompt,
                                        int n_new, const SamplingOptions& sampling,
                                        DType kv_dtype) {
  KvCache cache(model.spec(), kv_dtype);
  cache.Reserve(static_cast<int64_t>(prompt.size()) + n_new);
  PrefillOptions po;
  PrefillResult pr;
  RETURN_IF_ERROR(Prefill(model, prompt, &cache, {}, po, &pr));
  Sampler sampler(sampling);
  std::vector<int32_t> out;
  if (n_new <= 0) return out;
  out.push_back(sampler.Sample(pr.logits.data(), model.spec().vocab));
  FullAttention full(model.spec(), &cache);
  std::vector<float> logits;
  std::vector<AttentionProvider*> providers = {&full};
  while (static_cast<int>(out.size()) < n_new) {
    const int64_t pos = static_cast<int64_t>(prompt.size() + out.size()) - 1;
    RETURN_IF_ERROR(DecodeStep(model, out.back(), pos, providers, &logits));
    out.push_back(sampler.Sample(logits.data(), model.spec().vocab));
  }
  return out;
}

}  // namespace ctxcache::model
