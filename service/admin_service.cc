#include "service/admin_service.h"

#include <algorithm>
#include <chrono>

#include "common/dtype.h"
#include "index/methods.h"
#include "service/build_pipeline.h"
#include "service/grpc_status.h"
#include "service/rpc_metrics.h"
#include "service/wire.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"

#ifndef CTXCACHE_VERSION
#define CTXCACHE_VERSION "0.0.0"
#endif

namespace ctxcache::service {

namespace {

bool LabelsMatch(const v1::ContextManifest& m,
                 const google::protobuf::Map<std::string, std::string>& filter) {
  for (const auto& [k, v] : filter) {
    auto it = m.labels().find(k);
    if (it == m.labels().end() || it->second != v) return false;
  }
  return true;
}

grpc::Status Invalid(const std::string& msg) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, msg);
}

// Index requests from the API, or the server's defaults.
StatusOr<std::vector<IndexRequest>> IndexRequests(
    const google::protobuf::RepeatedPtrField<v1::IndexSpec>& specs, const std::string& defaults) {
  std::vector<IndexRequest> out;
  for (const auto& s : specs) {
    if (s.method().empty()) return InvalidArgumentError("indexes[].method is required");
    IndexRequest r;
    r.method = s.method();
    for (const auto& [k, v] : s.params()) r.params[k] = v;
    out.push_back(std::move(r));
  }
  if (specs.empty()) {
    size_t pos = 0;
    while (pos < defaults.size()) {
      size_t comma = defaults.find(',', pos);
      std::string m =
          defaults.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      if (!m.empty()) out.push_back(IndexRequest{m, {}});
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
  }
  RETURN_IF_ERROR(ValidateIndexRequests(out));
  return out;
}

// Text or token ids -> tokens for `model`.
Status Tokenize(const LoadedModel& model, bool has_text, const std::string& text,
                const v1::TokenIds& ids, bool add_bos, std::vector<int32_t>* out) {
  if (has_text) {
    if (text.empty()) return InvalidArgumentError("text is empty; pass the context's text");
    if (!model.tokenizer) {
      return FailedPreconditionError("model '" + model.name +
                                     "' has no tokenizer.model; send token ids instead of text");
    }
    if (add_bos && model.tokenizer->bos_id() >= 0) out->push_back(model.tokenizer->bos_id());
    std::vector<int32_t> t;
    RETURN_IF_ERROR(model.tokenizer->Encode(text, &t));
    out->insert(out->end(), t.begin(), t.end());
  } else {
    out->assign(ids.ids().begin(), ids.ids().end());
  }
  if (out->empty()) return InvalidArgumentError("the input has 0 tokens");
  return Status::OK();
}

}  // namespace

grpc::Status AdminServiceImpl::BuildContext(grpc::ServerContext* context,
                                            const v1::BuildContextRequest* request,
                                            grpc::ServerWriter<v1::BuildProgress>* writer) {
  RpcScope rpc(ctx_, "BuildContext");
  if (ctx_->draining) return rpc.Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining"));
  if (request->input_case() == v1::BuildContextRequest::INPUT_NOT_SET) {
    return rpc.Finish(Invalid("one of text or tokens is required"));
  }
  if (request->ttl_seconds() < 0) return rpc.Finish(Invalid("ttl_seconds must be >= 0"));
  auto model = ctx_->models.Get(request->model());
  if (!model.ok()) return rpc.Finish(ToGrpc(model.status()));
  BuildJob job;
  job.model = *model;
  Status s = Tokenize(**model, request->has_text(), request->text(), request->tokens(),
                      request->add_bos(), &job.tokens);
  if (!s.ok()) return rpc.Finish(ToGrpc(s));
  auto idx = IndexRequests(request->indexes(), ctx_->config.default_indexes);
  if (!idx.ok()) return rpc.Finish(ToGrpc(idx.status()));
  job.indexes = std::move(idx).value();
  job.name = request->name();
  job.tenant = request->tenant();
  job.labels.insert(request->labels().begin(), request->labels().end());
  job.ttl_ms = request->ttl_seconds() * 1000;
  job.pinned = request->pin();
  return rpc.Finish(RunBuildRpc(context, &job, writer, /*extend=*/false));
}

grpc::Status AdminServiceImpl::ExtendContext(grpc::ServerContext* context,
                                             const v1::ExtendContextRequest* request,
                                             grpc::ServerWriter<v1::BuildProgress>* writer) {
  RpcScope rpc(ctx_, "ExtendContext");
  if (ctx_->draining) return rpc.Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining"));
  auto pid = ParseContextId(request->parent_id());
  if (!pid.ok()) return rpc.Finish(ToGrpc(pid.status().WithContext("parent_id")));
  if (request->input_case() == v1::ExtendContextRequest::INPUT_NOT_SET) {
    return rpc.Finish(Invalid("one of text or tokens (the appended part) is required"));
  }
  auto reader = ctx_->store->OpenReader(*pid);
  if (!reader.ok()) return rpc.Finish(ToGrpc(reader.status()));
  const v1::ContextManifest& parent = (*reader)->manifest();
  auto model = ctx_->models.Get(parent.model().name());
  if (!model.ok()) return rpc.Finish(ToGrpc(model.status()));
  if ((*model)->spec.fingerprint() != parent.model().fingerprint()) {
    return rpc.Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                   "the parent was built with a different version of model '" +
                                       parent.model().name() + "' (fingerprint mismatch)"));
  }
  auto parent_tokens = (*reader)->ReadTokens();
  if (!parent_tokens.ok()) return rpc.Finish(ToGrpc(parent_tokens.status()));
  BuildJob job;
  job.model = *model;
  job.tokens.assign(parent_tokens->begin(), parent_tokens->end());
  std::vector<int32_t> extra;
  Status s =
      Tokenize(**model, request->has_text(), request->text(), request->tokens(), false, &extra);
  if (!s.ok()) return rpc.Finish(ToGrpc(s));
  job.tokens.insert(job.tokens.end(), extra.begin(), extra.end());
  job.parent = *pid;
  // Default: the parent's index methods and parameters, minus those derived
  // from the parent's size (CSA's C is re-derived for the child).
  if (request->indexes().empty()) {
    for (const auto& ip : parent.index_params()) {
      IndexRequest r;
      r.method = ip.method();
      index::MethodParams parent_params(ip.params().begin(), ip.params().end());
      auto info = index::FindMethodInfo(r.method);
      if (!info.ok()) return rpc.Finish(ToGrpc(info.status().WithContext("parent index")));
      r.params = index::ParamsForExtend(**info, parent_params);
      job.indexes.push_back(std::move(r));
    }
  } else {
    auto idx = IndexRequests(request->indexes(), ctx_->config.default_indexes);
    if (!idx.ok()) return rpc.Finish(ToGrpc(idx.status()));
    job.indexes = std::move(idx).value();
  }
  job.name = request->name().empty() ? parent.name() : request->name();
  job.tenant = parent.tenant();
  job.labels.insert(parent.labels().begin(), parent.labels().end());
  for (const auto& [k, v] : request->labels()) job.labels[k] = v;
  job.ttl_ms = request->ttl_seconds() * 1000;
  job.pinned = request->pin();
  reader->reset();  // drop the lease; BeginBuild takes its own reference
  return rpc.Finish(RunBuildRpc(context, &job, writer, /*extend=*/true));
}

grpc::Status AdminServiceImpl::IngestContext(grpc::ServerContext* context,
                                             grpc::ServerReader<v1::IngestChunk>* reader,
                                             v1::ContextInfo* response) {
  RpcScope rpc(ctx_, "IngestContext");
  if (ctx_->draining) return rpc.Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining"));
  v1::IngestChunk msg;
  if (!reader->Read(&msg) || !msg.has_header()) {
    return rpc.Finish(Invalid("the first IngestChunk must carry the header"));
  }
  const v1::IngestHeader& h = msg.header();
  IngestBuilder::Header header;
  header.model = h.model();
  header.tokens.assign(h.tokens().ids().begin(), h.tokens().ids().end());
  auto idx = IndexRequests(h.indexes(), ctx_->config.default_indexes);
  if (!idx.ok()) return rpc.Finish(ToGrpc(idx.status()));
  header.indexes = std::move(idx).value();
  header.name = h.name();
  header.tenant = h.tenant();
  header.labels.insert(h.labels().begin(), h.labels().end());
  header.ttl_ms = h.ttl_seconds() * 1000;
  header.pinned = h.pin();
  auto builder = IngestBuilder::Begin(ctx_->store.get(), std::move(header), BuildOptions{});
  if (!builder.ok()) return rpc.Finish(ToGrpc(builder.status()));
  IngestBuilder& b = **builder;
  if (b.reused()) {  // already stored with these indexes: drain the stream, return it
    while (reader->Read(&msg)) {
    }
    *response = ManifestToInfo(b.existing());
    return rpc.Finish(grpc::Status::OK);
  }
  const int64_t NKV = b.n_kv_heads(), NQ = b.n_q_heads(), D = b.head_dim();
  std::vector<float> k, v, q;
  bool committed = false;
  while (reader->Read(&msg)) {
    if (context->IsCancelled()) return rpc.Finish(ToGrpc(CancelledError("ingest cancelled")));
    if (msg.has_commit()) {
      committed = true;
      break;
    }
    if (!msg.has_chunk()) {
      return rpc.Finish(ToGrpc(InvalidArgumentError("expected a chunk or the commit")));
    }
    const v1::IngestLayerChunk& c = msg.chunk();
    const int64_t n = c.n_tokens();
    Status s = n > 0 ? TensorToFloat(c.k(), {NKV, n, D}, "chunk.k", &k) : Status::OK();
    if (s.ok() && n > 0) s = TensorToFloat(c.v(), {NKV, n, D}, "chunk.v", &v);
    const bool has_q = c.has_q() && !c.q().data().empty();
    if (s.ok() && n > 0 && has_q) s = TensorToFloat(c.q(), {NQ, n, D}, "chunk.q", &q);
    if (s.ok()) {
      s = b.AddChunk(static_cast<int>(std::min<uint32_t>(c.layer(), INT32_MAX)),
                     static_cast<int64_t>(c.token_start()), n, k.data(), v.data(),
                     has_q ? q.data() : nullptr);
    }
    if (!s.ok()) return rpc.Finish(ToGrpc(s));  // ~IngestBuilder removes what was written
  }
  if (!committed) {
    return rpc.Finish(
        grpc::Status(grpc::StatusCode::ABORTED,
                     "the ingest stream ended before IngestCommit; nothing was stored"));
  }
  auto manifest = b.Commit();
  if (!manifest.ok()) return rpc.Finish(ToGrpc(manifest.status()));
  *response = ManifestToInfo(*manifest);
  ctx_->events.Publish(v1::ContextEvent::CREATED, *response);
  ctx_->events.Publish(v1::ContextEvent::READY, *response);
  return rpc.Finish(grpc::Status::OK);
}

grpc::Status AdminServiceImpl::RunBuildRpc(grpc::ServerContext* context, BuildJob* job,
                                           grpc::ServerWriter<v1::BuildProgress>* writer,
                                           bool extend) {
  std::atomic<bool> cancel{false};
  auto client_gone = [&] { return context->IsCancelled(); };
  Gauge* depth = ctx_->metrics.GetGauge("ctxcache_build_queue_depth", "Builds waiting to run");
  depth->Set(ctx_->build_queue.waiting() + 1);
  Status admitted = ctx_->build_queue.Acquire(
      [&](uint32_t pos) {
        BuildProgress p;
        p.phase = BuildProgress::Phase::kQueued;
        p.queue_position = pos;
        p.tokens_total = job->tokens.size();
        writer->Write(ProgressToProto(p));
      },
      client_gone);
  depth->Set(ctx_->build_queue.waiting());
  if (!admitted.ok()) return ToGrpc(admitted);
  struct Release {
    BuildQueue* q;
    ~Release() { q->Release(); }
  } release{&ctx_->build_queue};

  BuildOptions opts;
  opts.prefill_chunk = static_cast<int>(ctx_->config.prefill_chunk);
  auto progress = [&](const BuildProgress& p) {
    if (context->IsCancelled() || !writer->Write(ProgressToProto(p))) cancel = true;
  };
  auto start = std::chrono::steady_clock::now();
  auto outcome = RunBuild(ctx_->store.get(), *job, opts, progress, &cancel);
  if (!outcome.ok()) {
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "build cancelled; nothing was stored");
    }
    v1::ContextInfo info;
    info.set_name(job->name);
    info.set_state(v1::CONTEXT_STATE_FAILED);
    ctx_->events.Publish(v1::ContextEvent::FAILED, info);
    return ToGrpc(outcome.status());
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BuildProgress final_progress;
  final_progress.phase = BuildProgress::Phase::kDone;
  final_progress.tokens_total = final_progress.tokens_prefilled = outcome->manifest.n_tokens();
  final_progress.layers_total = final_progress.layers_indexed = outcome->manifest.model().n_layers();
  final_progress.bytes_written = outcome->manifest.stored_bytes();
  final_progress.tokens_per_s = secs > 0 ? outcome->manifest.n_tokens() / secs : 0;
  v1::BuildProgress done = ProgressToProto(final_progress);
  done.set_reused(outcome->reused);
  *done.mutable_context() = ManifestToInfo(outcome->manifest);
  if (!outcome->reused) {
    ctx_->metrics.GetCounter("ctxcache_builds_total", "Contexts built")->Inc();
    ctx_->metrics.GetCounter("ctxcache_written_bytes_total", "Bytes written by builds")
        ->Inc(static_cast<double>(outcome->manifest.stored_bytes()));
    ctx_->events.Publish(extend ? v1::ContextEvent::EXTENDED : v1::ContextEvent::CREATED,
                         done.context());
    ctx_->events.Publish(v1::ContextEvent::READY, done.context());
  }
  writer->Write(done);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetContext(grpc::ServerContext*,
                                          const v1::GetContextRequest* request,
                                          v1::ContextInfo* response) {
  RpcScope rpc(ctx_, "GetContext");
  auto id = ParseContextId(request->context_id());
  if (!id.ok()) return rpc.Finish(ToGrpc(id.status()));
  auto m = ctx_->store->GetManifest(*id);
  if (!m.ok()) return rpc.Finish(ToGrpc(m.status()));
  *response = ManifestToInfo(*m);
  return rpc.Finish(grpc::Status::OK);
}

grpc::Status AdminServiceImpl::ListContexts(grpc::ServerContext*,
                                            const v1::ListContextsRequest* request,
                                            v1::ListContextsResponse* response) {
  RpcScope rpc(ctx_, "ListContexts");
  uint32_t page_size = request->page_size() == 0 ? 100 : request->page_size();
  if (page_size > 1000) {
    return rpc.Finish(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                     "page_size must be <= 1000, got " + std::to_string(request->page_size())));
  }
  // Contexts come ordered by id; the page token is the last id returned.
  std::string after = request->page_token();
  if (!after.empty() && !storage::ContextId::FromHex(after).ok()) {
    return rpc.Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   "page_token is not a token returned by ListContexts"));
  }
  for (const auto& m : ctx_->store->ListContexts()) {
    v1::ContextInfo info = ManifestToInfo(m);
    if (!after.empty() && info.context_id() <= after) continue;
    if (request->state_filter() != v1::CONTEXT_STATE_UNSPECIFIED &&
        m.state() != request->state_filter()) {
      continue;
    }
    if (!LabelsMatch(m, request->label_filter())) continue;
    if (static_cast<uint32_t>(response->contexts_size()) == page_size) {
      response->set_next_page_token(response->contexts().rbegin()->context_id());
      break;
    }
    *response->add_contexts() = std::move(info);
  }
  return rpc.Finish(grpc::Status::OK);
}

grpc::Status AdminServiceImpl::EvictContext(grpc::ServerContext*,
                                            const v1::EvictContextRequest* request,
                                            v1::EvictContextResponse* response) {
  RpcScope rpc(ctx_, "EvictContext");
  auto id = ParseContextId(request->context_id());
  if (!id.ok()) return rpc.Finish(ToGrpc(id.status()));
  auto m = ctx_->store->GetManifest(*id);
  if (!m.ok()) return rpc.Finish(ToGrpc(m.status()));
  auto deferred = ctx_->store->Delete(*id);
  if (!deferred.ok()) return rpc.Finish(ToGrpc(deferred.status()));
  response->set_deferred(*deferred);
  response->set_evicted(!*deferred);
  response->set_bytes_reclaimed(*deferred ? 0 : m->stored_bytes());
  ctx_->metrics.GetCounter("ctxcache_evictions_total", "Contexts evicted (explicit and policy)")
      ->Inc();
  ctx_->events.Publish(v1::ContextEvent::EVICTED, ManifestToInfo(*m));
  return rpc.Finish(grpc::Status::OK);
}

grpc::Status AdminServiceImpl::PinContext(grpc::ServerContext*,
                                          const v1::PinContextRequest* request,
                                          v1::ContextInfo* response) {
  RpcScope rpc(ctx_, "PinContext");
  auto id = ParseContextId(request->context_id());
  if (!id.ok()) return rpc.Finish(ToGrpc(id.status()));
  if (Status s = ctx_->store->SetPinned(*id, request->pinned()); !s.ok()) {
    return rpc.Finish(ToGrpc(s));
  }
  auto m = ctx_->store->GetManifest(*id);
  if (!m.ok()) return rpc.Finish(ToGrpc(m.status()));
  *response = ManifestToInfo(*m);
  return rpc.Finish(grpc::Status::OK);
}

grpc::Status AdminServiceImpl::GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                                        v1::ServerStats* response) {
  RpcScope rpc(ctx_, "GetStats");
  storage::StoreStats st = ctx_->store->GetStats();
  response->set_version(CTXCACHE_VERSION);
  response->set_uptime_s(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - ctx_->start_time).count());
  response->set_n_contexts(st.ready_contexts);
  response->set_stored_bytes(st.stored_bytes);
  response->set_capacity_bytes(st.capacity_bytes);
  response->set_open_sessions(ctx_->open_sessions.load());
  response->set_build_queue_depth(ctx_->build_queue.waiting());
  for (const auto& m : ctx_->models.Available()) response->add_models(m);
  for (const auto& [cf, bytes] : st.bytes_by_cf) (*response->mutable_bytes_by_kind())[cf] = bytes;
  return rpc.Finish(grpc::Status::OK);
}

}  // namespace ctxcache::service
