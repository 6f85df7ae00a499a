// Implementation of the ctxcache SDK (client/include/ctxcache/client.h).
#include "ctxcache/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <list>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>

#include "common/crc32c.h"
#include "common/dtype.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"
#include "index/page_table.h"
#include "index/selector.h"
#include "index/methods.h"
#include "index/session_params.h"
#include "session/page_fetcher.h"
#include "session/sparse_session.h"
#include "proto/dtype_convert.h"

namespace ctxcache::client {

namespace {

Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return Status::OK();
  return Status(static_cast<StatusCode>(s.error_code()), what + ": " + s.error_message());
}

std::chrono::system_clock::time_point Deadline(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
}

StatusOr<DType> PageDType(v1::DType d) {
  auto dt = FromProtoDType(d);
  if (!dt.ok()) return DataLossError("page " + std::string(dt.status().message()));
  return *dt;
}

Status CheckPage(const v1::Page& p, uint32_t head_dim) {
  uint32_t crc = crc32c::Value(p.k(), p.v());
  if (crc != p.crc32c()) {
    return DataLossError("page crc32c mismatch (layer " + std::to_string(p.layer()) + ", kv head " +
                         std::to_string(p.kv_head()) + ", block " + std::to_string(p.block()) +
                         "): the page was corrupted in transit");
  }
  ASSIGN_OR_RETURN(DType dt, PageDType(p.dtype()));
  size_t want = size_t{p.n_tokens()} * head_dim * DTypeSize(dt);
  if (p.k().size() != want || p.v().size() != want) {
    return DataLossError("page of block " + std::to_string(p.block()) + " has the wrong size");
  }
  return Status::OK();
}

using session::DecodedPage;
using session::PageMap;
using session::PageRef;

StatusOr<PageRef> DecodePage(const v1::Page& p, uint32_t head_dim) {
  RETURN_IF_ERROR(CheckPage(p, head_dim));
  ASSIGN_OR_RETURN(DType dt, PageDType(p.dtype()));
  auto out = std::make_shared<DecodedPage>();
  out->n_tokens = p.n_tokens();
  out->k.resize(size_t{p.n_tokens()} * head_dim);
  out->v.resize(out->k.size());
  ConvertToFloat(dt, p.k().data(), out->k.data(), out->k.size());
  ConvertToFloat(dt, p.v().data(), out->v.data(), out->v.size());
  return out;
}

// LRU cache of decoded stored pages, keyed by (layer, kv head, block).
// Thread-safe (one mutex): the session's prefetch thread fills it while Step
// reads it. Pages a prefetch brought are marked until a Step first uses
// them (PageCacheStats::prefetch_hits).
class PageCache {
 public:
  explicit PageCache(size_t budget) : budget_(budget) {}

  // A Step's look-up: counts a hit or a miss (and a prefetch hit on the
  // first use of a prefetched page). `count` false (prefetch look-ups):
  // counts nothing and keeps the prefetch mark. Both refresh the LRU.
  PageRef Get(uint64_t key, bool count = true) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) {
      if (count) stats_.misses++;
      return nullptr;
    }
    Entry& e = it->second;
    if (count) {
      stats_.hits++;
      if (e.prefetched) {
        e.prefetched = false;
        stats_.prefetch_hits++;
        stats_.prefetch_hit_bytes += e.wire_bytes;
      }
    }
    lru_.splice(lru_.begin(), lru_, e.lru);
    return e.page;
  }

  // Inserts (no-op when present or larger than the budget), evicting from
  // the LRU end to stay within the budget. `prefetched`: brought by a
  // prefetch; `wire_bytes`: its payload bytes on the wire.
  void Put(uint64_t key, PageRef page, bool prefetched = false,
           uint64_t wire_bytes = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (page->bytes() > budget_ || map_.count(key)) return;
    while (stats_.bytes + page->bytes() > budget_ && !lru_.empty()) {
      uint64_t victim = lru_.back();
      lru_.pop_back();
      stats_.bytes -= map_[victim].page->bytes();
      map_.erase(victim);
      stats_.evictions++;
    }
    lru_.push_front(key);
    stats_.bytes += page->bytes();
    map_[key] = Entry{std::move(page), lru_.begin(), prefetched, wire_bytes};
  }

  PageCacheStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  // Updates the counters under the cache's lock (prefetch bookkeeping).
  template <typename Fn>
  void UpdateStats(Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    fn(&stats_);
  }

  static uint64_t Key(uint32_t layer, uint32_t head, uint32_t block) {
    return (uint64_t{layer} << 48) | (uint64_t{head} << 32) | block;
  }

 private:
  struct Entry {
    PageRef page;
    std::list<uint64_t>::iterator lru;
    bool prefetched = false;
    uint64_t wire_bytes = 0;
  };
  const size_t budget_;
  mutable std::mutex mu_;
  std::list<uint64_t> lru_;
  std::unordered_map<uint64_t, Entry> map_;
  PageCacheStats stats_;
};

// Selection does not depend on the queries: Step(l) can prefetch layer l+1.
bool QueryIndependent(const std::string& method) {
  auto info = index::FindMethodInfo(method);
  return info.ok() && (*info)->query_independent;
}

// Gathers the K/V of head.ids from pages (block -> decoded page).
void FillHead(const PageMap& pages, uint32_t block_tokens, uint32_t d, SelectedKV::Head* head) {
  head->k.resize(head->ids.size() * d);
  head->v.resize(head->ids.size() * d);
  for (size_t i = 0; i < head->ids.size(); ++i) {
    uint32_t id = static_cast<uint32_t>(head->ids[i]);
    const auto& page = pages.at(id / block_tokens);
    size_t row = size_t(id % block_tokens) * d;
    std::copy_n(page->k.data() + row, d, head->k.data() + i * d);
    std::copy_n(page->v.data() + row, d, head->v.data() + i * d);
  }
}

class ClientImpl;

class SessionImpl final : public DecodeSession {
 public:
  SessionImpl(ClientImpl* client, SessionOptions options)
      : client_(client), options_(std::move(options)), cache_(options_.page_cache_bytes) {}
  ~SessionImpl() override {
    StopPrefetcher();
    Close().IgnoreError();
  }

  Status Open();
  const v1::ContextInfo& context() const override { return info_; }
  int64_t n_tokens() const override { return n_tokens_; }
  Status Step(uint32_t layer, const float* queries, SelectedKV* out) override;
  Status Prefetch(uint32_t layer, const float* predicted_queries) override;
  Status Append(const float* k, const float* v, const float* q) override;
  Status Close() override;
  PageCacheStats page_cache_stats() const override { return cache_.stats(); }

 private:
  StatusOr<v1::DecodeResponse> RoundTrip(v1::DecodeRequest* req,
                                         std::vector<v1::PageBatch>* batches);
  Status ClientSelect(uint32_t layer, const float* queries, SelectedKV* out);
  // Stored pages of (layer, head), from the page cache or one batched
  // FetchPages for the missing ones. `prefetch`: on the prefetch thread
  // (look-ups are not counted as hits/misses; fetched pages are marked).
  Status StoredPages(uint32_t layer, uint32_t head, std::span<const uint32_t> blocks,
                     PageMap* out, SelectedKV* stats, bool prefetch = false);

  // Prefetch machinery (client mode). Jobs run in FIFO order on one
  // background thread, started lazily. Only the prefetch thread touches
  // pred_selectors_; Step(l) waits for jobs of layer l and Append / Close
  // wait for all, so the session state a job reads (selectors_ of its layer
  // for cloning, n_tokens_, app_k_) never changes under it.
  struct PrefetchJob {
    uint32_t layer = 0;
    std::vector<float> queries;  // empty for query-independent methods
  };
  bool PrefetchEnabled() const {
    return options_.mode == SelectMode::kClient && options_.prefetch && !closed_ && !pf_stop_;
  }
  void EnqueuePrefetch(PrefetchJob job);
  void PrefetchLoop();
  Status RunPrefetch(uint32_t layer, const float* queries);
  // Waits until no job of `layer` (all layers when layer < 0) is queued or
  // running; the wait counts in prefetch_wait_seconds.
  void WaitPrefetch(int64_t layer);
  void StopPrefetcher();

  // The session core's page source in client mode: the page cache, then
  // FetchPages. `prefetch`: the prefetch thread's (see StoredPages).
  class RemotePageFetcher final : public session::PageFetcher {
   public:
    RemotePageFetcher(SessionImpl* s, bool prefetch) : s_(s), prefetch_(prefetch) {}
    Status Fetch(int layer, int kv_head, std::span<const uint32_t> blocks,
                 PageMap* out) override {
      return s_->StoredPages(static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                             blocks, out, prefetch_ ? nullptr : s_->step_stats_, prefetch_);
    }

   private:
    SessionImpl* s_;
    bool prefetch_;
  };
  RemotePageFetcher fetcher_{this, false}, pred_fetcher_{this, true};
  // Client-select mode: the session core (selectors, appended KV, pipeline).
  std::unique_ptr<session::SparseSession> core_;
  // Key sources of the prediction selectors, [layer * n_kv + head].
  std::vector<std::unique_ptr<index::KeySource>> pred_key_sources_;
  SelectedKV* step_stats_ = nullptr;  // the Step in progress, for byte accounting

  ClientImpl* client_;
  SessionOptions options_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
  v1::ContextInfo info_;
  uint32_t n_layers_ = 0, n_q_ = 0, n_kv_ = 0, d_ = 0, block_ = 16;
  int64_t n_stored_ = 0, n_tokens_ = 0;
  uint64_t next_id_ = 1;
  PageCache cache_;
  bool closed_ = true;
  // Prediction copies for Prefetch, [layer * n_kv + head], cloned lazily.
  std::vector<std::unique_ptr<index::Selector>> pred_selectors_;
  std::vector<uint64_t> pred_bytes_;  // MemoryBytes() of each copy when cloned

  std::mutex pf_mu_;
  std::condition_variable pf_cv_;       // a job was queued, or stop
  std::condition_variable pf_done_cv_;  // a job finished
  std::deque<PrefetchJob> pf_queue_;
  std::vector<int> pf_pending_;  // per layer: queued + running jobs
  int pf_total_ = 0;
  bool pf_stop_ = false;
  std::thread pf_thread_;
};

class ClientImpl final : public Client {
 public:
  explicit ClientImpl(const ClientOptions& options) : options_(options) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.max_message_bytes);
    args.SetMaxSendMessageSize(options.max_message_bytes);
    channel_ = grpc::CreateCustomChannel(options.server, grpc::InsecureChannelCredentials(), args);
    admin_ = v1::ContextAdmin::NewStub(channel_);
    decode_ = v1::DecodeService::NewStub(channel_);
  }

  // Runs fn(ctx) with a fresh deadline, retrying UNAVAILABLE with backoff.
  template <typename Fn>
  grpc::Status WithRetry(Fn fn) {
    double backoff = options_.initial_backoff_s;
    grpc::Status s;
    for (int attempt = 1; attempt <= std::max(1, options_.max_attempts); ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(options_.timeout_s));
      s = fn(&ctx);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return s;
      if (attempt < options_.max_attempts) {
        std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(backoff * 1e6)));
        backoff = std::min(5.0, backoff * 2);
      }
    }
    return s;
  }

  std::string Unreachable(const grpc::Status& s) const {
    return "cannot reach ctxcached at " + options_.server + " (" + s.error_message() + ")";
  }

  Status Convert(const grpc::Status& s, const std::string& what) const {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) return UnavailableError(Unreachable(s));
    return FromGrpc(s, what);
  }

  template <typename Req>
  StatusOr<v1::BuildProgress> StreamBuild(
      const Req& request, const std::function<void(const v1::BuildProgress&)>& on_progress,
      bool extend) {
    v1::BuildProgress last;
    bool got_done = false;
    grpc::Status s = WithRetry([&](grpc::ClientContext* ctx) {
      // Builds can take long: no per-call deadline beyond a generous one.
      ctx->set_deadline(Deadline(std::max(options_.timeout_s, 3600.0)));
      std::unique_ptr<grpc::ClientReader<v1::BuildProgress>> reader;
      if constexpr (std::is_same_v<Req, v1::BuildContextRequest>) {
        reader = admin_->BuildContext(ctx, request);
      } else {
        reader = admin_->ExtendContext(ctx, request);
      }
      v1::BuildProgress p;
      while (reader->Read(&p)) {
        if (on_progress) on_progress(p);
        if (p.phase() == v1::BuildProgress::DONE) got_done = true;
        last = p;
      }
      return reader->Finish();
    });
    if (!s.ok()) return Convert(s, extend ? "ExtendContext" : "BuildContext");
    if (!got_done) return InternalError("build stream ended without a final message");
    return last;
  }

  StatusOr<v1::BuildProgress> Build(
      const v1::BuildContextRequest& request,
      const std::function<void(const v1::BuildProgress&)>& on_progress) override {
    return StreamBuild(request, on_progress, false);
  }
  StatusOr<v1::BuildProgress> Extend(
      const v1::ExtendContextRequest& request,
      const std::function<void(const v1::BuildProgress&)>& on_progress) override {
    return StreamBuild(request, on_progress, true);
  }

  StatusOr<v1::ContextInfo> GetContext(const std::string& id) override {
    v1::GetContextRequest req;
    req.set_context_id(id);
    v1::ContextInfo resp;
    auto s = WithRetry([&](grpc::ClientContext* c) { return admin_->GetContext(c, req, &resp); });
    if (!s.ok()) return Convert(s, "GetContext");
    return resp;
  }
  StatusOr<v1::ListContextsResponse> ListContexts(const v1::ListContextsRequest& req) override {
    v1::ListContextsResponse resp;
    auto s = WithRetry([&](grpc::ClientContext* c) { return admin_->ListContexts(c, req, &resp); });
    if (!s.ok()) return Convert(s, "ListContexts");
    return resp;
  }
  StatusOr<v1::EvictContextResponse> Evict(const std::string& id) override {
    v1::EvictContextRequest req;
    req.set_context_id(id);
    v1::EvictContextResponse resp;
    auto s = WithRetry([&](grpc::ClientContext* c) { return admin_->EvictContext(c, req, &resp); });
    if (!s.ok()) return Convert(s, "EvictContext");
    return resp;
  }
  StatusOr<v1::ContextInfo> Pin(const std::string& id, bool pinned) override {
    v1::PinContextRequest req;
    req.set_context_id(id);
    req.set_pinned(pinned);
    v1::ContextInfo resp;
    auto s = WithRetry([&](grpc::ClientContext* c) { return admin_->PinContext(c, req, &resp); });
    if (!s.ok()) return Convert(s, "PinContext");
    return resp;
  }
  StatusOr<v1::ServerStats> GetStats() override {
    v1::GetStatsRequest req;
    v1::ServerStats resp;
    auto s = WithRetry([&](grpc::ClientContext* c) { return admin_->GetStats(c, req, &resp); });
    if (!s.ok()) return Convert(s, "GetStats");
    return resp;
  }

  Status Watch(const v1::WatchRequest& request,
               const std::function<bool(const v1::ContextEvent&)>& on_event,
               double max_seconds) override {
    grpc::ClientContext ctx;
    if (max_seconds > 0) ctx.set_deadline(Deadline(max_seconds));
    auto reader = decode_->WatchContexts(&ctx, request);
    v1::ContextEvent ev;
    while (reader->Read(&ev)) {
      if (ev.type() == v1::ContextEvent::TYPE_UNSPECIFIED) continue;  // subscription marker
      if (!on_event(ev)) {
        ctx.TryCancel();
        break;
      }
    }
    grpc::Status s = reader->Finish();
    if (s.ok() || s.error_code() == grpc::StatusCode::CANCELLED ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return Status::OK();
    }
    return Convert(s, "WatchContexts");
  }

  StatusOr<std::map<std::pair<uint32_t, uint32_t>, std::string>> FetchIndex(
      const std::string& context_id, const std::string& method) override {
    std::map<std::pair<uint32_t, uint32_t>, std::string> out;
    v1::FetchIndexRequest req;
    req.set_context_id(context_id);
    req.add_methods(method);
    auto s = WithRetry([&](grpc::ClientContext* c) {
      out.clear();
      auto reader = decode_->FetchIndex(c, req);
      v1::IndexChunk chunk;
      while (reader->Read(&chunk)) {
        out[{chunk.layer(), chunk.kv_head()}] += chunk.data();
        auto& bytes = out[{chunk.layer(), chunk.kv_head()}];
        if (chunk.chunk_index() + 1 == chunk.n_chunks() &&
            (bytes.size() != chunk.total_bytes() || crc32c::Value(bytes) != chunk.crc32c())) {
          return grpc::Status(grpc::StatusCode::DATA_LOSS,
                              "index artifact crc32c mismatch (layer " +
                                  std::to_string(chunk.layer()) + ", kv head " +
                                  std::to_string(chunk.kv_head()) + ")");
        }
      }
      return reader->Finish();
    });
    if (!s.ok()) return Convert(s, "FetchIndex");
    return out;
  }

  Status FetchPages(const v1::FetchPagesRequest& request, std::vector<v1::Page>* pages) override {
    auto s = WithRetry([&](grpc::ClientContext* c) {
      pages->clear();
      auto reader = decode_->FetchPages(c, request);
      v1::PageBatch batch;
      while (reader->Read(&batch)) {
        for (auto& p : *batch.mutable_pages()) pages->push_back(std::move(p));
      }
      return reader->Finish();
    });
    if (!s.ok()) return Convert(s, "FetchPages");
    for (const auto& p : *pages) {
      if (crc32c::Value(p.k(), p.v()) != p.crc32c()) {
        return DataLossError("page crc32c mismatch (layer " + std::to_string(p.layer()) +
                             ", kv head " + std::to_string(p.kv_head()) + ", block " +
                             std::to_string(p.block()) + "): the page was corrupted in transit");
      }
    }
    return Status::OK();
  }

  StatusOr<std::unique_ptr<DecodeSession>> OpenSession(const SessionOptions& options) override {
    auto s = std::make_unique<SessionImpl>(this, options);
    RETURN_IF_ERROR(s->Open());
    return std::unique_ptr<DecodeSession>(std::move(s));
  }

  const ClientOptions& options() const override { return options_; }
  v1::DecodeService::Stub* decode_stub() { return decode_.get(); }

 private:
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ContextAdmin::Stub> admin_;
  std::unique_ptr<v1::DecodeService::Stub> decode_;
};

Status SessionImpl::Open() {
  v1::DecodeRequest req;
  req.mutable_open()->set_context_id(options_.context_id);
  req.mutable_open()->set_method(options_.method);
  for (const auto& [k, v] : options_.params) (*req.mutable_open()->mutable_params())[k] = v;
  req.mutable_open()->set_want_pages(options_.mode == SelectMode::kServer);
  // Opening the stream is retried on UNAVAILABLE (e.g. a server restart).
  double backoff = client_->options().initial_backoff_s;
  StatusOr<v1::DecodeResponse> resp = UnavailableError("not attempted");
  for (int attempt = 1; attempt <= std::max(1, client_->options().max_attempts); ++attempt) {
    ctx_ = std::make_unique<grpc::ClientContext>();
    stream_ = client_->decode_stub()->Decode(ctx_.get());
    closed_ = false;
    resp = RoundTrip(&req, nullptr);
    if (resp.ok() || resp.status().code() != StatusCode::kUnavailable) break;
    closed_ = true;
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(backoff * 1e6)));
    backoff = std::min(5.0, backoff * 2);
  }
  if (!resp.ok()) {
    closed_ = true;
    return resp.status();
  }
  info_ = resp->opened().context();
  n_layers_ = info_.model().n_layers();
  n_q_ = info_.model().n_q_heads();
  n_kv_ = info_.model().n_kv_heads();
  d_ = info_.model().head_dim();
  block_ = info_.block_tokens();
  n_stored_ = n_tokens_ = static_cast<int64_t>(info_.n_tokens());
  if (options_.mode == SelectMode::kClient) {
    // The server's parser (index/session_params.h): same defaults, same errors.
    ASSIGN_OR_RETURN(auto params, index::SessionParams::Parse(options_.method, options_.params,
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
        selectors.push_back(std::move(sel));
      }
    }
    session::SessionShape shape;
    shape.n_layers = static_cast<int>(n_layers_);
    shape.n_q_heads = static_cast<int>(n_q_);
    shape.n_kv_heads = static_cast<int>(n_kv_);
    shape.head_dim = static_cast<int>(d_);
    shape.page_size = static_cast<int>(block_);
    shape.n_stored = n_stored_;
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
    pf_pending_.assign(n_layers_, 0);
  }
  return Status::OK();
}

Status SessionImpl::StoredPages(uint32_t layer, uint32_t head, std::span<const uint32_t> wanted,
                                PageMap* out, SelectedKV* stats, bool prefetch) {
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
    (*out)[p.block()] = page;
  }
  if (prefetch) {
    cache_.UpdateStats([&](PageCacheStats* st) {
      st->prefetched_pages += got.size();
      st->prefetched_bytes += wire_total;
    });
  }
  return Status::OK();
}

StatusOr<v1::DecodeResponse> SessionImpl::RoundTrip(v1::DecodeRequest* req,
                                                    std::vector<v1::PageBatch>* batches) {
  if (closed_) return FailedPreconditionError("session is closed");
  req->set_request_id(next_id_++);
  if (!stream_->Write(*req)) {
    closed_ = true;
    grpc::Status s = stream_->Finish();
    return Status(s.ok() ? StatusCode::kUnavailable : static_cast<StatusCode>(s.error_code()),
                  "decode stream broke: " + s.error_message());
  }
  v1::DecodeResponse resp;
  if (!stream_->Read(&resp)) {
    closed_ = true;
    grpc::Status s = stream_->Finish();
    return Status(s.ok() ? StatusCode::kUnavailable : static_cast<StatusCode>(s.error_code()),
                  "decode stream ended: " + s.error_message());
  }
  if (resp.has_error()) {
    return Status(static_cast<StatusCode>(resp.error().code()), resp.error().message());
  }
  if (resp.has_step() && batches) {
    for (uint32_t i = 0; i < resp.step().n_page_batches(); ++i) {
      v1::DecodeResponse pr;
      if (!stream_->Read(&pr) || !pr.has_pages()) {
        closed_ = true;
        return UnavailableError("decode stream ended inside a page batch");
      }
      batches->push_back(std::move(*pr.mutable_pages()));
    }
  }
  return resp;
}

Status SessionImpl::Step(uint32_t layer, const float* queries, SelectedKV* out) {
  if (layer >= n_layers_) {
    return InvalidArgumentError("layer " + std::to_string(layer) + " out of range");
  }
  if (options_.mode == SelectMode::kClient) return ClientSelect(layer, queries, out);
  v1::DecodeRequest req;
  auto* t = req.mutable_step()->mutable_queries();
  req.mutable_step()->set_layer(layer);
  t->set_dtype(v1::DTYPE_F32);
  t->add_shape(n_q_);
  t->add_shape(d_);
  t->set_data(reinterpret_cast<const char*>(queries), size_t{n_q_} * d_ * sizeof(float));
  std::vector<v1::PageBatch> batches;
  ASSIGN_OR_RETURN(v1::DecodeResponse resp, RoundTrip(&req, &batches));
  const v1::StepResult& step = resp.step();
  const uint32_t g = n_q_ / n_kv_;
  *out = SelectedKV();
  out->heads.resize(n_kv_);
  for (auto& h : out->heads) h.per_q_head.resize(g);
  for (const auto& s : step.selections()) {
    auto& head = out->heads[s.q_head() / g];
    head.per_q_head[s.q_head() % g].assign(s.token_ids().begin(), s.token_ids().end());
  }
  for (const auto& t : step.page_tables()) {
    if (t.kv_head() >= n_kv_) return DataLossError("page table of kv head out of range");
    auto& pages = out->heads[t.kv_head()].pages;
    pages.insert(pages.end(), t.blocks().begin(), t.blocks().end());
  }
  for (auto& head : out->heads) {
    std::sort(head.pages.begin(), head.pages.end());
    head.pages.erase(std::unique(head.pages.begin(), head.pages.end()), head.pages.end());
  }
  std::vector<PageMap> pages(n_kv_);
  for (const auto& b : batches) {
    for (const auto& p : b.pages()) {
      out->bytes_received += p.k().size() + p.v().size();
      out->pages++;
      ASSIGN_OR_RETURN(auto page, DecodePage(p, d_));
      pages[p.kv_head()][p.block()] = page;
    }
  }
  for (uint32_t h = 0; h < n_kv_; ++h) {
    auto& head = out->heads[h];
    for (const auto& sel : head.per_q_head) head.ids.insert(head.ids.end(), sel.begin(), sel.end());
    std::sort(head.ids.begin(), head.ids.end());
    head.ids.erase(std::unique(head.ids.begin(), head.ids.end()), head.ids.end());
    for (int32_t id : head.ids) {
      if (!pages[h].count(static_cast<uint32_t>(id) / block_)) {
        return DataLossError("server selected token " + std::to_string(id) +
                             " but sent no page for it");
      }
    }
    FillHead(pages[h], block_, d_, &head);
  }
  return Status::OK();
}

Status SessionImpl::ClientSelect(uint32_t layer, const float* queries, SelectedKV* out) {
  // Query-independent methods: layer + 1's pages are known now; fetch them
  // while this layer is served and attended.
  if (PrefetchEnabled() && QueryIndependent(options_.method) && layer + 1 < n_layers_) {
    bool pending;
    {
      std::lock_guard<std::mutex> lock(pf_mu_);
      pending = pf_pending_[layer + 1] > 0;
    }
    if (!pending) EnqueuePrefetch(PrefetchJob{layer + 1, {}});
  }
  WaitPrefetch(layer);
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
    PageMap pages;
    RETURN_IF_ERROR(core_->LoadPages(static_cast<int>(layer), static_cast<int>(h), step, &pages));
    head.per_q_head = std::move(step.per_q_head);
    head.pages = std::move(step.pages);
    for (const auto& sq : head.per_q_head) head.ids.insert(head.ids.end(), sq.begin(), sq.end());
    std::sort(head.ids.begin(), head.ids.end());
    head.ids.erase(std::unique(head.ids.begin(), head.ids.end()), head.ids.end());
    FillHead(pages, block_, d_, &head);
  }
  return Status::OK();
}

Status SessionImpl::Prefetch(uint32_t layer, const float* predicted_queries) {
  if (layer >= n_layers_) {
    return InvalidArgumentError("layer " + std::to_string(layer) + " out of range");
  }
  if (!PrefetchEnabled()) return Status::OK();  // server mode / disabled / closed
  PrefetchJob job;
  job.layer = layer;
  if (!QueryIndependent(options_.method)) {
    if (predicted_queries == nullptr) {
      return InvalidArgumentError("Prefetch: predicted queries are null (method " +
                                  options_.method + " selects by query)");
    }
    job.queries.assign(predicted_queries, predicted_queries + size_t{n_q_} * d_);
  }
  EnqueuePrefetch(std::move(job));
  return Status::OK();
}

void SessionImpl::EnqueuePrefetch(PrefetchJob job) {
  std::lock_guard<std::mutex> lock(pf_mu_);
  if (pf_stop_) return;
  pf_pending_[job.layer]++;
  pf_total_++;
  pf_queue_.push_back(std::move(job));
  if (!pf_thread_.joinable()) pf_thread_ = std::thread([this] { PrefetchLoop(); });
  pf_cv_.notify_one();
}

void SessionImpl::PrefetchLoop() {
  std::unique_lock<std::mutex> lock(pf_mu_);
  while (true) {
    pf_cv_.wait(lock, [&] { return pf_stop_ || !pf_queue_.empty(); });
    if (pf_queue_.empty()) return;  // stopping
    PrefetchJob job = std::move(pf_queue_.front());
    pf_queue_.pop_front();
    lock.unlock();
    Status s = RunPrefetch(job.layer, job.queries.empty() ? nullptr : job.queries.data());
    cache_.UpdateStats([&](PageCacheStats* st) {
      st->prefetch_requests++;
      if (!s.ok()) st->prefetch_failures++;
    });
    lock.lock();
    pf_pending_[job.layer]--;
    pf_total_--;
    pf_done_cv_.notify_all();
  }
}

Status SessionImpl::RunPrefetch(uint32_t layer, const float* queries) {
  std::vector<float> zeros;
  if (queries == nullptr) {  // query-independent method: any finite queries
    zeros.assign(size_t{n_q_} * d_, 0.f);
    queries = zeros.data();
  }
  for (uint32_t h = 0; h < n_kv_; ++h) {
    const size_t slot = size_t{layer} * n_kv_ + h;
    if (!pred_selectors_[slot]) {
      // No job of this layer runs concurrently with a Step or Append that
      // mutates selectors_[slot] (see the class comment), so this read is safe.
      pred_selectors_[slot] = core_->selector(static_cast<int>(layer), static_cast<int>(h))->Clone();
      pred_bytes_[slot] = pred_selectors_[slot]->MemoryBytes();
      cache_.UpdateStats(
          [&](PageCacheStats* st) { st->prefetch_selector_bytes += pred_bytes_[slot]; });
    }
    session::HeadStep step;
    RETURN_IF_ERROR(core_->PlanHeadWith(static_cast<int>(layer), pred_selectors_[slot].get(),
                                        pred_key_sources_[slot].get(),
                                        queries + size_t{h} * (n_q_ / n_kv_) * d_, &step,
                                        nullptr));
    PageMap pages;
    RETURN_IF_ERROR(pred_fetcher_.Fetch(static_cast<int>(layer), static_cast<int>(h),
                                        step.pages_with_stored(), &pages));
  }
  return Status::OK();
}

void SessionImpl::WaitPrefetch(int64_t layer) {
  std::unique_lock<std::mutex> lock(pf_mu_);
  auto idle = [&] { return layer < 0 ? pf_total_ == 0 : pf_pending_[layer] == 0; };
  if (pf_pending_.empty() || idle()) return;
  const auto t0 = std::chrono::steady_clock::now();
  pf_done_cv_.wait(lock, idle);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  lock.unlock();
  cache_.UpdateStats([&](PageCacheStats* st) { st->prefetch_wait_seconds += waited; });
}

void SessionImpl::StopPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(pf_mu_);
    pf_stop_ = true;
    // Queued jobs are dropped; the running one finishes (its FetchPages has
    // the client's deadline).
    for (const auto& job : pf_queue_) {
      pf_pending_[job.layer]--;
      pf_total_--;
    }
    pf_queue_.clear();
    pf_cv_.notify_all();
  }
  if (pf_thread_.joinable()) pf_thread_.join();
}

Status SessionImpl::Append(const float* k, const float* v, const float* q) {
  v1::DecodeRequest req;
  auto* a = req.mutable_append();
  auto set = [&](v1::Tensor* t, const float* data, uint32_t heads) {
    t->set_dtype(v1::DTYPE_F32);
    t->add_shape(n_layers_);
    t->add_shape(heads);
    t->add_shape(d_);
    t->set_data(reinterpret_cast<const char*>(data), size_t{n_layers_} * heads * d_ * 4);
  };
  set(a->mutable_k(), k, n_kv_);
  set(a->mutable_v(), v, n_kv_);
  if (q) set(a->mutable_q(), q, n_q_);
  // Appending changes the selectors and n_tokens_ that prefetch jobs read.
  WaitPrefetch(-1);
  ASSIGN_OR_RETURN(v1::DecodeResponse resp, RoundTrip(&req, nullptr));
  (void)resp;
  if (options_.mode == SelectMode::kClient) {
    RETURN_IF_ERROR(core_->Append(k, v, q));
    const uint32_t g = n_q_ / n_kv_;
    for (uint32_t l = 0; l < n_layers_; ++l) {
      for (uint32_t h = 0; h < n_kv_; ++h) {
        const size_t slot = size_t{l} * n_kv_ + h;
        const float* kp = k + slot * d_;
        const float* vp = v + slot * d_;
        const float* qp = q ? q + (size_t{l} * n_q_ + size_t{h} * g) * d_ : nullptr;
        // The prediction copy follows the same tokens; one that fails is
        // dropped (cloned again at the next Prefetch of the layer).
        if (pred_selectors_[slot] && !pred_selectors_[slot]->Append(kp, vp, qp).ok()) {
          cache_.UpdateStats(
              [&](PageCacheStats* st) { st->prefetch_selector_bytes -= pred_bytes_[slot]; });
          pred_selectors_[slot].reset();
        }
      }
    }
  }
  n_tokens_++;
  return Status::OK();
}

Status SessionImpl::Close() {
  StopPrefetcher();
  if (closed_) return Status::OK();
  v1::DecodeRequest req;
  req.mutable_close();
  auto resp = RoundTrip(&req, nullptr);
  closed_ = true;
  stream_->WritesDone();
  grpc::Status s = stream_->Finish();
  if (!resp.ok()) return resp.status();
  return FromGrpc(s, "Decode");
}

}  // namespace

StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.server.empty()) return InvalidArgumentError("server address is empty");
  if (options.timeout_s <= 0) return InvalidArgumentError("timeout_s must be > 0");
  return std::unique_ptr<Client>(new ClientImpl(options));
}

}  // namespace ctxcache::client
