#include "service/admin_service.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "auth/principal.h"
#include "common/dtype.h"
#include "index/methods.h"
#include "service/build_pipeline.h"
#include "service/cluster_service.h"
#include "service/grpc_status.h"
#include "service/rpc_metrics.h"
#include "service/wire.h"
#include "common/version.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"


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

// The longest context allowed for `model` (null: a model not hosted here);
// ServerConfig::max_context_tokens.
uint64_t MaxContextTokens(const ServerConfig& c, const LoadedModel* model) {
  if (c.max_context_tokens > 0) return c.max_context_tokens;
  if (model && model->model->spec().max_position_embeddings > 0) {
    return static_cast<uint64_t>(model->model->spec().max_position_embeddings);
  }
  return uint64_t{1} << 20;
}

Status CheckContextLength(uint64_t n_tokens, uint64_t limit, const std::string& model) {
  if (n_tokens <= limit) return Status::OK();
  return InvalidArgumentError("the context has " + std::to_string(n_tokens) + " tokens; model '" +
                              Clip(model) + "' takes at most " + std::to_string(limit) +
                              " (its max_position_embeddings, or --max-context-tokens)");
}

// name, labels and ttl of Build, Extend and Ingest requests.
Status ValidateMetadata(const std::string& name,
                        const google::protobuf::Map<std::string, std::string>& labels,
                        int64_t ttl_seconds, const char* prefix) {
  const std::string p(prefix);
  RETURN_IF_ERROR(ValidateText(name, (p + "name").c_str(), kMaxNameBytes));
  RETURN_IF_ERROR(ValidateLabels(labels, (p + "labels").c_str()));
  return ValidateTtl(ttl_seconds, (p + "ttl_seconds").c_str());
}

// An ingest under the name of a model this server hosts must carry that
// model's spec exactly: otherwise a client could store KV of another shape
// (or fake KV) under the hosted model's name and fingerprint.
Status CheckIngestSpec(const v1::ModelSpec& hosted, const v1::ModelSpec& got) {
  auto field = [&](const char* name, uint64_t want, uint64_t have) -> Status {
    if (want == have) return Status::OK();
    return InvalidArgumentError("header.model." + std::string(name) + ": model '" + hosted.name() +
                                "' is hosted here with " + name + " " + std::to_string(want) +
                                ", the ingest says " + std::to_string(have) +
                                "; an ingest under a hosted model's name must match its spec "
                                "exactly");
  };
  RETURN_IF_ERROR(field("n_layers", hosted.n_layers(), got.n_layers()));
  RETURN_IF_ERROR(field("n_q_heads", hosted.n_q_heads(), got.n_q_heads()));
  RETURN_IF_ERROR(field("n_kv_heads", hosted.n_kv_heads(), got.n_kv_heads()));
  RETURN_IF_ERROR(field("head_dim", hosted.head_dim(), got.head_dim()));
  RETURN_IF_ERROR(field("kv_dtype", hosted.kv_dtype(), got.kv_dtype()));
  if (hosted.fingerprint() != got.fingerprint()) {
    return InvalidArgumentError("header.model.fingerprint: model '" + hosted.name() +
                                "' is hosted here with another fingerprint; an ingest under a "
                                "hosted model's name must carry its fingerprint");
  }
  return Status::OK();
}

// A child ingest (IngestHeader.parent_id) stores KV next to its parent's
// pages: its model must be the parent's in every fact that shapes or
// positions the KV.
Status CheckChildSpec(const v1::ModelSpec& parent, const v1::ModelSpec& got) {
  auto mismatch = [](const std::string& field, const std::string& want, const std::string& have) {
    return FailedPreconditionError("header.model." + field + ": the parent context has " +
                                   want + ", the ingest says " + have +
                                   "; a child's model must equal its parent's");
  };
  auto number = [&](const char* field, uint64_t want, uint64_t have) -> Status {
    if (want == have) return Status::OK();
    return mismatch(field, std::to_string(want), std::to_string(have));
  };
  if (parent.name() != got.name()) {
    return mismatch("name", "'" + Clip(parent.name()) + "'", "'" + Clip(got.name()) + "'");
  }
  RETURN_IF_ERROR(number("n_layers", parent.n_layers(), got.n_layers()));
  RETURN_IF_ERROR(number("n_q_heads", parent.n_q_heads(), got.n_q_heads()));
  RETURN_IF_ERROR(number("n_kv_heads", parent.n_kv_heads(), got.n_kv_heads()));
  RETURN_IF_ERROR(number("head_dim", parent.head_dim(), got.head_dim()));
  if (parent.kv_dtype() != got.kv_dtype()) {
    return mismatch("kv_dtype", v1::DType_Name(parent.kv_dtype()),
                    v1::DType_Name(got.kv_dtype()));
  }
  if (parent.fingerprint() != got.fingerprint()) {
    return mismatch("fingerprint", "another fingerprint", "this one");
  }
  if (parent.rope().SerializeAsString() != got.rope().SerializeAsString()) {
    return mismatch("rope", "{" + parent.rope().ShortDebugString() + "}",
                    "{" + got.rope().ShortDebugString() + "}");
  }
  return Status::OK();
}

// Index requests of a child (ExtendContext, or an ingest with a parent):
// the requested ones, or (none given) the parent's methods and parameters,
// minus those derived from the parent's size (index::ParamsForExtend).
StatusOr<std::vector<IndexRequest>> ChildIndexRequests(
    const google::protobuf::RepeatedPtrField<v1::IndexSpec>& requested,
    const v1::ContextManifest& parent, const std::string& defaults) {
  if (!requested.empty()) return IndexRequests(requested, defaults);
  std::vector<IndexRequest> out;
  for (const auto& ip : parent.index_params()) {
    IndexRequest r;
    r.method = ip.method();
    auto info = index::FindMethodInfo(r.method);
    if (!info.ok()) return info.status().WithContext("parent index");
    r.params = index::ParamsForExtend(**info, index::MethodParams(ip.params().begin(),
                                                                  ip.params().end()));
    out.push_back(std::move(r));
  }
  return out;
}

// The tokens, name, labels and indexes of an ingest: the header's, and for a
// child (parent != null) the parent's tokens first, its name, labels and
// indexes as defaults, after checking the child's model against it.
Status IngestContents(const v1::IngestHeader& h, const storage::ContextReader* parent,
                      const std::string& default_indexes, IngestBuilder::Header* header) {
  if (parent) {
    const v1::ContextManifest& pm = parent->manifest();
    RETURN_IF_ERROR(CheckChildSpec(pm.model(), h.model()));
    if (h.tokens().ids().empty()) {
      return InvalidArgumentError(
          "header.tokens: a child (header.parent_id set) needs at least one appended token");
    }
    ASSIGN_OR_RETURN(header->tokens, parent->ReadTokens());
    header->parent = parent->id();
    header->name = h.name().empty() ? pm.name() : h.name();
    header->labels.insert(pm.labels().begin(), pm.labels().end());
  } else {
    header->name = h.name();
  }
  header->tokens.insert(header->tokens.end(), h.tokens().ids().begin(), h.tokens().ids().end());
  for (const auto& [k, v] : h.labels()) header->labels[k] = v;
  ASSIGN_OR_RETURN(header->indexes,
                   parent ? ChildIndexRequests(h.indexes(), parent->manifest(), default_indexes)
                          : IndexRequests(h.indexes(), default_indexes));
  return Status::OK();
}

// The builder header of an ingest from the client's: the model and the
// contents (IngestContents), after checking the metadata, the model name,
// a hosted model's spec and the context length. The caller sets the tenant
// and the rest.
Status IngestHeaderFor(ServiceContext* ctx, const v1::IngestHeader& h,
                       const storage::ContextReader* parent, IngestBuilder::Header* header) {
  header->model = h.model();
  RETURN_IF_ERROR(ValidateMetadata(h.name(), h.labels(), h.ttl_seconds(), "header."));
  RETURN_IF_ERROR(ValidateText(h.model().name(), "header.model.name", kMaxModelNameBytes));
  RETURN_IF_ERROR(IngestContents(h, parent, ctx->config.default_indexes, header));
  std::shared_ptr<const LoadedModel> hosted_model;
  if (ctx->models.IsHosted(h.model().name())) {
    ASSIGN_OR_RETURN(hosted_model, ctx->models.Get(h.model().name()));
    RETURN_IF_ERROR(CheckIngestSpec(hosted_model->spec, h.model()));
  }
  return CheckContextLength(header->tokens.size(),
                            MaxContextTokens(ctx->config, hosted_model.get()), h.model().name());
}

// Conversion buffers of an ingest's chunks, reused from chunk to chunk.
struct IngestScratch {
  std::vector<float> k, v, q;
};

// Adds one IngestLayerChunk to the build. K and V already in the stored
// dtype, and no queries: stored as they came, with no conversion (the usual
// GPU worker's bf16 KV); else converted to float through *scratch.
Status AddIngestChunk(const v1::IngestLayerChunk& c, IngestBuilder* b, IngestScratch* scratch) {
  const int64_t NKV = b->n_kv_heads(), NQ = b->n_q_heads(), D = b->head_dim();
  const int64_t n = c.n_tokens();
  const int layer = static_cast<int>(std::min<uint32_t>(c.layer(), INT32_MAX));
  const bool has_q = c.has_q() && !c.q().data().empty();
  const auto k_dtype = FromProtoDType(c.k().dtype());
  if (n > 0 && !has_q && k_dtype.ok() && *k_dtype == b->kv_dtype() &&
      c.v().dtype() == c.k().dtype()) {
    RETURN_IF_ERROR(CheckStoredTensor(c.k(), {NKV, n, D}, b->kv_dtype(), "chunk.k"));
    RETURN_IF_ERROR(CheckStoredTensor(c.v(), {NKV, n, D}, b->kv_dtype(), "chunk.v"));
    return b->AddStoredChunk(layer, static_cast<int64_t>(c.token_start()), n,
                             c.k().data().data(), c.v().data().data());
  }
  std::vector<float>& k = scratch->k;
  std::vector<float>& v = scratch->v;
  std::vector<float>& q = scratch->q;
  if (n > 0) {
    RETURN_IF_ERROR(TensorToFloat(c.k(), {NKV, n, D}, "chunk.k", &k));
    RETURN_IF_ERROR(TensorToFloat(c.v(), {NKV, n, D}, "chunk.v", &v));
    if (has_q) RETURN_IF_ERROR(TensorToFloat(c.q(), {NQ, n, D}, "chunk.q", &q));
  }
  return b->AddChunk(layer, static_cast<int64_t>(c.token_start()), n, k.data(), v.data(),
                     has_q ? q.data() : nullptr);
}

// Stores an ingest's chunks on a thread of its own, in order, while the RPC
// thread reads the next ones: receiving a chunk (its protobuf parse)
// overlaps storing the one before. At most `depth` chunks wait. The first
// error stops it: later chunks are dropped and Push and Finish return it.
class ChunkStorer {
 public:
  ChunkStorer(IngestBuilder* b, size_t depth) : b_(b), depth_(depth) {
    thread_ = std::thread([this] { Run(); });
  }
  // Drops the chunks still waiting (an RPC that ends early stores no more).
  ~ChunkStorer() {
    {
      std::lock_guard<std::mutex> l(mu_);
      closed_ = true;
      queue_.clear();
    }
    cv_.notify_all();
    thread_.join();
  }
  ChunkStorer(const ChunkStorer&) = delete;
  ChunkStorer& operator=(const ChunkStorer&) = delete;

  // Queues `m` (blocking while `depth` chunks wait); the first error so far.
  Status Push(v1::IngestChunk&& m) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return queue_.size() < depth_ || !status_.ok(); });
    if (!status_.ok()) return status_;
    queue_.push_back(std::move(m));
    cv_.notify_all();
    return Status::OK();
  }
  // Waits until every queued chunk is stored; the first error, if any.
  Status Finish() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return (queue_.empty() && !busy_) || !status_.ok(); });
    return status_;
  }

 private:
  void Run() {
    IngestScratch scratch;
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return !queue_.empty() || closed_; });
      if (queue_.empty() || !status_.ok()) return;
      v1::IngestChunk m = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      l.unlock();
      cv_.notify_all();
      // On an error ~IngestBuilder removes what was written.
      Status s = AddIngestChunk(m.chunk(), b_, &scratch);
      l.lock();
      busy_ = false;
      if (!s.ok()) {
        status_ = s;
        queue_.clear();
      }
      cv_.notify_all();
    }
  }

  IngestBuilder* const b_;
  const size_t depth_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::IngestChunk> queue_;  // guarded by mu_
  bool busy_ = false;                  // guarded by mu_: a chunk being stored
  bool closed_ = false;                // guarded by mu_
  Status status_;                      // guarded by mu_
  std::thread thread_;
};

// Commits an ingest, publishes it to the cluster (when there is one) and its
// CREATED or EXTENDED (child) and READY events; *info is the new context.
Status CommitIngest(ServiceContext* ctx, IngestBuilder* b, bool child, v1::ContextInfo* info) {
  ASSIGN_OR_RETURN(v1::ContextManifest manifest, b->Commit());
  if (ctx->cluster) RETURN_IF_ERROR(ctx->cluster->PublishReady(manifest));
  *info = ManifestToInfo(manifest);
  ctx->events.Publish(child ? v1::ContextEvent::EXTENDED : v1::ContextEvent::CREATED, *info);
  ctx->events.Publish(v1::ContextEvent::READY, *info);
  return Status::OK();
}

}  // namespace

grpc::Status AdminServiceImpl::BuildContext(grpc::ServerContext* context,
                                            const v1::BuildContextRequest* request,
                                            grpc::ServerWriter<v1::BuildProgress>* writer) {
  const RpcSpec spec{"BuildContext", auth::Action::kBuild, Admission::kStreamNotDraining};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    if (request->input_case() == v1::BuildContextRequest::INPUT_NOT_SET) {
      return Invalid("one of text or tokens is required");
    }
    if (Status s = ValidateMetadata(request->name(), request->labels(), request->ttl_seconds(), "");
        !s.ok()) {
      return ToGrpc(s);
    }
    if (Status s = ValidateText(request->model(), "model", kMaxModelNameBytes); !s.ok()) {
      return ToGrpc(s);
    }
    auto model = ctx_->models.Get(request->model());
    if (!model.ok()) return ToGrpc(model.status());
    BuildJob job;
    job.model = *model;
    Status s = Tokenize(**model, request->has_text(), request->text(), request->tokens(),
                        request->add_bos(), &job.tokens);
    if (!s.ok()) return ToGrpc(s);
    s = CheckContextLength(job.tokens.size(), MaxContextTokens(ctx_->config, model->get()),
                           (*model)->name);
    if (!s.ok()) return ToGrpc(s);
    auto idx = IndexRequests(request->indexes(), ctx_->config.default_indexes);
    if (!idx.ok()) return ToGrpc(idx.status());
    job.indexes = std::move(idx).value();
    job.name = request->name();
    auto tenant = ctx_->access->TenantFor(rpc.principal(), request->tenant());
    if (!tenant.ok()) return ToGrpc(tenant.status());
    job.tenant = *tenant;
    job.id_namespace = ctx_->access->IdNamespace(job.tenant, /*ingested=*/false);
    job.provenance = v1::PROVENANCE_BUILT;
    job.labels.insert(request->labels().begin(), request->labels().end());
    job.ttl_ms = request->ttl_seconds() * 1000;
    job.pinned = request->pin();
    return RunBuildRpc(context, &job, writer, /*extend=*/false, &rpc, job.tokens.size());
  });
}

grpc::Status AdminServiceImpl::ExtendContext(grpc::ServerContext* context,
                                             const v1::ExtendContextRequest* request,
                                             grpc::ServerWriter<v1::BuildProgress>* writer) {
  const RpcSpec spec{"ExtendContext", auth::Action::kBuild, Admission::kStreamNotDraining};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto pid = ParseContextId(request->parent_id());
    if (!pid.ok()) return ToGrpc(pid.status().WithContext("parent_id"));
    rpc.set_context_id(pid->ToHex());
    grpc::Status refuse;
    if (auto target = ForwardTarget(ctx_, context, *pid, &refuse)) {
      return ForwardServerStream(
          ctx_, context, "ExtendContext", *target, *request, writer,
          [](auto ch, grpc::ClientContext* cc, const v1::ExtendContextRequest& r) {
            return v1::ContextAdmin::NewStub(ch)->ExtendContext(cc, r);
          });
    }
    if (!refuse.ok()) return refuse;
    if (request->input_case() == v1::ExtendContextRequest::INPUT_NOT_SET) {
      return Invalid("one of text or tokens (the appended part) is required");
    }
    if (Status s = ValidateMetadata(request->name(), request->labels(), request->ttl_seconds(), "");
        !s.ok()) {
      return ToGrpc(s);
    }
    // A shared parent may be extended by any builder: the child belongs to
    // the caller's tenant.
    auto reader =
        AccessControl::OpenReader(ctx_->store.get(), rpc.principal(), *pid, auth::Action::kRead);
    if (!reader.ok()) return ToGrpc(reader.status());
    const v1::ContextManifest& parent = (*reader)->manifest();
    auto model = ctx_->models.Get(parent.model().name());
    if (!model.ok()) return ToGrpc(model.status());
    if ((*model)->spec.fingerprint() != parent.model().fingerprint()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "the parent was built with a different version of model '" +
                              parent.model().name() + "' (fingerprint mismatch)");
    }
    auto parent_tokens = (*reader)->ReadTokens();
    if (!parent_tokens.ok()) return ToGrpc(parent_tokens.status());
    BuildJob job;
    job.model = *model;
    job.tokens.assign(parent_tokens->begin(), parent_tokens->end());
    std::vector<int32_t> extra;
    Status s =
        Tokenize(**model, request->has_text(), request->text(), request->tokens(), false, &extra);
    if (!s.ok()) return ToGrpc(s);
    job.tokens.insert(job.tokens.end(), extra.begin(), extra.end());
    s = CheckContextLength(job.tokens.size(), MaxContextTokens(ctx_->config, model->get()),
                           (*model)->name);
    if (!s.ok()) return ToGrpc(s);
    job.parent = *pid;
    // Default: the parent's index methods and parameters (CSA's C is
    // re-derived for the child).
    auto idx = ChildIndexRequests(request->indexes(), parent, ctx_->config.default_indexes);
    if (!idx.ok()) return ToGrpc(idx.status());
    job.indexes = std::move(idx).value();
    job.name = request->name().empty() ? parent.name() : request->name();
    // The child belongs to the caller's tenant (an operator's: the parent's),
    // and inherits the parent's provenance: a child of ingested KV is ingested.
    job.tenant = auth::IsServerWide(rpc.principal().role) ? parent.tenant()
                                                          : rpc.principal().tenant;
    job.provenance = parent.provenance();
    job.id_namespace =
        ctx_->access->IdNamespace(job.tenant, job.provenance == v1::PROVENANCE_INGESTED);
    job.labels.insert(parent.labels().begin(), parent.labels().end());
    for (const auto& [k, v] : request->labels()) job.labels[k] = v;
    job.ttl_ms = request->ttl_seconds() * 1000;
    job.pinned = request->pin();
    reader->reset();  // drop the lease; BeginBuild takes its own reference
    return RunBuildRpc(context, &job, writer, /*extend=*/true, &rpc, extra.size());
  });
}

grpc::Status AdminServiceImpl::IngestContext(grpc::ServerContext* context,
                                             grpc::ServerReader<v1::IngestChunk>* reader,
                                             v1::ContextInfo* response) {
  const RpcSpec spec{"IngestContext", auth::Action::kBuild, Admission::kStreamNotDraining};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    v1::IngestChunk msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      return Invalid("the first IngestChunk must carry the header");
    }
    const v1::IngestHeader& h = msg.header();
    // A child goes where its parent is stored (cluster), whole stream and all.
    std::unique_ptr<storage::ContextReader> parent;
    if (!h.parent_id().empty()) {
      auto pid = ParseContextId(h.parent_id(), "header.parent_id");
      if (!pid.ok()) return ToGrpc(pid.status());
      rpc.set_context_id(pid->ToHex());
      grpc::Status refuse;
      if (auto target = ForwardTarget(ctx_, context, *pid, &refuse)) {
        return ForwardClientStream(ctx_, context, "IngestContext", *target, msg, reader, response,
                                   [](auto ch, grpc::ClientContext* cc, v1::ContextInfo* r) {
                                     return v1::ContextAdmin::NewStub(ch)->IngestContext(cc, r);
                                   });
      }
      if (!refuse.ok()) return refuse;
      // As ExtendContext: any parent the caller may read (a shared one too).
      auto r =
          AccessControl::OpenReader(ctx_->store.get(), rpc.principal(), *pid, auth::Action::kRead);
      if (!r.ok()) return ToGrpc(r.status().WithContext("header.parent_id"));
      parent = std::move(r).value();
    }
    IngestBuilder::Header header;
    if (Status s = IngestHeaderFor(ctx_, h, parent.get(), &header); !s.ok()) return ToGrpc(s);
    // A child belongs to the caller's tenant, as in ExtendContext (an
    // operator's child without header.tenant: the parent's).
    const std::string& want_tenant =
        parent && h.tenant().empty() && auth::IsServerWide(rpc.principal().role)
            ? parent->manifest().tenant()
            : h.tenant();
    auto tenant = ctx_->access->TenantFor(rpc.principal(), want_tenant);
    if (!tenant.ok()) return ToGrpc(tenant.status());
    rpc.set_tenant(*tenant);
    header.tenant = *tenant;
    // Ingested KV is asserted by the client: its ids live apart from built
    // ones, so a later BuildContext of the same tokens never reuses it.
    header.id_namespace = ctx_->access->IdNamespace(*tenant, /*ingested=*/true);
    header.provenance = v1::PROVENANCE_INGESTED;
    header.ttl_ms = h.ttl_seconds() * 1000;
    header.pinned = h.pin();
    const uint64_t new_tokens = static_cast<uint64_t>(h.tokens().ids_size());
    auto quota = ctx_->quotas->AdmitBuild(*tenant, new_tokens);
    if (!quota.ok()) return ToGrpc(quota.status());
    header.before_commit = [this, t = *tenant, g = &*quota](uint64_t bytes) {
      return ctx_->quotas->AdmitCommit(t, bytes, g);
    };
    const bool child = parent != nullptr;
    auto builder = IngestBuilder::Begin(ctx_->store.get(), std::move(header), BuildOptions{});
    parent.reset();  // the build (or the reused child) holds the parent now
    if (!builder.ok()) return ToGrpc(builder.status());
    IngestBuilder& b = **builder;
    if (b.reused()) {  // already stored with these indexes: drain the stream, return it
      while (reader->Read(&msg)) {
      }
      *response = ManifestToInfo(b.existing());
      rpc.set_context_id(response->context_id());
      return grpc::Status::OK;
    }
    bool committed = false;
    {
      ChunkStorer storer(&b, /*depth=*/2);
      while (reader->Read(&msg)) {
        if (context->IsCancelled()) return ToGrpc(CancelledError("ingest cancelled"));
        if (msg.has_commit()) {
          committed = true;
          break;
        }
        if (!msg.has_chunk()) {
          return ToGrpc(InvalidArgumentError("expected a chunk or the commit"));
        }
        if (Status s = storer.Push(std::move(msg)); !s.ok()) return ToGrpc(s);
        msg = v1::IngestChunk();
      }
      if (Status s = storer.Finish(); !s.ok()) return ToGrpc(s);
    }
    if (!committed) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          "the ingest stream ended before IngestCommit; nothing was stored");
    }
    if (Status s = CommitIngest(ctx_, &b, child, response); !s.ok()) return ToGrpc(s);
    rpc.set_context_id(response->context_id());
    return grpc::Status::OK;
  });
}

grpc::Status AdminServiceImpl::RunBuildRpc(grpc::ServerContext* context, BuildJob* job,
                                           grpc::ServerWriter<v1::BuildProgress>* writer,
                                           bool extend, RpcScope* rpc, uint64_t new_tokens) {
  rpc->set_tenant(job->tenant);
  auto quota = ctx_->quotas->AdmitBuild(job->tenant, new_tokens);
  if (!quota.ok()) return ToGrpc(quota.status());
  job->before_commit = [this, t = job->tenant, g = &*quota](uint64_t bytes) {
    return ctx_->quotas->AdmitCommit(t, bytes, g);
  };
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
    info.set_tenant(job->tenant);  // watchers see their own tenant's events only
    info.set_state(v1::CONTEXT_STATE_FAILED);
    ctx_->events.Publish(v1::ContextEvent::FAILED, info);
    return ToGrpc(outcome.status());
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BuildProgress final_progress;
  final_progress.phase = BuildProgress::Phase::kDone;
  final_progress.tokens_total = final_progress.tokens_prefilled = outcome->manifest.n_tokens();
  final_progress.layers_total = final_progress.layers_indexed =
      outcome->manifest.model().n_layers();
  final_progress.bytes_written = outcome->manifest.stored_bytes();
  final_progress.tokens_per_s = secs > 0 ? outcome->manifest.n_tokens() / secs : 0;
  v1::BuildProgress done = ProgressToProto(final_progress);
  done.set_reused(outcome->reused);
  *done.mutable_context() = ManifestToInfo(outcome->manifest);
  if (!extend) rpc->set_context_id(done.context().context_id());
  if (ctx_->cluster) {
    // READY is reported once --min-replicas durable copies exist.
    if (Status pub = ctx_->cluster->PublishReady(outcome->manifest); !pub.ok()) {
      return ToGrpc(pub);
    }
  }
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

grpc::Status AdminServiceImpl::GetContext(grpc::ServerContext* context,
                                          const v1::GetContextRequest* request,
                                          v1::ContextInfo* response) {
  const RpcSpec spec{"GetContext", auth::Action::kRead};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    grpc::Status refuse;
    if (auto target = ForwardTarget(ctx_, context, *id, &refuse)) {
      return ForwardUnary(
          ctx_, context, "GetContext", *target, [&](auto ch, grpc::ClientContext* cc) {
            return v1::ContextAdmin::NewStub(ch)->GetContext(cc, *request, response);
          });
    }
    if (!refuse.ok()) return refuse;
    auto m =
        AccessControl::GetManifest(ctx_->store.get(), rpc.principal(), *id, auth::Action::kRead);
    if (!m.ok()) return ToGrpc(m.status());
    *response = ManifestToInfo(*m);
    return grpc::Status::OK;
  });
}

grpc::Status AdminServiceImpl::ListContexts(grpc::ServerContext* context,
                                            const v1::ListContextsRequest* request,
                                            v1::ListContextsResponse* response) {
  const RpcSpec spec{"ListContexts", auth::Action::kRead};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    const auth::Principal& who = rpc.principal();
    if (!request->tenant().empty() && request->tenant() != who.tenant &&
        !auth::IsServerWide(who.role)) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          "tenant: only an operator may list another tenant's "
                          "contexts; leave it empty to list your own");
    }
    uint32_t page_size = request->page_size() == 0 ? 100 : request->page_size();
    if (page_size > 1000) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "page_size must be <= 1000, got " + std::to_string(request->page_size()));
    }
    // Contexts come ordered by id; the page token is the last id returned.
    std::string after = request->page_token();
    if (!after.empty() && !storage::ContextId::FromHex(after).ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "page_token is not a token returned by ListContexts");
    }
    // Pages are bounded by bytes as well as count, so a page of contexts
    // with large labels still fits a message; the token still makes progress
    // (at least one context per page).
    const size_t byte_budget = ctx_->config.max_message_bytes / 2;
    size_t bytes = 0;
    for (const auto& m : ctx_->store->ListContexts()) {
      if (!AccessControl::CanAccess(who, m.tenant(), m.shared(), auth::Action::kRead)) continue;
      if (!request->tenant().empty() && m.tenant() != request->tenant()) continue;
      v1::ContextInfo info = ManifestToInfo(m);
      if (!after.empty() && info.context_id() <= after) continue;
      if (request->state_filter() != v1::CONTEXT_STATE_UNSPECIFIED &&
          m.state() != request->state_filter()) {
        continue;
      }
      if (!LabelsMatch(m, request->label_filter())) continue;
      const size_t size = info.ByteSizeLong();
      if (static_cast<uint32_t>(response->contexts_size()) == page_size ||
          (response->contexts_size() > 0 && bytes + size > byte_budget)) {
        response->set_next_page_token(response->contexts().rbegin()->context_id());
        break;
      }
      bytes += size;
      *response->add_contexts() = std::move(info);
    }
    return grpc::Status::OK;
  });
}

grpc::Status AdminServiceImpl::EvictContext(grpc::ServerContext* context,
                                            const v1::EvictContextRequest* request,
                                            v1::EvictContextResponse* response) {
  const RpcSpec spec{"EvictContext", auth::Action::kBuild};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    rpc.set_context_id(id->ToHex());
    grpc::Status refuse;
    if (auto target = ForwardTarget(ctx_, context, *id, &refuse)) {
      return ForwardUnary(
          ctx_, context, "EvictContext", *target, [&](auto ch, grpc::ClientContext* cc) {
            return v1::ContextAdmin::NewStub(ch)->EvictContext(cc, *request, response);
          });
    }
    if (!refuse.ok()) return refuse;
    auto m =
        AccessControl::GetManifest(ctx_->store.get(), rpc.principal(), *id, auth::Action::kBuild);
    if (!m.ok()) return ToGrpc(m.status());
    auto deferred = ctx_->store->Delete(*id);
    if (!deferred.ok()) return ToGrpc(deferred.status());
    if (ctx_->cluster) {
      // Every other holder deletes its copy when it sees the tombstone.
      if (Status rec = ctx_->cluster->RecordEvicted(*id); !rec.ok()) {
        return ToGrpc(rec.WithContext("evicted here; recording it in etcd"));
      }
    }
    if (ctx_->shm_cache) ctx_->shm_cache->DropContext(id->ToHex());
    response->set_deferred(*deferred);
    response->set_evicted(!*deferred);
    response->set_bytes_reclaimed(*deferred ? 0 : m->stored_bytes());
    ctx_->metrics.GetCounter("ctxcache_evictions_total", kEvictionsHelp)->Inc();
    ctx_->events.Publish(v1::ContextEvent::EVICTED, ManifestToInfo(*m));
    return grpc::Status::OK;
  });
}

grpc::Status AdminServiceImpl::PinContext(grpc::ServerContext* context,
                                          const v1::PinContextRequest* request,
                                          v1::ContextInfo* response) {
  const RpcSpec spec{"PinContext", auth::Action::kBuild};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    if (auto fwd = MaybeForwardFlag(context, "PinContext", request->context_id(),
                                    [&](auto ch, grpc::ClientContext* cc) {
                                      return v1::ContextAdmin::NewStub(ch)->PinContext(
                                          cc, *request, response);
                                    })) {
      return *fwd;
    }
    return UpdateFlag(
        &rpc, request->context_id(), auth::Action::kBuild,
        [&](const storage::ContextId& id) { return ctx_->store->SetPinned(id, request->pinned()); },
        response);
  });
}

grpc::Status AdminServiceImpl::ShareContext(grpc::ServerContext* context,
                                            const v1::ShareContextRequest* request,
                                            v1::ContextInfo* response) {
  const RpcSpec spec{"ShareContext", auth::Action::kShare};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    if (auto fwd = MaybeForwardFlag(context, "ShareContext", request->context_id(),
                                    [&](auto ch, grpc::ClientContext* cc) {
                                      return v1::ContextAdmin::NewStub(ch)->ShareContext(
                                          cc, *request, response);
                                    })) {
      return *fwd;
    }
    return UpdateFlag(
        &rpc, request->context_id(), auth::Action::kShare,
        [&](const storage::ContextId& id) { return ctx_->store->SetShared(id, request->shared()); },
        response);
  });
}

grpc::Status AdminServiceImpl::UpdateFlag(
    RpcScope* rpc, const std::string& context_id, auth::Action action,
    const std::function<Status(const storage::ContextId&)>& update, v1::ContextInfo* response) {
  auto id = ParseContextId(context_id);
  if (!id.ok()) return ToGrpc(id.status());
  rpc->set_context_id(id->ToHex());
  auto before = AccessControl::GetManifest(ctx_->store.get(), rpc->principal(), *id, action);
  if (!before.ok()) return ToGrpc(before.status());
  if (Status s = update(*id); !s.ok()) return ToGrpc(s);
  auto m = ctx_->store->GetManifest(*id);
  if (!m.ok()) return ToGrpc(m.status());
  if (ctx_->cluster) {
    // Every holder applies the change from etcd.
    if (Status rec = ctx_->cluster->RecordLifecycle(*m); !rec.ok()) {
      return ToGrpc(rec.WithContext("changed here; recording it in etcd"));
    }
  }
  *response = ManifestToInfo(*m);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                                        v1::ServerStats* response) {
  const RpcSpec spec{"GetStats", auth::Action::kStats};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    if (!auth::IsServerWide(rpc.principal().role)) {
      // All but operators see their own tenant only: nothing about other
      // tenants' contexts (counts and bytes would leak their activity), nor
      // server-wide sessions or queue depth.
      TenantUsage u = ctx_->quotas->Usage(rpc.principal().tenant);
      response->set_version(std::string(Version()));
      response->set_n_contexts(u.contexts);
      response->set_stored_bytes(u.stored_bytes);
      for (const auto& m : ctx_->models.Available()) response->add_models(m);
      return grpc::Status::OK;
    }
    storage::StoreStats st = ctx_->store->GetStats();
    response->set_version(std::string(Version()));
    response->set_uptime_s(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - ctx_->start_time).count());
    response->set_n_contexts(st.ready_contexts);
    response->set_stored_bytes(st.stored_bytes);
    response->set_capacity_bytes(st.capacity_bytes);
    response->set_open_sessions(ctx_->open_sessions.load());
    response->set_build_queue_depth(ctx_->build_queue.waiting());
    for (const auto& m : ctx_->models.Available()) response->add_models(m);
    for (const auto& [cf, bytes] : st.bytes_by_cf) (*response->mutable_bytes_by_kind())[cf] = bytes;
    return grpc::Status::OK;
  });
}

}  // namespace ctxcache::service
