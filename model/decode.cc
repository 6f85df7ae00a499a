#include "model/decode.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "index/eigen_blocking.h"
#include "model/forward.h"
#include "model/prefill.h"
#include "session/attention.h"

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

Status KvCachePageFetcher::Fetch(int layer, int kv_head, std::span<const uint32_t> blocks,
                                 session::PageMap* out) {
  const int d = cache_->head_dim();
  for (uint32_t block : blocks) {
    if (out->count(block)) continue;
    const int64_t begin = int64_t{block} * page_size_;
    const int64_t end = std::min<int64_t>(begin + page_size_, n_);
    if (begin >= n_) {
      return InvalidArgumentError("kv cache fetcher: block " + std::to_string(block) +
                                  " starts at token " + std::to_string(begin) + ", past the " +
                                  std::to_string(n_) + " stored tokens");
    }
    auto page = std::make_shared<session::DecodedPage>();
    page->n_tokens = static_cast<uint32_t>(end - begin);
    page->k.resize(static_cast<size_t>(end - begin) * d);
    page->v.resize(page->k.size());
    cache_->Read(layer, kv_head, begin, end, page->k.data(), page->v.data());
    (*out)[block] = std::move(page);
  }
  return Status::OK();
}

// -------------------------------------------------------------- sparse ----

SparseAttention::SparseAttention(const ModelSpec& spec,
                                 std::unique_ptr<session::SparseSession> session)
    : spec_(spec),
      session_(std::move(session)),
      last_(spec.n_layers, std::vector<session::HeadStep>(spec.n_kv_heads)),
      pages_(spec.n_kv_heads) {}

StatusOr<std::unique_ptr<SparseAttention>> SparseAttention::Create(
    const ModelSpec& spec, std::vector<std::vector<index::Selector*>> selectors,
    session::PageFetcher* pages, int64_t n_context, const SparseAttentionOptions& options) {
  if (pages == nullptr) return InvalidArgumentError("sparse attention: page fetcher is null");
  if (static_cast<int>(selectors.size()) != spec.n_layers) {
    return InvalidArgumentError("sparse attention: selectors has " +
                                std::to_string(selectors.size()) + " layers, expected " +
                                std::to_string(spec.n_layers));
  }
  std::vector<index::Selector*> flat;
  for (int l = 0; l < spec.n_layers; ++l) {
    if (static_cast<int>(selectors[l].size()) != spec.n_kv_heads) {
      return InvalidArgumentError("sparse attention: selectors[" + std::to_string(l) + "] has " +
                                  std::to_string(selectors[l].size()) + " kv heads, expected " +
                                  std::to_string(spec.n_kv_heads));
    }
    flat.insert(flat.end(), selectors[l].begin(), selectors[l].end());
  }
  if (flat.empty() || flat[0] == nullptr) {
    return InvalidArgumentError("sparse attention: null selector");
  }
  const auto shape = session::SessionShape::From(spec, options.page_size, n_context);
  ASSIGN_OR_RETURN(auto params, session::SessionParams::Parse(std::string(flat[0]->method()),
                                                              options.params, options.page_size));
  ASSIGN_OR_RETURN(auto core, session::SparseSession::CreateBorrowed(shape, params,
                                                                     std::move(flat), pages));
  return std::unique_ptr<SparseAttention>(new SparseAttention(spec, std::move(core)));
}

Status SparseAttention::Attend(int layer, int64_t pos, const float* q, const float* k,
                               const float* v, float* out) {
  const int d = spec_.head_dim, G = spec_.group_size();
  session::SparseSession& core = *session_;
  if (layer < 0 || layer >= spec_.n_layers) {
    return InvalidArgumentError("sparse attention: layer " + std::to_string(layer) +
                                " out of range");
  }
  if (pos != core.n_tokens(layer)) {
    return FailedPreconditionError("sparse attention: layer " + std::to_string(layer) +
                                   " expects position " + std::to_string(core.n_tokens(layer)) +
                                   ", got " + std::to_string(pos));
  }
  ++stats_.steps;
  const int64_t n_context = core.shape().n_stored, b = core.shape().page_size;
  // Plan and fetch every kv head before the token joins the sequence.
  for (int g = 0; g < spec_.n_kv_heads; ++g) {
    session::HeadStep& step = last_[layer][g];
    RETURN_IF_ERROR(core.PlanHead(layer, g, q + int64_t{g} * G * d, &step, &stats_.work));
    pages_[g].clear();
    RETURN_IF_ERROR(core.LoadPages(layer, g, step, &pages_[g]));
    for (uint32_t p : step.pages_with_stored()) {
      stats_.fetched_tokens +=
          static_cast<uint64_t>(std::min<int64_t>(b, n_context - int64_t{p} * b));
    }
    stats_.fetched_pages += step.n_with_stored;
  }
  // The new token joins the tail (it attends to itself) and the selectors.
  RETURN_IF_ERROR(core.AppendLayer(layer, k, v, q));
  const int64_t n_tail = core.n_appended(layer);
  for (int g = 0; g < spec_.n_kv_heads; ++g) {
    const session::HeadStep& step = last_[layer][g];
    const std::vector<float>& tk = core.appended_k(layer, g);
    const std::vector<float>& tv = core.appended_v(layer, g);
    auto row_of = [&](int32_t id) {
      const session::PageRef& page = pages_[g].at(static_cast<uint32_t>(id / b));
      return session::StoredRow{page->k.data() + (id % b) * d, page->v.data() + (id % b) * d};
    };
    for (int i = 0; i < G; ++i) {
      std::span<const int32_t> selected;
      if (i < static_cast<int>(step.per_q_head.size())) selected = step.per_q_head[i];
      const int h = g * G + i;
      stats_.context_tokens +=
          session::AttendSelected(q + int64_t{h} * d, d, selected, n_context, row_of, tk.data(),
                                  tv.data(), n_tail, out + int64_t{h} * d, &attend_);
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
