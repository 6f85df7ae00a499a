#include "service/decode_service.h"

#include <malloc.h>
#include <unistd.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "auth/principal.h"
#include "common/clock.h"
#include "common/crc32c.h"
#include "index/methods.h"
#include "proto/page_tables.h"
#include "service/access.h"
#include "service/cluster_service.h"
#include "service/decode_session.h"
#include "service/grpc_status.h"
#include "service/kv_frames.h"
#include "service/rpc_metrics.h"
#include "service/wire.h"

namespace ctxcache::service {

namespace {

// A bulk request's layers: `requested` in order, or all ascending when
// empty. INVALID_ARGUMENT naming `layers` for one out of range or repeated.
StatusOr<std::vector<uint32_t>> LayerList(
    const google::protobuf::RepeatedField<uint32_t>& requested, uint32_t n_layers) {
  std::vector<uint32_t> layers(requested.begin(), requested.end());
  if (layers.empty()) {
    for (uint32_t l = 0; l < n_layers; ++l) layers.push_back(l);
  }
  std::vector<bool> seen(n_layers, false);
  for (uint32_t l : layers) {
    if (l >= n_layers) {
      return InvalidArgumentError("layers: " + std::to_string(l) + " out of range [0, " +
                                  std::to_string(n_layers) + ")");
    }
    if (seen[l]) return InvalidArgumentError("layers: " + std::to_string(l) + " given twice");
    seen[l] = true;
  }
  return layers;
}

v1::DecodeResponse ErrorResponse(uint64_t request_id, const Status& s) {
  v1::DecodeResponse r;
  r.set_request_id(request_id);
  r.mutable_error()->set_code(static_cast<int32_t>(s.code()));
  r.mutable_error()->set_message(std::string(s.message()));
  return r;
}

// Step: validate and convert the queries, run the session, convert the
// result and its pages (service/wire.h).
Status RunStep(DecodeSession* session, const v1::StepRequest& req, bool corrupt_pages,
               SessionStep* step, std::vector<float>* queries, v1::StepResult* result,
               std::vector<v1::PageBatch>* batches) {
  const session::SessionShape& sh = session->shape();
  if (req.layer() >= static_cast<uint32_t>(sh.n_layers)) {
    return InvalidArgumentError("step.layer " + std::to_string(req.layer()) + " out of range [0, " +
                                std::to_string(sh.n_layers) + ")");
  }
  RETURN_IF_ERROR(
      TensorToFloat(req.queries(), {sh.n_q_heads, sh.head_dim}, "step.queries", queries));
  RETURN_IF_ERROR(session->Step(req.layer(), queries->data(), step));
  const int g = sh.group_size();
  result->set_layer(step->layer);
  for (int h = 0; h < sh.n_kv_heads; ++h) {
    const session::HeadStep& hs = step->heads[h];
    for (const auto& t : hs.tables) {
      v1::PageTable* pt = result->add_page_tables();
      pt->set_layer(step->layer);
      pt->set_kv_head(static_cast<uint32_t>(h));
      pt->set_subgroup(static_cast<uint32_t>(t.subgroup));
      for (int32_t p : t.pages) pt->add_blocks(static_cast<uint32_t>(p));
    }
    for (int j = 0; j < g; ++j) {
      v1::HeadSelection* sel = result->add_selections();
      sel->set_q_head(static_cast<uint32_t>(h * g + j));
      for (int32_t id : hs.per_q_head[j]) sel->add_token_ids(static_cast<uint32_t>(id));
      if (static_cast<size_t>(j) < hs.estimated_mass.size()) {
        sel->set_estimated_mass(hs.estimated_mass[j]);
      }
    }
  }
  auto* st = result->mutable_stats();
  st->set_entries_touched(step->work.entries_touched);
  st->set_bytes_touched(step->work.bytes_touched);
  st->set_keys_scored(step->work.keys_scored);
  st->set_select_us(step->select_us);
  if (step->stored.empty()) return Status::OK();  // selection only (client mode)
  PageBatcher batcher(
      kMaxPageBatchBytes,
      [&](v1::PageBatch&& b) {
        batches->push_back(std::move(b));
        return true;
      },
      corrupt_pages);
  for (int h = 0; h < sh.n_kv_heads; ++h) {
    const storage::PageBatch& stored = step->stored[h];
    for (size_t i = 0; i < stored.size(); ++i) {
      batcher.Add(StoredPageToProto(stored, i, step->layer, static_cast<uint32_t>(h)));
    }
    for (const auto& [block, page] : step->assembled[h]) {
      batcher.Add(DecodedPageToProto(*page, static_cast<uint32_t>(sh.head_dim), step->layer,
                                     static_cast<uint32_t>(h), block));
    }
  }
  batcher.Finish();
  result->set_n_page_batches(static_cast<uint32_t>(batches->size()));
  return Status::OK();
}

// Append: validate and convert K, V (and Q), then stream them into the session.
Status RunAppend(DecodeSession* session, const v1::AppendRequest& append) {
  const session::SessionShape& sh = session->shape();
  std::vector<float> k, v, q;
  const int64_t L = sh.n_layers, KV = sh.n_kv_heads, D = sh.head_dim;
  RETURN_IF_ERROR(TensorToFloat(append.k(), {L, KV, D}, "append.k", &k));
  RETURN_IF_ERROR(TensorToFloat(append.v(), {L, KV, D}, "append.v", &v));
  const bool has_q = append.has_q() && !append.q().data().empty();
  if (has_q)
    RETURN_IF_ERROR(TensorToFloat(append.q(), {L, int64_t{sh.n_q_heads}, D}, "append.q", &q));
  return session->Append(k.data(), v.data(), has_q ? q.data() : nullptr);
}

// A slot under --max-sessions, reserved atomically (no check-then-increment
// race between concurrent Opens) and released on destruction.
class SessionSlot {
 public:
  explicit SessionSlot(ServiceContext* ctx) : ctx_(ctx) {}
  ~SessionSlot() {
    if (held_) ctx_->open_sessions--;
  }
  bool Reserve() {
    if (ctx_->open_sessions.fetch_add(1) >= ctx_->config.max_sessions) {
      ctx_->open_sessions--;
      return false;
    }
    held_ = true;
    return true;
  }
  void Release() {
    if (held_) ctx_->open_sessions--;
    held_ = false;
  }

 private:
  ServiceContext* ctx_;
  bool held_ = false;
};

// One Decode stream: its session, the slot it holds and the metrics of its
// steps. Handle() validates each request, runs it and writes the responses.
class DecodeStreamHandler {
 public:
  using WriteFn = std::function<bool(const v1::DecodeResponse&)>;
  DecodeStreamHandler(ServiceContext* ctx, std::string stream_name, auth::Principal principal)
      : ctx_(ctx),
        stream_name_(std::move(stream_name)),
        principal_(std::move(principal)),
        slot_(ctx),
        step_hist_(ctx->metrics.GetHistogram("ctxcache_decode_step_duration_seconds",
                                             "Server time per decode layer-step")),
        bytes_read_(ctx->metrics.GetCounter("ctxcache_page_bytes_read_total",
                                            "Stored page bytes read for decode sessions")),
        sessions_gauge_(ctx->metrics.GetGauge("ctxcache_open_sessions", "Open decode sessions")) {
    ctx->metrics
        .GetGauge("ctxcache_session_memory_budget_bytes",
                  "The session memory budget (--session-memory-mb; 0 = unlimited)")
        ->Set(static_cast<double>(ctx->session_memory.budget()));
  }
  ~DecodeStreamHandler() {
    if (session_) sessions_gauge_->Set(ctx_->open_sessions.load() - 1);
  }

  bool has_session() const { return session_ != nullptr; }

  // False once the stream is closed.
  bool Handle(const v1::DecodeRequest& req, const WriteFn& write) {
    const uint64_t rid = req.request_id();
    v1::DecodeResponse resp;
    resp.set_request_id(rid);
    Status s;
    switch (req.msg_case()) {
      case v1::DecodeRequest::kOpen:
        s = Open(req.open(), resp.mutable_opened());
        break;
      case v1::DecodeRequest::kStep:
        return Step(req.step(), rid, write);
      case v1::DecodeRequest::kAppend:
        s = session_ ? RunAppend(session_.get(), req.append())
                     : FailedPreconditionError("Append before Open");
        if (s.ok()) resp.mutable_appended()->set_n_tokens(uint64_t(session_->n_tokens()));
        break;
      case v1::DecodeRequest::kClose:
        resp.mutable_closed();
        write(resp);
        return false;
      default:
        s = InvalidArgumentError("DecodeRequest has none of open, step, append, close");
    }
    write(s.ok() ? resp : ErrorResponse(rid, s));
    return true;
  }

 private:
  Status Open(const v1::OpenSession& open, v1::SessionOpened* out) {
    if (session_) return FailedPreconditionError("session already open; Close it first");
    if (!slot_.Reserve()) {
      return ResourceExhaustedError("too many open sessions (limit --max-sessions=" +
                                    std::to_string(ctx_->config.max_sessions) + "); retry later");
    }
    Status s = OpenReserved(open, out);
    if (!s.ok()) slot_.Release();
    return s;
  }

  Status OpenReserved(const v1::OpenSession& open, v1::SessionOpened* out) {
    if (ctx_->config.fault_slow_open_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ctx_->config.fault_slow_open_ms));
    }
    ASSIGN_OR_RETURN(storage::ContextId id, ParseContextId(open.context_id()));
    ASSIGN_OR_RETURN(auto reader, AccessControl::OpenReader(ctx_->store.get(), principal_, id,
                                                            auth::Action::kRead));
    ASSIGN_OR_RETURN(QuotaGuard quota, ctx_->quotas->AdmitSession(principal_.tenant));
    std::map<std::string, std::string> params(open.params().begin(), open.params().end());
    DecodeSessionOptions options;
    options.indexes = &ctx_->indexes;
    options.pages = &ctx_->pages;
    options.budget = &ctx_->session_memory;
    options.max_appended_tokens = ctx_->config.max_appended_tokens;
    ASSIGN_OR_RETURN(session_, DecodeSession::Open(std::move(reader), open.method(), params,
                                                   open.want_pages(), options));
    session_quota_ = std::move(quota);
    sessions_gauge_->Set(ctx_->open_sessions.load());
    out->set_session_id(open.context_id() + "/" + stream_name_);
    *out->mutable_context() = ManifestToInfo(session_->manifest());
    return Status::OK();
  }

  bool Step(const v1::StepRequest& step, uint64_t rid, const WriteFn& write) {
    if (!session_) {
      write(ErrorResponse(rid, FailedPreconditionError("Step before Open")));
      return true;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t before = session_->bytes_served();
    v1::DecodeResponse resp;
    resp.set_request_id(rid);
    std::vector<v1::PageBatch> batches;
    Status s = RunStep(session_.get(), step, ctx_->config.fault_corrupt_pages, &step_buf_,
                       &query_buf_, resp.mutable_step(), &batches);
    if (!s.ok()) {
      write(ErrorResponse(rid, s));
      return true;
    }
    write(resp);
    for (auto& b : batches) {
      v1::DecodeResponse pr;
      pr.set_request_id(rid);
      *pr.mutable_pages() = std::move(b);
      write(pr);
    }
    step_hist_->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    bytes_read_->Inc(static_cast<double>(session_->bytes_served() - before));
    return true;
  }

  ServiceContext* ctx_;
  const std::string stream_name_;
  const auth::Principal principal_;
  SessionSlot slot_;
  QuotaGuard session_quota_;  // the tenant's max_sessions share
  std::unique_ptr<DecodeSession> session_;
  Histogram* step_hist_;
  Counter* bytes_read_;
  Gauge* sessions_gauge_;
  SessionStep step_buf_;
  std::vector<float> query_buf_;
};

// The reader of the context `id` for a server-streaming read RPC. When
// another node serves `id`, the whole call is forwarded there (`start` opens
// it on a peer's stub) and nullptr comes back with the forwarded call's
// status in *done; a refused forward or a reader that does not open also
// return nullptr, with their status in *done.
template <typename Req, typename Resp, typename StartFn>
std::unique_ptr<storage::ContextReader> ReaderOrForward(
    ServiceContext* ctx, grpc::ServerContext* context, const RpcScope& rpc, const char* method,
    const storage::ContextId& id, const Req& request, grpc::ServerWriter<Resp>* writer,
    StartFn start, grpc::Status* done) {
  grpc::Status refuse;
  if (auto target = ForwardTarget(ctx, context, id, &refuse)) {
    *done = ForwardServerStream(ctx, context, method, *target, request, writer, start);
    return nullptr;
  }
  if (!refuse.ok()) {
    *done = refuse;
    return nullptr;
  }
  auto reader =
      AccessControl::OpenReader(ctx->store.get(), rpc.principal(), id, auth::Action::kRead);
  if (!reader.ok()) {
    *done = ToGrpc(reader.status());
    return nullptr;
  }
  return std::move(reader).value();
}

}  // namespace

DecodeServiceImpl::DecodeServiceImpl(ServiceContext* ctx) : ctx_(ctx) {
  reaper_ = std::thread([this] { ReaperLoop(); });
}

DecodeServiceImpl::~DecodeServiceImpl() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  reaper_.join();
}

void DecodeServiceImpl::ReaperLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  size_t streams_at_trim = 0;
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::seconds(1));
    // Sessions free large buffers (selector tables, decoded pages); glibc
    // keeps freed memory in its arenas, so RSS would stay at the peak. Give
    // it back once streams have closed.
    if (streams_.size() < streams_at_trim) {
      lock.unlock();
      malloc_trim(0);
      lock.lock();
    }
    streams_at_trim = streams_.size();
    const int64_t limit = int64_t{ctx_->config.session_idle_timeout_s} * 1000;
    const int64_t open_limit = int64_t{ctx_->config.session_open_timeout_s} * 1000;
    const int64_t now = SteadyNowMs();
    for (auto& [key, s] : streams_) {
      if (!s->opened.load() && s->started_ms > 0 && now - s->started_ms > open_limit) {
        spdlog::info("cancelling a Decode stream that opened no session within {} s",
                     ctx_->config.session_open_timeout_s);
        s->context->TryCancel();
        s->started_ms = 0;  // once
        continue;
      }
      if (now - s->last_activity_ms.load() > limit) {
        spdlog::info("closing a decode session idle for more than {} s",
                     ctx_->config.session_idle_timeout_s);
        s->context->TryCancel();
        s->last_activity_ms = now;  // don't cancel twice a second
      }
    }
  }
}

void DecodeServiceImpl::CancelAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, s] : streams_) s->context->TryCancel();
}

grpc::Status DecodeServiceImpl::Decode(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) {
  const RpcSpec spec{"Decode", auth::Action::kRead, Admission::kStreamNotDraining};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto live = std::make_unique<LiveStream>();
    live->context = context;
    live->last_activity_ms = SteadyNowMs();
    live->started_ms = SteadyNowMs();
    LiveStream* key = live.get();
    {
      std::lock_guard<std::mutex> lock(mu_);
      streams_[key] = std::move(live);
    }
    struct Unregister {
      DecodeServiceImpl* self;
      LiveStream* key;
      ~Unregister() {
        std::lock_guard<std::mutex> lock(self->mu_);
        self->streams_.erase(key);
      }
    } unregister{this, key};

    DecodeStreamHandler handler(ctx_, std::to_string(reinterpret_cast<uintptr_t>(key)),
                                rpc.principal());
    v1::DecodeRequest req;
    bool have_first = stream->Read(&req);
    // The Open deadline covers the Open's arrival, not the index loading it
    // starts (a long context's tables take longer than the deadline).
    if (have_first && req.has_open()) key->opened = true;
    if (have_first && req.has_open()) {
      // A session on a context stored elsewhere in the cluster: proxy it.
      auto id = storage::ContextId::FromHex(req.open().context_id());
      grpc::Status refuse;
      if (id.ok()) {
        if (auto target = ForwardTarget(ctx_, context, *id, &refuse)) {
          key->opened = true;  // the idle and open timeouts see the proxied traffic
          return ForwardDecode(ctx_, context, *target, req, stream,
                               [key] { key->last_activity_ms = SteadyNowMs(); });
        }
      }
      if (!refuse.ok()) {  // answered; the stream may still open another session
        const Status s(static_cast<StatusCode>(refuse.error_code()), refuse.error_message());
        stream->Write(ErrorResponse(req.request_id(), s));
        have_first = stream->Read(&req);
      }
    }
    for (bool more = have_first; more; more = stream->Read(&req)) {
      key->last_activity_ms = SteadyNowMs();
      if (req.has_open()) key->opened = true;
      // A key revoked while the session is open ends it (docs/security.md).
      if (Status s = ctx_->access->Recheck(context, rpc.principal()); !s.ok()) {
        return ToGrpc(s);
      }
      if (Status s = ctx_->quotas->AdmitMessage(rpc.principal().tenant); !s.ok()) {
        stream->Write(ErrorResponse(req.request_id(), s));  // the session stays open
        continue;
      }
      if (!handler.Handle(req, [&](const v1::DecodeResponse& r) { return stream->Write(r); })) {
        return grpc::Status::OK;  // closed
      }
    }
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled or idle");
    }
    return grpc::Status::OK;
  });
}

grpc::Status DecodeServiceImpl::FetchIndex(grpc::ServerContext* context,
                                           const v1::FetchIndexRequest* request,
                                           grpc::ServerWriter<v1::IndexChunk>* writer) {
  const RpcSpec spec{"FetchIndex", auth::Action::kRead, Admission::kStream};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    grpc::Status done;
    auto reader = ReaderOrForward(
        ctx_, context, rpc, "FetchIndex", *id, *request, writer,
        [](auto ch, grpc::ClientContext* cc, const v1::FetchIndexRequest& r) {
          return v1::DecodeService::NewStub(ch)->FetchIndex(cc, r);
        },
        &done);
    if (reader == nullptr) return done;
    const v1::ContextManifest& m = reader->manifest();
    std::vector<uint32_t> layers(request->layers().begin(), request->layers().end());
    std::vector<uint32_t> heads(request->kv_heads().begin(), request->kv_heads().end());
    std::vector<std::string> methods(request->methods().begin(), request->methods().end());
    if (layers.empty()) {
      for (uint32_t l = 0; l < m.model().n_layers(); ++l) layers.push_back(l);
    }
    if (heads.empty()) {
      for (uint32_t h = 0; h < m.model().n_kv_heads(); ++h) heads.push_back(h);
    }
    if (methods.empty()) {
      for (const auto& ip : m.index_params()) methods.push_back(ip.method());
    }
    for (uint32_t l : layers) {
      if (l >= m.model().n_layers()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "layers: " + std::to_string(l) + " out of range [0, " +
                                std::to_string(m.model().n_layers()) + ")");
      }
    }
    for (uint32_t h : heads) {
      if (h >= m.model().n_kv_heads()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "kv_heads: " + std::to_string(h) + " out of range");
      }
    }
    constexpr size_t kChunk = 1u << 20;
    for (const auto& method : methods) {
      auto info = index::FindMethodInfo(method);
      if (!info.ok()) return ToGrpc(info.status().WithContext("methods"));
      const uint8_t kind = (*info)->artifact_kind;
      for (uint32_t l : layers) {
        for (uint32_t h : heads) {
          if (context->IsCancelled()) {
            return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
          }
          auto bytes = reader->ReadArtifact(l, h, kind);
          if (!bytes.ok()) {
            Status s = bytes.status();
            if (s.code() == StatusCode::kNotFound) {
              s = FailedPreconditionError("context has no '" + method + "' index");
            }
            return ToGrpc(s);
          }
          const uint32_t crc = crc32c::Value(*bytes);
          const uint32_t n_chunks =
              static_cast<uint32_t>(std::max<size_t>(1, (bytes->size() + kChunk - 1) / kChunk));
          for (uint32_t c = 0; c < n_chunks; ++c) {
            v1::IndexChunk chunk;
            chunk.set_layer(l);
            chunk.set_kv_head(h);
            chunk.set_method(method);
            chunk.set_chunk_index(c);
            chunk.set_n_chunks(n_chunks);
            chunk.set_crc32c(crc);
            chunk.set_total_bytes(bytes->size());
            size_t off = size_t{c} * kChunk;
            chunk.set_data(bytes->substr(off, std::min(kChunk, bytes->size() - off)));
            if (!writer->Write(chunk)) {
              return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
            }
          }
        }
      }
    }
    return grpc::Status::OK;
  });
}

grpc::Status DecodeServiceImpl::FetchPages(grpc::ServerContext* context,
                                           const v1::FetchPagesRequest* request,
                                           grpc::ServerWriter<v1::PageBatch>* writer) {
  const RpcSpec spec{"FetchPages", auth::Action::kRead, Admission::kStream};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    grpc::Status done;
    auto reader = ReaderOrForward(
        ctx_, context, rpc, "FetchPages", *id, *request, writer,
        [](auto ch, grpc::ClientContext* cc, const v1::FetchPagesRequest& r) {
          return v1::DecodeService::NewStub(ch)->FetchPages(cc, r);
        },
        &done);
    if (reader == nullptr) return done;
    const v1::ContextManifest& m = reader->manifest();
    PageBatcher batcher(
        kMaxPageBatchBytes, [&](v1::PageBatch&& b) { return writer->Write(b); },
        ctx_->config.fault_corrupt_pages);
    storage::PageBatch batch;
    Counter* bytes_read = ctx_->metrics.GetCounter("ctxcache_page_bytes_read_total",
                                                   "Stored page bytes read for decode sessions");
    for (const auto& t : request->tables()) {
      if (context->IsCancelled()) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      }
      if (t.layer() >= m.model().n_layers() || t.kv_head() >= m.model().n_kv_heads()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "tables: layer " + std::to_string(t.layer()) + " / kv_head " +
                                std::to_string(t.kv_head()) + " out of range (context has " +
                                std::to_string(m.model().n_layers()) + " layers, " +
                                std::to_string(m.model().n_kv_heads()) + " kv heads)");
      }
      std::vector<uint32_t> blocks(t.blocks().begin(), t.blocks().end());
      Status s = reader->ReadPages(t.layer(), t.kv_head(), blocks, &batch);
      if (!s.ok()) return ToGrpc(s);
      bytes_read->Inc(static_cast<double>(batch.stored_bytes));
      for (size_t i = 0; i < batch.size(); ++i) {
        if (!batcher.Add(StoredPageToProto(batch, i, t.layer(), t.kv_head()))) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
        }
      }
    }
    batcher.Finish();
    return grpc::Status::OK;
  });
}

grpc::Status DecodeServiceImpl::FetchKV(grpc::ServerContext* context,
                                        const v1::FetchKVRequest* request,
                                        grpc::ServerWriter<v1::KVFrame>* writer) {
  const RpcSpec spec{"FetchKV", auth::Action::kRead, Admission::kStream};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    const size_t max_message = ctx_->config.max_message_bytes;
    const size_t max_frame =
        max_message > (128u << 10) ? max_message - (64u << 10) : max_message / 2;
    if (request->frame_bytes() > max_frame) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "frame_bytes: " + std::to_string(request->frame_bytes()) + " exceeds " +
                              std::to_string(max_frame) +
                              " (the server's max message size minus 64 KiB)");
    }
    grpc::Status done;
    auto reader = ReaderOrForward(
        ctx_, context, rpc, "FetchKV", *id, *request, writer,
        [](auto ch, grpc::ClientContext* cc, const v1::FetchKVRequest& r) {
          return v1::DecodeService::NewStub(ch)->FetchKV(cc, r);
        },
        &done);
    if (reader == nullptr) return done;
    const bool some_pages = request->tables_size() > 0;
    if (some_pages && request->layers_size() > 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "tables: given with layers; ask for whole layers or for page tables");
    }
    if (some_pages) {
      const auto& model = reader->manifest().model();
      Status s = CheckPageTables(model.n_layers(), model.n_kv_heads(), reader->n_blocks(),
                                 request->tables());
      if (!s.ok()) return ToGrpc(s);
    }
    auto layers = LayerList(request->layers(), reader->manifest().model().n_layers());
    if (!layers.ok()) return ToGrpc(layers.status());
    Counter* bytes_read = ctx_->metrics.GetCounter("ctxcache_page_bytes_read_total",
                                                   "Stored page bytes read for decode sessions");
    KVFrameOptions options;
    if (request->frame_bytes() > 0) {
      options.frame_bytes = options.table_frame_bytes = request->frame_bytes();
    }
    options.corrupt_for_testing = ctx_->config.fault_corrupt_pages;
    options.on_bytes_read = [bytes_read](uint64_t b) { bytes_read->Inc(static_cast<double>(b)); };
    options.pool = &frames_;
    std::unique_ptr<KVFrameReader> reader_frames =
        some_pages ? std::make_unique<KVFrameReader>(
                         reader.get(),
                         std::vector<v1::PageTable>(request->tables().begin(),
                                                    request->tables().end()),
                         std::move(options))
                   : std::make_unique<KVFrameReader>(reader.get(), std::move(*layers),
                                                     std::move(options));
    KVFrameReader& frames = *reader_frames;
    v1::KVFrame frame;
    while (frames.Next(&frame)) {
      if (context->IsCancelled()) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      }
      if (!writer->Write(frame)) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
      frames.Recycle(std::move(frame));
    }
    return ToGrpc(frames.status());
  });
}

namespace {

// MapKV's end: the call lasts until the client holds the segment (or gives
// up, or 60 s pass).
grpc::Status WaitSegmentTaken(ShmBroker* broker, const std::string& token,
                              grpc::ServerContext* context) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  if (!broker->WaitRedeemed(token, [&] {
        return context->IsCancelled() || std::chrono::steady_clock::now() > deadline;
      })) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        "MapKV: the segment was not taken from " + broker->path() + " within 60 s");
  }
  return grpc::Status::OK;
}

}  // namespace

grpc::Status DecodeServiceImpl::MapKV(grpc::ServerContext* context, const v1::MapKVRequest* request,
                                      grpc::ServerWriter<v1::MapKVProgress>* writer) {
  const RpcSpec spec{"MapKV", auth::Action::kRead, Admission::kStream};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    if (!ctx_->shm) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "MapKV is off on this server (--shm-socket off); use FetchKV");
    }
    grpc::Status refuse;
    if (auto target = ForwardTarget(ctx_, context, *id, &refuse)) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "context " + request->context_id() + " is served by " + *target +
                              ": MapKV shares memory on the serving node's own host; use FetchKV");
    }
    if (!refuse.ok()) return refuse;
    auto reader =
        AccessControl::OpenReader(ctx_->store.get(), rpc.principal(), *id, auth::Action::kRead);
    if (!reader.ok()) return ToGrpc(reader.status());
    const v1::ContextManifest& m = (*reader)->manifest();
    auto layers = LayerList(request->layers(), m.model().n_layers());
    if (!layers.ok()) return ToGrpc(layers.status());
    const KVSegmentLayout layout = DenseKVSegmentLayout(m);
    const uint64_t size = layers->size() * layout.layer_stride;
    ShmCache* cache = ctx_->shm_cache.get();
    const std::string cache_key =
        cache ? ShmCache::Key(id->ToHex(), m.created_at_ms(), *layers) : std::string();
    const int cached_fd = cache ? cache->Lookup(cache_key) : -1;
    if (cache) {
      ctx_->metrics
          .GetCounter("ctxcache_shm_cache_lookups_total",
                      "MapKV calls on a server with --shm-cache-mb, by result",
                      {{"result", cached_fd >= 0 ? "hit" : "miss"}})
          ->Inc();
    }
    ShmSegment segment;
    int keep_fd = -1;  // the fd ShmCache keeps after a complete fill
    if (cached_fd < 0) {
      if (Status s = segment.Create(size); !s.ok()) return ToGrpc(s);
      if (cache && segment.sealed() && size <= cache->budget()) keep_fd = segment.DupFd();
    }
    struct CloseKeep {
      int& fd;
      ~CloseKeep() {
        if (fd >= 0) close(fd);
      }
    } close_keep{keep_fd};
    const std::string token = ctx_->shm->Offer(cached_fd >= 0 ? cached_fd : segment.ReleaseFd());
    struct Withdraw {
      ShmBroker* broker;
      const std::string& token;
      ~Withdraw() { broker->Withdraw(token); }
    } withdraw{ctx_->shm.get(), token};

    v1::MapKVProgress first;
    v1::KVSegment* seg = first.mutable_segment();
    seg->set_socket_path(ctx_->shm->path());
    seg->set_token(token);
    seg->set_size(size);
    seg->set_layer_stride(layout.layer_stride);
    seg->set_head_stride(layout.head_stride);
    seg->set_token_stride(layout.token_stride);
    seg->set_v_offset(layout.v_offset);
    seg->set_dtype(m.model().kv_dtype());
    seg->set_n_tokens(m.n_tokens());
    seg->set_n_kv_heads(m.model().n_kv_heads());
    seg->set_head_dim(m.model().head_dim());
    if (!writer->Write(first)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }

    if (cached_fd >= 0) {
      // Every layer is in the kept segment already.
      for (uint32_t layer : *layers) {
        v1::MapKVProgress p;
        p.set_layer_ready(layer);
        if (!writer->Write(p)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
      return WaitSegmentTaken(ctx_->shm.get(), token, context);
    }

    // Fill on a thread of its own (which runs up to 16 layers at a time);
    // this thread reports each layer as it lands.
    Counter* bytes_read = ctx_->metrics.GetCounter("ctxcache_page_bytes_read_total",
                                                   "Stored page bytes read for decode sessions");
    std::mutex mu;
    std::condition_variable cv;
    std::deque<uint32_t> ready;  // guarded by mu
    bool filled = false;         // guarded by mu
    std::atomic<bool> stop{false};
    Status fill_status;
    std::thread filler([&] {
      Status s = FillKVSegment(
          reader->get(), *layers, layout, segment.data(),
          static_cast<int>(std::min(16u, std::max(1u, std::thread::hardware_concurrency()))),
          [&](uint32_t layer) {
            std::lock_guard<std::mutex> l(mu);
            ready.push_back(layer);
            cv.notify_all();
          },
          [&] { return stop.load(); },
          [bytes_read](uint64_t b) { bytes_read->Inc(static_cast<double>(b)); });
      std::lock_guard<std::mutex> l(mu);
      fill_status = s;
      filled = true;
      cv.notify_all();
    });
    bool client_gone = false;
    for (;;) {
      std::unique_lock<std::mutex> l(mu);
      cv.wait_for(l, std::chrono::milliseconds(100), [&] { return !ready.empty() || filled; });
      if (ready.empty() && filled) break;
      std::deque<uint32_t> batch;
      batch.swap(ready);
      l.unlock();
      if (context->IsCancelled()) client_gone = true;
      for (uint32_t layer : batch) {
        v1::MapKVProgress p;
        p.set_layer_ready(layer);
        if (!client_gone && !writer->Write(p)) client_gone = true;
      }
      if (client_gone) stop = true;
    }
    filler.join();
    if (client_gone) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
    if (!fill_status.ok()) return ToGrpc(fill_status);
    if (keep_fd >= 0) {
      cache->Insert(cache_key, keep_fd, size);
      keep_fd = -1;
    }
    return WaitSegmentTaken(ctx_->shm.get(), token, context);
  });
}

grpc::Status DecodeServiceImpl::WatchContexts(grpc::ServerContext* context,
                                              const v1::WatchRequest* request,
                                              grpc::ServerWriter<v1::ContextEvent>* writer) {
  const RpcSpec spec{"WatchContexts", auth::Action::kRead, Admission::kStream};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    if (!request->context_id().empty()) {
      auto id = ParseContextId(request->context_id());
      if (!id.ok()) return ToGrpc(id.status().WithContext("context_id filter"));
    }
    // Only events of contexts the caller may read are ever queued for it.
    auto sub = ctx_->events.Subscribe([who = rpc.principal()](const v1::ContextInfo& c) {
      return AccessControl::CanAccess(who, c.tenant(), c.shared(), auth::Action::kRead);
    });
    struct Unsub {
      EventHub* hub;
      std::shared_ptr<EventHub::Subscriber> s;
      ~Unsub() { hub->Unsubscribe(s); }
    } unsub{&ctx_->events, sub};
    // Initial empty event: tells the client the subscription is live.
    v1::ContextEvent hello;
    hello.set_type(v1::ContextEvent::TYPE_UNSPECIFIED);
    if (!writer->Write(hello)) return grpc::Status::OK;
    // A key revoked while watching ends the watch before it sees another event.
    auto still_valid = [&] { return ctx_->access->Recheck(context, rpc.principal()); };
    while (!context->IsCancelled() && !ctx_->draining) {
      if (Status s = still_valid(); !s.ok()) return ToGrpc(s);
      std::unique_lock<std::mutex> lock(sub->mu);
      sub->cv.wait_for(lock, std::chrono::milliseconds(200),
                       [&] { return !sub->queue.empty() || sub->closed; });
      if (sub->closed) break;
      while (!sub->queue.empty()) {
        v1::ContextEvent ev = std::move(sub->queue.front());
        sub->queue.pop_front();
        sub->queued_bytes -= std::min(sub->queued_bytes, ev.ByteSizeLong());
        lock.unlock();
        bool match =
            request->context_id().empty() || ev.context().context_id() == request->context_id();
        for (const auto& [k, v] : request->label_filter()) {
          auto it = ev.context().labels().find(k);
          match = match && it != ev.context().labels().end() && it->second == v;
        }
        if (match) {
          if (Status s = still_valid(); !s.ok()) return ToGrpc(s);
          if (!writer->Write(ev)) return grpc::Status::OK;
        }
        lock.lock();
      }
    }
    return grpc::Status::OK;
  });
}

}  // namespace ctxcache::service
