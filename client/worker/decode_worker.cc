#include "client/worker/decode_worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common/dtype.h"
#include "index/methods.h"
#include "proto/dtype_convert.h"
#include "session/attention.h"

namespace ctxcache::client {

RemoteAttention::RemoteAttention(const model::ModelSpec& spec, DecodeSession* session,
                                 int64_t n_context, const model::Model* speculate_with)
    : spec_(spec), session_(session), n_context_(n_context), speculate_with_(speculate_with) {
  spec_q_.assign(size_t(spec.n_q_heads) * spec.head_dim, 0.f);
  tail_k_.assign(spec.n_layers, std::vector<std::vector<float>>(spec.n_kv_heads));
  tail_v_ = tail_k_;
  pend_k_.assign(size_t(spec.n_layers) * spec.n_kv_heads * spec.head_dim, 0.f);
  pend_v_ = pend_k_;
  pend_q_.assign(size_t(spec.n_layers) * spec.n_q_heads * spec.head_dim, 0.f);
  last_.resize(spec.n_layers);
}

Status RemoteAttention::Attend(int layer, int64_t, const float* q, const float* k, const float* v,
                               float* out) {
  const int d = spec_.head_dim, nkv = spec_.n_kv_heads, nq = spec_.n_q_heads;
  const int g = nq / nkv;
  SelectedKV sel;
  RETURN_IF_ERROR(session_->Step(static_cast<uint32_t>(layer), q, &sel));
  bytes_received_ += sel.bytes_received;
  const int64_t page = std::max<int64_t>(1, session_->context().block_tokens());
  for (const SelectedKV::Head& head : sel.heads) {
    int64_t last = -1;
    for (int32_t id : head.ids) {  // sorted
      if (id >= n_context_) break;
      if (id / page != last) {
        last = id / page;
        ++context_pages_;
      }
    }
  }
  for (int h = 0; h < nkv; ++h) {
    auto& tk = tail_k_[layer][h];
    auto& tv = tail_v_[layer][h];
    tk.insert(tk.end(), k + size_t(h) * d, k + size_t(h + 1) * d);
    tv.insert(tv.end(), v + size_t(h) * d, v + size_t(h + 1) * d);
  }
  std::copy_n(k, size_t(nkv) * d, pend_k_.data() + size_t(layer) * nkv * d);
  std::copy_n(v, size_t(nkv) * d, pend_v_.data() + size_t(layer) * nkv * d);
  std::copy_n(q, size_t(nq) * d, pend_q_.data() + size_t(layer) * nq * d);
  for (int qh = 0; qh < nq; ++qh) {
    const int h = qh / g;
    const SelectedKV::Head& head = sel.heads[h];
    const auto& mine = head.per_q_head[qh % g];
    const auto& tk = tail_k_[layer][h];
    const auto& tv = tail_v_[layer][h];
    // Rows: the q head's own selected context tokens, then the whole tail.
    auto row_of = [&](int32_t id) {
      auto it = std::lower_bound(head.ids.begin(), head.ids.end(), id);
      const size_t r = static_cast<size_t>(it - head.ids.begin());
      return session::StoredRow{head.k.data() + r * d, head.v.data() + r * d};
    };
    context_tokens_ += session::AttendSelected(
        q + size_t(qh) * d, d, mine, n_context_, row_of, tk.data(), tv.data(),
        static_cast<int64_t>(tk.size() / d), out + size_t(qh) * d, &attend_);
  }
  last_[layer] = std::move(sel);
  return Status::OK();
}

Status RemoteAttention::OnLayerInput(int layer, int64_t pos, const float* hidden) {
  if (speculate_with_ == nullptr || layer + 1 >= spec_.n_layers) return Status::OK();
  RETURN_IF_ERROR(
      model::LayerQueries(*speculate_with_, layer + 1, pos, hidden, spec_q_.data(), &spec_norm_));
  return session_->Prefetch(static_cast<uint32_t>(layer + 1), spec_q_.data());
}

Status RemoteAttention::FlushAppend() {
  return session_->Append(pend_k_.data(), pend_v_.data(), pend_q_.data());
}

Status FetchContextKv(Client* client, const v1::ContextInfo& info, model::KvCache* cache,
                      uint64_t* bytes) {
  const int64_t n = static_cast<int64_t>(info.n_tokens());
  const uint32_t b = info.block_tokens();
  const uint32_t n_blocks = static_cast<uint32_t>((n + b - 1) / b);
  const int d = cache->head_dim(), nkv = cache->n_kv_heads();
  for (int layer = 0; layer < cache->n_layers(); ++layer) {
    if (cache->n_tokens(layer) != 0) {
      return FailedPreconditionError("FetchContextKv: the cache is not empty");
    }
  }
  std::vector<float> k(size_t(n) * nkv * d), v(k.size());
  uint64_t total = 0;
  for (int layer = 0; layer < cache->n_layers(); ++layer) {
    v1::FetchPagesRequest req;
    req.set_context_id(info.context_id());
    for (int h = 0; h < nkv; ++h) {
      auto* t = req.add_tables();
      t->set_layer(layer);
      t->set_kv_head(h);
      for (uint32_t blk = 0; blk < n_blocks; ++blk) t->add_blocks(blk);
    }
    std::vector<v1::Page> pages;
    RETURN_IF_ERROR(client->FetchPages(req, &pages));
    for (const auto& p : pages) {
      total += p.k().size() + p.v().size();  // crc-checked by Client::FetchPages
      std::vector<float> pk(size_t(p.n_tokens()) * d), pv(pk.size());
      ASSIGN_OR_RETURN(DType dt, FromProtoDType(p.dtype()));
      ConvertToFloat(dt, p.k().data(), pk.data(), pk.size());
      ConvertToFloat(dt, p.v().data(), pv.data(), pv.size());
      for (uint32_t t = 0; t < p.n_tokens(); ++t) {
        size_t row = (size_t(p.block()) * b + t) * nkv + p.kv_head();
        std::copy_n(pk.data() + size_t(t) * d, d, k.data() + row * d);
        std::copy_n(pv.data() + size_t(t) * d, d, v.data() + row * d);
      }
    }
    cache->Append(layer, static_cast<int>(n), k.data(), v.data(), int64_t{nkv} * d);
  }
  if (bytes != nullptr) *bytes = total;
  return Status::OK();
}

namespace {

// Feeds prompt then generates; `step` runs one token through the model.
template <typename StepFn>
StatusOr<GenerateResult> DecodeLoop(const model::Model& model, int64_t n_context,
                                    const std::vector<int32_t>& prompt,
                                    const GenerateOptions& options, StepFn step) {
  if (prompt.empty()) return InvalidArgumentError("the prompt has 0 tokens");
  GenerateResult res;
  std::vector<float> logits;
  int64_t pos = n_context;
  const int vocab = model.spec().vocab;
  for (size_t i = 0; i < prompt.size(); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(step(prompt[i], pos++, &logits));
    res.steps++;
    if (i + 1 == prompt.size()) {
      res.step_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  for (int t = 0; t < options.max_new_tokens; ++t) {
    int32_t am = model::Argmax(logits.data(), vocab);
    res.argmax.push_back(am);
    if (options.keep_logits) res.logits.push_back(logits);
    int32_t next =
        t < static_cast<int>(options.forced_tokens.size()) ? options.forced_tokens[t] : am;
    res.tokens.push_back(next);
    if (t + 1 == options.max_new_tokens) break;
    auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(step(next, pos++, &logits));
    res.steps++;
    res.step_seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return res;
}

}  // namespace

StatusOr<GenerateResult> GenerateRemote(const model::Model& model, Client* client,
                                        const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options) {
  ASSIGN_OR_RETURN(auto session, client->OpenSession(options.session));
  const v1::ContextInfo& info = session->context();
  const model::ModelSpec& spec = model.spec();
  if (info.model().n_layers() != static_cast<uint32_t>(spec.n_layers) ||
      info.model().n_kv_heads() != static_cast<uint32_t>(spec.n_kv_heads) ||
      info.model().head_dim() != static_cast<uint32_t>(spec.head_dim)) {
    return FailedPreconditionError("context " + info.context_id() + " was built with model '" +
                                   info.model_name() +
                                   "', whose shape differs from the local model");
  }
  const int64_t n_context = static_cast<int64_t>(info.n_tokens());
  const SessionOptions& so = options.session;
  auto method = index::FindMethodInfo(so.method);
  if (!method.ok()) return method.status().WithContext("session method");
  // Query-independent methods need no speculative queries: the SDK prefetches
  // layer l+1 from Step(l) itself.
  const bool speculate =
      so.mode == SelectMode::kClient && so.prefetch && !(*method)->query_independent;
  RemoteAttention attn(spec, session.get(), n_context, speculate ? &model : nullptr);
  std::vector<model::AttentionProvider*> providers = {&attn};
  auto res = DecodeLoop(model, n_context, prompt, options,
                        [&](int32_t tok, int64_t pos, std::vector<float>* logits) -> Status {
                          RETURN_IF_ERROR(model::DecodeStep(model, tok, pos, providers, logits));
                          return attn.FlushAppend();
                        });
  if (!res.ok()) return res.status();
  res->bytes_received = attn.bytes_received();
  res->context_tokens_attended = attn.context_tokens_attended();
  res->context_pages_touched = attn.context_pages_touched();
  RETURN_IF_ERROR(session->Close());
  res->page_cache = session->page_cache_stats();
  return res;
}

StatusOr<GenerateResult> GenerateDense(const model::Model& model, Client* client,
                                       const std::string& context_id,
                                       const std::vector<int32_t>& prompt,
                                       const GenerateOptions& options,
                                       uint64_t* dense_bytes_per_step) {
  ASSIGN_OR_RETURN(v1::ContextInfo info, client->GetContext(context_id));
  const model::ModelSpec& spec = model.spec();
  model::KvCache cache(spec, DType::kBF16);
  cache.Reserve(static_cast<int64_t>(info.n_tokens() + prompt.size()) + options.max_new_tokens);
  uint64_t total = 0;
  RETURN_IF_ERROR(FetchContextKv(client, info, &cache, &total));
  *dense_bytes_per_step = total;
  model::FullAttention full(spec, &cache);
  std::vector<model::AttentionProvider*> providers = {&full};
  auto res = DecodeLoop(model, static_cast<int64_t>(info.n_tokens()), prompt, options,
                        [&](int32_t tok, int64_t pos, std::vector<float>* logits) -> Status {
                          return model::DecodeStep(model, tok, pos, providers, logits);
                        });
  if (!res.ok()) return res.status();
  res->bytes_received = total;
  return res;
}

double MeanKl(const std::vector<std::vector<float>>& p, const std::vector<std::vector<float>>& q) {
  const size_t n = std::min(p.size(), q.size());
  if (n == 0) return 0;
  double total = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& a = p[i];
    const auto& b = q[i];
    double ma = *std::max_element(a.begin(), a.end());
    double mb = *std::max_element(b.begin(), b.end());
    double za = 0, zb = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      za += std::exp(a[j] - ma);
      zb += std::exp(b[j] - mb);
    }
    double kl = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      double la = a[j] - ma - std::log(za);
      double lb = b[j] - mb - std::log(zb);
      kl += std::exp(la) * (la - lb);
    }
    total += kl;
  }
  return total / static_cast<double>(n);
}

}  // namespace ctxcache::client
