// The ctxcache SDK's Client (client/include/ctxcache/client.h): admin and
// fetch RPCs with retries. Sessions: client/sdk/sessions.h.
#include "ctxcache/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "client/sdk/channel.h"
#include "client/sdk/ingest.h"
#include "client/sdk/kv_load.h"
#include "client/sdk/kv_map.h"
#include "client/sdk/retry.h"
#include "client/sdk/routing_client.h"
#include "client/sdk/sessions.h"
#include "common/crc32c.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"

namespace ctxcache::client {

namespace {

using internal::DeadlineAfter;
using internal::FromGrpc;

class ClientImpl final : public Client {
 public:
  ClientImpl(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel)
      : options_(options), channel_(std::move(channel)) {
    admin_ = v1::ContextAdmin::NewStub(channel_);
    decode_ = v1::DecodeService::NewStub(channel_);
  }

  // Runs fn(ctx) with a fresh context and deadline per attempt, retrying
  // UNAVAILABLE with backoff (client/sdk/retry.h).
  template <typename Fn>
  grpc::Status WithRetry(Fn fn) {
    return internal::RetryUnavailable(options_, [&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineAfter(options_.timeout_s));
      internal::AddCallCredentials(options_, &ctx);
      return fn(&ctx);
    });
  }

  // One attempt, for calls that are not idempotent.
  template <typename Fn>
  grpc::Status Once(Fn fn) {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineAfter(options_.timeout_s));
    internal::AddCallCredentials(options_, &ctx);
    return fn(&ctx);
  }

  Status Convert(const grpc::Status& s, const std::string& what) const {
    return internal::FromGrpcCall(options_, s, what);
  }

  template <typename Req>
  StatusOr<v1::BuildProgress> StreamBuild(
      const Req& request, const std::function<void(const v1::BuildProgress&)>& on_progress,
      bool extend) {
    v1::BuildProgress last;
    bool got_done = false;
    grpc::Status s = WithRetry([&](grpc::ClientContext* ctx) {
      // Builds can take long: no per-call deadline beyond a generous one.
      ctx->set_deadline(DeadlineAfter(std::max(options_.timeout_s, 3600.0)));
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
    // Not retried: a retry after an eviction that reached the server would
    // fail with NOT_FOUND.
    auto s = Once([&](grpc::ClientContext* c) { return admin_->EvictContext(c, req, &resp); });
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
  StatusOr<v1::ContextInfo> Share(const std::string& id, bool shared) override {
    v1::ShareContextRequest req;
    req.set_context_id(id);
    req.set_shared(shared);
    v1::ContextInfo resp;
    auto s =
        WithRetry([&](grpc::ClientContext* c) { return admin_->ShareContext(c, req, &resp); });
    if (!s.ok()) return Convert(s, "ShareContext");
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
    internal::AddCallCredentials(options_, &ctx);
    if (max_seconds > 0) ctx.set_deadline(DeadlineAfter(max_seconds));
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

  using Client::FetchIndex;
  StatusOr<std::map<std::pair<uint32_t, uint32_t>, std::string>> FetchIndex(
      const std::string& context_id, const std::string& method,
      const std::vector<uint32_t>& layers) override {
    std::map<std::pair<uint32_t, uint32_t>, std::string> out;
    v1::FetchIndexRequest req;
    req.set_context_id(context_id);
    req.add_methods(method);
    req.mutable_layers()->Add(layers.begin(), layers.end());
    v1::DecodeService::Stub* stub = NextBulk();
    auto s = WithRetry([&](grpc::ClientContext* c) {
      out.clear();
      auto reader = stub->FetchIndex(c, req);
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
    v1::DecodeService::Stub* stub = NextBulk();
    auto s = WithRetry([&](grpc::ClientContext* c) {
      pages->clear();
      auto reader = stub->FetchPages(c, request);
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

  // Concurrent FetchIndex and FetchPages calls take the bulk connections in
  // turn instead of sharing one: on the shared connection a worker fetching
  // a step's pages as 8 concurrent calls got 0.5-1.1 GB/s (8B shape, 128K
  // tokens, loopback, 16-core host), where FetchKV's streams, a connection
  // each, get 5 GB/s.
  static constexpr int kPageConnections = 8;

  // Bulk connection i (made on first use); the shared one if it cannot be made.
  v1::DecodeService::Stub* BulkStub(int i) {
    std::lock_guard<std::mutex> l(bulk_mu_);
    while (bulk_.size() <= static_cast<size_t>(i)) {
      auto channel = internal::MakeChannel(options_, static_cast<int>(bulk_.size()));
      if (!channel.ok()) return decode_.get();
      bulk_.push_back(v1::DecodeService::NewStub(*channel));
    }
    return bulk_[i].get();
  }
  v1::DecodeService::Stub* NextBulk() {
    return BulkStub(static_cast<int>(next_bulk_.fetch_add(1) % kPageConnections));
  }

  Status FetchPagesInto(const v1::FetchPagesRequest& request, const KVLayout& layout) override {
    ASSIGN_OR_RETURN(v1::ContextInfo info, GetContext(request.context_id()));
    RETURN_IF_ERROR(internal::CheckKVLoad(info, KVLoadOptions{}, layout).status());
    RETURN_IF_ERROR(internal::CheckPageTables(info, request));
    return internal::FetchTablesInto(options_, NextBulk(), info, request, layout);
  }

  StatusOr<std::unique_ptr<KVLoad>> StartLoadKV(const std::string& context_id,
                                                const KVLoadOptions& options,
                                                const KVLayout& layout) override {
    ASSIGN_OR_RETURN(v1::ContextInfo info, GetContext(context_id));
    ASSIGN_OR_RETURN(std::vector<uint32_t> layers, internal::CheckKVLoad(info, options, layout));
    const int streams = std::min<int>(options.streams, static_cast<int>(layers.size()));
    {
      std::lock_guard<std::mutex> l(bulk_mu_);
      while (bulk_.size() < static_cast<size_t>(streams)) {
        ASSIGN_OR_RETURN(auto channel,
                         internal::MakeChannel(options_, static_cast<int>(bulk_.size())));
        bulk_.push_back(v1::DecodeService::NewStub(channel));
      }
    }
    return internal::StartKVLoad(options_, info, std::move(layers), options, layout,
                                 [this](int i) {
                                   std::lock_guard<std::mutex> l(bulk_mu_);
                                   return bulk_[i].get();
                                 });
  }

  StatusOr<std::unique_ptr<KVMapping>> MapKV(const std::string& context_id,
                                             const std::vector<uint32_t>& layers) override {
    return internal::OpenKVMapping(options_, decode_.get(), context_id, layers);
  }

  StatusOr<std::unique_ptr<IngestStream>> StartIngest(const v1::IngestHeader& header,
                                                      const IngestOptions& options) override {
    v1::IngestHeader h = header;
    internal::IngestShape shape;
    if (!h.parent_id().empty()) {
      if (options.parent_tokens >= 0) {
        shape.token_start = static_cast<uint64_t>(options.parent_tokens);
      }
      if (options.parent_tokens < 0 || !h.has_model()) {
        StatusOr<v1::ContextInfo> parent = GetContext(h.parent_id());
        if (!parent.ok()) return parent.status().WithContext("header.parent_id");
        if (options.parent_tokens < 0) shape.token_start = parent->n_tokens();
        if (!h.has_model()) *h.mutable_model() = parent->model();
      }
    }
    const v1::ModelSpec& m = h.model();
    shape.n_layers = m.n_layers();
    shape.n_kv_heads = m.n_kv_heads();
    shape.n_q_heads = m.n_q_heads();
    shape.head_dim = m.head_dim();
    shape.n_tokens = static_cast<uint64_t>(h.tokens().ids_size());
    if (shape.n_tokens == 0) return InvalidArgumentError("header.tokens: empty");
    for (auto [name, value] : {std::pair<const char*, uint32_t>{"n_layers", shape.n_layers},
                               {"n_kv_heads", shape.n_kv_heads},
                               {"n_q_heads", shape.n_q_heads},
                               {"head_dim", shape.head_dim}}) {
      if (value == 0) {
        return InvalidArgumentError(std::string("header.model.") + name + ": 0, expected > 0");
      }
    }
    return internal::OpenIngest(options_, admin_.get(), h, shape, options);
  }

  StatusOr<std::unique_ptr<DecodeSession>> OpenSession(const SessionOptions& options) override {
    ASSIGN_OR_RETURN(SessionConn * conn, TakeSessionRoom());
    auto release = [this, conn] {
      std::lock_guard<std::mutex> l(session_mu_);
      --conn->open;
    };
    StatusOr<std::unique_ptr<DecodeSession>> s =
        options.mode == SelectMode::kClient
            ? internal::OpenClientModeSession(this, conn->stub, options)
            : internal::OpenServerModeSession(this, conn->stub, options);
    if (!s.ok()) {
      release();
      return s.status();
    }
    return std::unique_ptr<DecodeSession>(
        new SlottedSession(std::move(s).value(), std::move(release)));
  }

  const ClientOptions& options() const override { return options_; }

 private:
  // A connection for decode sessions and its open session streams.
  struct SessionConn {
    v1::DecodeService::Stub* stub = nullptr;
    std::unique_ptr<v1::DecodeService::Stub> owned;
    int open = 0;
  };

  // A session that gives its connection's room back when closed or destroyed.
  class SlottedSession final : public DecodeSession {
   public:
    SlottedSession(std::unique_ptr<DecodeSession> inner, std::function<void()> release)
        : release_(std::move(release)), inner_(std::move(inner)) {}
    ~SlottedSession() override {
      inner_.reset();
      Release();
    }
    const v1::ContextInfo& context() const override { return inner_->context(); }
    int64_t n_tokens() const override { return inner_->n_tokens(); }
    Status Step(uint32_t layer, const float* queries, SelectedKV* out) override {
      return inner_->Step(layer, queries, out);
    }
    Status Prefetch(uint32_t layer, const float* predicted_queries) override {
      return inner_->Prefetch(layer, predicted_queries);
    }
    Status Append(const float* k, const float* v, const float* q) override {
      return inner_->Append(k, v, q);
    }
    Status Close() override {
      Status s = inner_->Close();
      Release();
      return s;
    }
    PageCacheStats page_cache_stats() const override { return inner_->page_cache_stats(); }

   private:
    void Release() {
      if (release_) std::exchange(release_, nullptr)();
    }
    std::function<void()> release_;
    std::unique_ptr<DecodeSession> inner_;
  };

  // The first session connection with room for a session stream (a new one
  // when all are full), its count taken. Sessions never use the client's own
  // connection: it stays free for the other calls (a client-mode session's
  // FetchIndex and FetchPages streams among them).
  StatusOr<SessionConn*> TakeSessionRoom() {
    std::lock_guard<std::mutex> l(session_mu_);
    SessionConn* conn = nullptr;
    for (auto& c : session_conns_) {
      if (c->open < std::max(1, options_.sessions_per_connection)) {
        conn = c.get();
        break;
      }
    }
    if (conn == nullptr) {
      // Connection numbers apart from the bulk loads' (0, 1, ...).
      const int number = kSessionConnectionBase + static_cast<int>(session_conns_.size());
      ASSIGN_OR_RETURN(auto channel, internal::MakeChannel(options_, number));
      auto c = std::make_unique<SessionConn>();
      c->owned = v1::DecodeService::NewStub(channel);
      c->stub = c->owned.get();
      conn = c.get();
      session_conns_.push_back(std::move(c));
    }
    ++conn->open;
    return conn;
  }

  static constexpr int kSessionConnectionBase = 1 << 16;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ContextAdmin::Stub> admin_;
  std::unique_ptr<v1::DecodeService::Stub> decode_;
  std::mutex session_mu_;
  std::vector<std::unique_ptr<SessionConn>> session_conns_;  // guarded by session_mu_
  // Stubs on connections of their own for bulk loads (created on first use).
  std::mutex bulk_mu_;
  std::vector<std::unique_ptr<v1::DecodeService::Stub>> bulk_;  // guarded by bulk_mu_
  std::atomic<uint32_t> next_bulk_{0};  // NextBulk's turn
};

}  // namespace

Status Client::LoadKV(const std::string& context_id, const KVLoadOptions& options,
                      const KVLayout& layout, KVLoadProgress* progress) {
  ASSIGN_OR_RETURN(std::unique_ptr<KVLoad> load, StartLoadKV(context_id, options, layout));
  Status s = load->Wait();
  if (progress != nullptr) *progress = load->progress();
  return s;
}

StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.server.empty()) return InvalidArgumentError("server address is empty");
  if (options.timeout_s <= 0) return InvalidArgumentError("timeout_s must be > 0");
  if (options.sessions_per_connection < 1) {
    return InvalidArgumentError("sessions_per_connection: " +
                                std::to_string(options.sessions_per_connection) +
                                ", expected >= 1");
  }
  if (options.server.rfind("etcd://", 0) == 0) return internal::ConnectCluster(options);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, internal::MakeChannel(options));
  return std::unique_ptr<Client>(new ClientImpl(options, std::move(channel)));
}

}  // namespace ctxcache::client
