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
  const v1::IngestHeader header = msg.header();
  const v1::ModelSpec& spec = header.model();
  if (spec.n_layers() == 0 || spec.n_q_heads() == 0 || spec.n_kv_heads() == 0 ||
      spec.head_dim() == 0 || spec.n_q_heads() % spec.n_kv_heads() != 0) {
    return rpc.Finish(
        Invalid("header.model: n_layers, n_q_heads, n_kv_heads and head_dim must "
                "be > 0 and n_q_heads a multiple of n_kv_heads"));
  }
  if (spec.fingerprint().empty()) {
    return rpc.Finish(
        Invalid("header.model.fingerprint is required (it decides KV compatibility)"));
  }
  if (spec.kv_dtype() == v1::DTYPE_UNSPECIFIED) {
    return rpc.Finish(
        Invalid("header.model.kv_dtype is required (DTYPE_BF16, DTYPE_F16 or DTYPE_F32)"));
  }
  if (header.tokens().ids_size() == 0) return rpc.Finish(Invalid("header.tokens is empty"));
  auto idx = IndexRequests(header.indexes(), ctx_->config.default_indexes);
  if (!idx.ok()) return rpc.Finish(ToGrpc(idx.status()));
  auto kv_dtype = FromProtoDType(spec.kv_dtype());
  if (!kv_dtype.ok()) return rpc.Finish(ToGrpc(kv_dtype.status()));

  const int L = static_cast<int>(spec.n_layers()), NKV = static_cast<int>(spec.n_kv_heads()),
            NQ = static_cast<int>(spec.n_q_heads()), D = static_cast<int>(spec.head_dim());
  const int G = NQ / NKV;
  const int64_t N = header.tokens().ids_size();
  std::vector<uint32_t> tokens(header.tokens().ids().begin(), header.tokens().ids().end());
  storage::BuildRequest br;
  br.model = spec;
  br.tokens = tokens;
  br.name = header.name();
  br.tenant = header.tenant();
  br.labels.insert(header.labels().begin(), header.labels().end());
  br.ttl_ms = header.ttl_seconds() * 1000;
  br.pinned = header.pin();
  auto start = ctx_->store->BeginBuild(br);
  if (!start.ok()) return rpc.Finish(ToGrpc(start.status()));
  if (!start->writer) {  // already stored: drain the stream, return it
    while (reader->Read(&msg)) {
    }
    if (Status s = CheckReusable(start->existing, *idx, G); !s.ok()) {
      return rpc.Finish(ToGrpc(s));
    }
    *response = ManifestToInfo(start->existing);
    return rpc.Finish(grpc::Status::OK);
  }
  storage::ContextWriter* writer = start->writer.get();
  auto fail = [&](const Status& s) {
    writer->Abort().IgnoreError();
    return rpc.Finish(ToGrpc(s));
  };
  // Keys/values (fp32) and a query sample per layer for the index builds.
  std::vector<std::vector<float>> keys(static_cast<size_t>(L) * NKV), vals(keys.size());
  std::vector<std::vector<float>> qs(keys.size());
  std::vector<std::vector<int64_t>> qpos(static_cast<size_t>(L));
  std::vector<int64_t> next(L, 0);
  const int64_t q_stride = std::max<int64_t>(1, (N * G + 65535) / 65536);
  std::vector<float> k, v, q;
  std::vector<uint8_t> kc, vc;
  bool committed = false;
  while (reader->Read(&msg)) {
    if (context->IsCancelled()) return fail(CancelledError("ingest cancelled"));
    if (msg.has_commit()) {
      committed = true;
      break;
    }
    if (!msg.has_chunk()) return fail(InvalidArgumentError("expected a chunk or the commit"));
    const v1::IngestLayerChunk& c = msg.chunk();
    if (c.layer() >= static_cast<uint32_t>(L)) {
      return fail(InvalidArgumentError("chunk.layer " + std::to_string(c.layer()) +
                                       " out of range [0, " + std::to_string(L) + ")"));
    }
    const int layer = static_cast<int>(c.layer());
    const int64_t n = c.n_tokens();
    if (static_cast<int64_t>(c.token_start()) != next[layer] || n <= 0 || next[layer] + n > N) {
      return fail(InvalidArgumentError(
          "chunk for layer " + std::to_string(layer) + ": token_start " +
          std::to_string(c.token_start()) + " n_tokens " + std::to_string(n) + ", expected start " +
          std::to_string(next[layer]) + " and an end <= " + std::to_string(N)));
    }
    Status s = TensorToFloat(c.k(), {NKV, n, D}, "chunk.k", &k);
    if (s.ok()) s = TensorToFloat(c.v(), {NKV, n, D}, "chunk.v", &v);
    const bool has_q = c.has_q() && !c.q().data().empty();
    if (s.ok() && has_q) s = TensorToFloat(c.q(), {NQ, n, D}, "chunk.q", &q);
    if (!s.ok()) return fail(s);
    const size_t per_head = static_cast<size_t>(n) * D;
    kc.resize(per_head * DTypeSize(*kv_dtype));
    vc.resize(kc.size());
    for (int h = 0; h < NKV; ++h) {
      ConvertFromFloat(*kv_dtype, k.data() + h * per_head, kc.data(), per_head);
      ConvertFromFloat(*kv_dtype, v.data() + h * per_head, vc.data(), per_head);
      s = writer->AppendKV(c.layer(), static_cast<uint32_t>(h), c.token_start(),
                           static_cast<uint32_t>(n), *kv_dtype, kc.data(), vc.data());
      if (!s.ok()) return fail(s);
      // Indexes are built over the KV as stored (rounded to kv_dtype), as
      // in BuildContext, so both paths produce the same artifacts.
      auto& kk = keys[static_cast<size_t>(layer) * NKV + h];
      auto& vv = vals[static_cast<size_t>(layer) * NKV + h];
      size_t off = kk.size();
      kk.resize(off + per_head);
      vv.resize(off + per_head);
      ConvertToFloat(*kv_dtype, kc.data(), kk.data() + off, per_head);
      ConvertToFloat(*kv_dtype, vc.data(), vv.data() + off, per_head);
    }
    if (has_q) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = next[layer] + i;
        if (p % q_stride != 0 && p < N - 32) continue;
        qpos[layer].push_back(p);
        for (int qh = 0; qh < NQ; ++qh) {
          auto& dst = qs[static_cast<size_t>(layer) * NKV + qh / G];
          const float* src = q.data() + (static_cast<size_t>(qh) * n + i) * D;
          // [row][head-in-group][d], regrouped below; bf16-rounded like the
          // build path's query sample.
          size_t off = dst.size();
          dst.resize(off + D);
          for (int j = 0; j < D; ++j) dst[off + j] = Bf16ToFloat(FloatToBf16(src[j]));
        }
      }
    }
    next[layer] += n;
  }
  if (!committed) {
    writer->Abort().IgnoreError();
    return rpc.Finish(
        grpc::Status(grpc::StatusCode::ABORTED,
                     "the ingest stream ended before IngestCommit; nothing was stored"));
  }
  for (int l = 0; l < L; ++l) {
    if (next[l] != N) {
      return fail(FailedPreconditionError("IngestCommit before layer " + std::to_string(l) +
                                          " was complete (" + std::to_string(next[l]) + " of " +
                                          std::to_string(N) + " tokens)"));
    }
  }
  Status indexed = BuildIndexArtifacts(
      writer, IndexShape{L, NKV, D, G, N}, *idx,
      [&](int layer, int h, float* kout, float* vout) {
        const auto& kk = keys[static_cast<size_t>(layer) * NKV + h];
        const auto& vv = vals[static_cast<size_t>(layer) * NKV + h];
        std::copy(kk.begin(), kk.end(), kout);
        std::copy(vv.begin(), vv.end(), vout);
      },
      [&](int layer, int h, std::vector<float>* qout, std::vector<int64_t>* pos) {
        // Stored [row][g][d]; the builders want [g][row][d].
        const auto& src = qs[static_cast<size_t>(layer) * NKV + h];
        const size_t rows = qpos[layer].size();
        qout->resize(src.size());
        for (size_t r = 0; r < rows; ++r) {
          for (int g = 0; g < G; ++g) {
            std::copy_n(src.data() + (r * G + g) * D, D, qout->data() + (g * rows + r) * D);
          }
        }
        *pos = qpos[layer];
      },
      nullptr, nullptr);
  if (!indexed.ok()) return fail(indexed);
  auto manifest = writer->Commit();
  if (!manifest.ok()) return fail(manifest.status());
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
        v1::BuildProgress p;
        p.set_phase(v1::BuildProgress::QUEUED);
        p.set_queue_position(pos);
        p.set_tokens_total(job->tokens.size());
        writer->Write(p);
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
  auto progress = [&](const v1::BuildProgress& p) {
    if (context->IsCancelled() || !writer->Write(p)) cancel = true;
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
  v1::BuildProgress done;
  done.set_phase(v1::BuildProgress::DONE);
  done.set_tokens_total(outcome->manifest.n_tokens());
  done.set_tokens_prefilled(outcome->manifest.n_tokens());
  done.set_layers_total(outcome->manifest.model().n_layers());
  done.set_layers_indexed(outcome->manifest.model().n_layers());
  done.set_bytes_written(outcome->manifest.stored_bytes());
  done.set_tokens_per_s(secs > 0 ? outcome->manifest.n_tokens() / secs : 0);
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
