// Client-mode DecodeSession: the session core (session/sparse_session.h) runs
// in the worker over the context's fetched index. Stored pages come from the
// PageCache or one batched FetchPages per (layer, kv head); the Prefetcher
// fetches layer l+1's pages while layer l runs. Appended tokens also go to
// the server, which keeps the context's session state.
#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "client/sdk/decode_stream.h"
#include "client/sdk/page_cache.h"
#include "client/sdk/prefetcher.h"
#include "client/sdk/sessions.h"
#include "index/methods.h"
#include "session/session_params.h"
#include "session/sparse_session.h"

namespace ctxcache::client::internal {

namespace {

class ClientModeSession final : public DecodeSession {
 public:
  ClientModeSession(Client* client, v1::DecodeService::Stub* stub, SessionOptions options)
      : client_(client),
        options_(std::move(options)),
        stream_(stub, client->options()),
        cache_(options_.page_cache_bytes) {}
  ~ClientModeSession() override {
    if (prefetcher_) prefetcher_->Stop();
    Close().IgnoreError();
  }

  Status Open();
  const v1::ContextInfo& context() const override { return info_; }
  int64_t n_tokens() const override { return core_->n_tokens(); }
  Status Step(uint32_t layer, const float* queries, SelectedKV* out) override;
  Status Prefetch(uint32_t layer, const float* predicted_queries) override;
  Status Append(const float* k, const float* v, const float* q) override;
  Status Close() override {
    if (prefetcher_) prefetcher_->Stop();
    return stream_.Close();
  }
  PageCacheStats page_cache_stats() const override { return cache_.stats(); }

 private:
  // The core's page source: the page cache, then FetchPages. The prefetch
  // thread's instance marks what it fetches and counts no hits or misses.
  class RemotePageFetcher final : public session::PageFetcher {
   public:
    RemotePageFetcher(ClientModeSession* s, bool prefetch) : s_(s), prefetch_(prefetch) {}
    Status Fetch(int layer, int kv_head, std::span<const uint32_t> blocks,
                 session::PageMap* out) override {
      return s_->StoredPages(static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                             blocks, out, prefetch_ ? nullptr : s_->step_stats_, prefetch_);
    }

   private:
    ClientModeSession* s_;
    bool prefetch_;
  };

  Status StoredPages(uint32_t layer, uint32_t head, std::span<const uint32_t> wanted,
                     session::PageMap* out, SelectedKV* stats, bool prefetch);
  bool PrefetchEnabled() const {
    return options_.prefetch && prefetcher_ && !stream_.closed() && !prefetcher_->stopped();
  }
  // A prefetch job: the prediction copy of each selector of the layer plans
  // the step, and the pages it would need go into the cache.
  Status RunPrefetch(const Prefetcher::Job& job);

  Client* client_;
  SessionOptions options_;
  DecodeStream stream_;
  PageCache cache_;
  v1::ContextInfo info_;
  uint32_t n_layers_ = 0, n_q_ = 0, n_kv_ = 0, d_ = 0, block_ = 16;
  bool query_independent_ = false;
  RemotePageFetcher fetcher_{this, false}, pred_fetcher_{this, true};
  std::unique_ptr<session::SparseSession> core_;
  SelectedKV* step_stats_ = nullptr;  // the Step in progress, for byte accounting
  // Only the prefetch thread touches these: prediction copies of the
  // selectors, [layer * n_kv + head], cloned lazily, and their key sources.
  std::vector<std::unique_ptr<index::Selector>> pred_selectors_;
  std::vector<uint64_t> pred_bytes_;  // MemoryBytes() of each copy when cloned
  std::vector<std::unique_ptr<index::KeySource>> pred_key_sources_;
  // Last member: stopped (joined) before the state its jobs read goes away.
  std::unique_ptr<Prefetcher> prefetcher_;
};

Status ClientModeSession::Open() {
  ASSIGN_OR_RETURN(info_, stream_.Open(options_, /*want_pages=*/false));
  n_layers_ = info_.model().n_layers();
  n_q_ = info_.model().n_q_heads();
  n_kv_ = info_.model().n_kv_heads();
  d_ = info_.model().head_dim();
  block_ = info_.block_tokens();
  ASSIGN_OR_RETURN(const index::MethodInfo* method, index::FindMethodInfo(options_.method));
  query_independent_ = method->query_independent;
  // The server's parser (session/session_params.h): same defaults, same errors.
  ASSIGN_OR_RETURN(auto params, session::SessionParams::Parse(options_.method, options_.params,
                                                              static_cast<int>(block_)));
  ASSIGN_OR_RETURN(auto artifacts, client_->FetchIndex(options_.context_id, options_.method));
  std::vector<std::unique_ptr<index::Selector>> selectors;
  for (uint32_t l = 0; l < n_layers_; ++l) {
    for (uint32_t h = 0; h < n_kv_; ++h) {
      auto it = artifacts.find({l, h});
      if (it == artifacts.end()) {
        return DataLossError("FetchIndex returned no artifact for layer " + std::to_string(l));
      }
      ASSIGN_OR_RETURN(auto sel, index::LoadSelector(options_.method, it->second));
      RETURN_IF_ERROR(session::SparseSession::CheckStoredSelector(
          *sel, static_cast<int>(l), static_cast<int>(h),
          static_cast<int64_t>(info_.n_tokens()), static_cast<int>(d_)));
      selectors.push_back(std::move(sel));
    }
  }
  const auto shape = session::SessionShape::From(info_.model(), info_.block_tokens(),
                                                 static_cast<int64_t>(info_.n_tokens()));
  ASSIGN_OR_RETURN(core_, session::SparseSession::Create(shape, params, std::move(selectors),
                                                         &fetcher_));
  pred_selectors_.resize(size_t{n_layers_} * n_kv_);
  pred_bytes_.assign(pred_selectors_.size(), 0);
  for (uint32_t l = 0; l < n_layers_; ++l) {
    for (uint32_t h = 0; h < n_kv_; ++h) {
      pred_key_sources_.push_back(
          core_->MakeKeySource(static_cast<int>(l), static_cast<int>(h), &pred_fetcher_));
    }
  }
  prefetcher_ = std::make_unique<Prefetcher>(
      n_layers_, [this](const Prefetcher::Job& job) { return RunPrefetch(job); }, &cache_);
  return Status::OK();
}

Status ClientModeSession::StoredPages(uint32_t layer, uint32_t head,
                                      std::span<const uint32_t> wanted, session::PageMap* out,
                                      SelectedKV* stats, bool prefetch) {
  std::vector<uint32_t> blocks(wanted.begin(), wanted.end());
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  v1::FetchPagesRequest fetch;
  fetch.set_context_id(options_.context_id);
  v1::PageTable* pt = nullptr;
  for (uint32_t b : blocks) {
    if (out->count(b)) continue;
    if (auto cached = cache_.Get(PageCache::Key(layer, head, b), !prefetch)) {
      (*out)[b] = cached;
      if (stats) stats->cache_hits++;
      continue;
    }
    if (!pt) {
      pt = fetch.add_tables();
      pt->set_layer(layer);
      pt->set_kv_head(head);
    }
    pt->add_blocks(b);
  }
  if (!pt) return Status::OK();
  std::vector<v1::Page> got;
  RETURN_IF_ERROR(client_->FetchPages(fetch, &got));
  uint64_t wire_total = 0;
  for (const auto& p : got) {
    const uint64_t wire = p.k().size() + p.v().size();
    wire_total += wire;
    if (stats) {
      stats->bytes_received += wire;
      stats->pages++;
    }
    ASSIGN_OR_RETURN(auto page, DecodePage(p, d_));  // crc32c and size checked
    cache_.Put(PageCache::Key(layer, head, p.block()), page, prefetch, wire);
    (*out)[p.block()] = std::move(page);
  }
  if (prefetch) {
    cache_.UpdateStats([&](PageCacheStats* st) {
      st->prefetched_pages += got.size();
      st->prefetched_bytes += wire_total;
    });
  }
  return Status::OK();
}

Status ClientModeSession::Step(uint32_t layer, const float* queries, SelectedKV* out) {
  if (layer >= n_layers_) {
    return InvalidArgumentError("layer " + std::to_string(layer) + " out of range");
  }
  // Query-independent methods: layer + 1's pages are known now; fetch them
  // while this layer is served and attended.
  if (PrefetchEnabled() && query_independent_ && layer + 1 < n_layers_ &&
      !prefetcher_->Pending(layer + 1)) {
    prefetcher_->Enqueue(Prefetcher::Job{layer + 1, {}});
  }
  prefetcher_->Wait(layer);
  *out = SelectedKV();
  out->heads.resize(n_kv_);
  step_stats_ = out;
  struct ResetStats {
    SelectedKV** p;
    ~ResetStats() { *p = nullptr; }
  } reset{&step_stats_};
  const size_t group_floats = size_t{n_q_ / n_kv_} * d_;
  session::HeadStep step;
  for (uint32_t h = 0; h < n_kv_; ++h) {
    auto& head = out->heads[h];
    RETURN_IF_ERROR(core_->PlanHead(static_cast<int>(layer), static_cast<int>(h),
                                    queries + h * group_floats, &step, nullptr));
    session::PageMap pages;
    RETURN_IF_ERROR(core_->LoadPages(static_cast<int>(layer), static_cast<int>(h), step, &pages));
    head.per_q_head = std::move(step.per_q_head);
    head.estimated_mass = std::move(step.estimated_mass);
    head.pages = std::move(step.pages);
    for (const auto& sq : head.per_q_head) head.ids.insert(head.ids.end(), sq.begin(), sq.end());
    std::sort(head.ids.begin(), head.ids.end());
    head.ids.erase(std::unique(head.ids.begin(), head.ids.end()), head.ids.end());
    FillHead(pages, block_, d_, &head);
  }
  return Status::OK();
}

Status ClientModeSession::Prefetch(uint32_t layer, const float* predicted_queries) {
  if (layer >= n_layers_) {
    return InvalidArgumentError("layer " + std::to_string(layer) + " out of range");
  }
  if (!PrefetchEnabled()) return Status::OK();  // disabled or closed
  Prefetcher::Job job;
  job.layer = layer;
  if (!query_independent_) {
    if (predicted_queries == nullptr) {
      return InvalidArgumentError("Prefetch: predicted queries are null (method " +
                                  options_.method + " selects by query)");
    }
    job.queries.assign(predicted_queries, predicted_queries + size_t{n_q_} * d_);
  }
  prefetcher_->Enqueue(std::move(job));
  return Status::OK();
}

Status ClientModeSession::RunPrefetch(const Prefetcher::Job& job) {
  std::vector<float> zeros;
  const float* queries = job.queries.data();
  if (job.queries.empty()) {  // query-independent method: any finite queries
    zeros.assign(size_t{n_q_} * d_, 0.f);
    queries = zeros.data();
  }
  const uint32_t layer = job.layer;
  for (uint32_t h = 0; h < n_kv_; ++h) {
    const size_t slot = size_t{layer} * n_kv_ + h;
    if (!pred_selectors_[slot]) {
      // No job of this layer runs concurrently with a Step or Append that
      // mutates the core's selector (Step waits for its layer's jobs,
      // Append for all), so this read is safe.
      pred_selectors_[slot] =
          core_->selector(static_cast<int>(layer), static_cast<int>(h))->Clone();
      pred_bytes_[slot] = pred_selectors_[slot]->MemoryBytes();
      cache_.UpdateStats(
          [&](PageCacheStats* st) { st->prefetch_selector_bytes += pred_bytes_[slot]; });
    }
    session::HeadStep step;
    RETURN_IF_ERROR(core_->PlanHeadWith(static_cast<int>(layer), pred_selectors_[slot].get(),
                                        pred_key_sources_[slot].get(),
                                        queries + size_t{h} * (n_q_ / n_kv_) * d_, &step,
                                        nullptr));
    session::PageMap pages;
    RETURN_IF_ERROR(pred_fetcher_.Fetch(static_cast<int>(layer), static_cast<int>(h),
                                        step.pages_with_stored(), &pages));
  }
  return Status::OK();
}

Status ClientModeSession::Append(const float* k, const float* v, const float* q) {
  // Appending changes the selectors and the sequence that prefetch jobs read.
  prefetcher_->Wait(-1);
  RETURN_IF_ERROR(stream_.Append(k, v, q, info_.model()));
  RETURN_IF_ERROR(core_->Append(k, v, q));
  const uint32_t g = n_q_ / n_kv_;
  for (uint32_t l = 0; l < n_layers_; ++l) {
    for (uint32_t h = 0; h < n_kv_; ++h) {
      const size_t slot = size_t{l} * n_kv_ + h;
      if (!pred_selectors_[slot]) continue;
      // The prediction copy follows the same tokens; one that fails is
      // dropped (cloned again at the next Prefetch of the layer).
      const float* qp = q ? q + (size_t{l} * n_q_ + size_t{h} * g) * d_ : nullptr;
      if (!pred_selectors_[slot]->Append(k + slot * d_, v + slot * d_, qp).ok()) {
        cache_.UpdateStats(
            [&](PageCacheStats* st) { st->prefetch_selector_bytes -= pred_bytes_[slot]; });
        pred_selectors_[slot].reset();
      }
    }
  }
  return Status::OK();
}

}  // namespace

StatusOr<std::unique_ptr<DecodeSession>> OpenClientModeSession(Client* client,
                                                               v1::DecodeService::Stub* stub,
                                                               const SessionOptions& options) {
  auto s = std::make_unique<ClientModeSession>(client, stub, options);
  RETURN_IF_ERROR(s->Open());
  return std::unique_ptr<DecodeSession>(std::move(s));
}

}  // namespace ctxcache::client::internal
