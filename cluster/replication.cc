#include "cluster/replication.h"

#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "proto/dtype_convert.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"

namespace ctxcache::cluster {

std::shared_ptr<grpc::Channel> PeerChannels::Get(const std::string& address) {
  std::lock_guard lock(mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options_.tls_root_ca.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.tls_root_ca;
    ssl.pem_cert_chain = options_.tls_cert;
    ssl.pem_private_key = options_.tls_key;
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  auto ch = grpc::CreateCustomChannel(address, creds, args);
  channels_[address] = ch;
  return ch;
}

void PeerChannels::Prepare(grpc::ClientContext* ctx, int64_t timeout_ms) const {
  if (!options_.cluster_key.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.cluster_key);
  }
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
}

Status FromPeerStatus(const grpc::Status& s, const std::string& peer) {
  if (s.ok()) return Status::OK();
  return Status(static_cast<StatusCode>(s.error_code()),
                std::string("peer ").append(peer).append(": ").append(s.error_message()));
}

Status ExportContext(storage::Store* store, const storage::ContextId& id, size_t max_chunk_bytes,
                     const std::function<Status(const v1::ReplicaChunk&)>& emit) {
  ASSIGN_OR_RETURN(auto reader, store->OpenReader(id));
  const v1::ContextManifest& m = reader->manifest();
  v1::ReplicaChunk chunk;
  *chunk.mutable_manifest() = m;
  RETURN_IF_ERROR(emit(chunk));

  ASSIGN_OR_RETURN(auto tokens, reader->ReadTokens());
  const size_t ids_per_msg = std::max<size_t>(1, max_chunk_bytes / 4);
  for (size_t i = 0; i < tokens.size(); i += ids_per_msg) {
    chunk.Clear();
    auto* t = chunk.mutable_tokens();
    size_t end = std::min(tokens.size(), i + ids_per_msg);
    t->mutable_ids()->Add(tokens.begin() + i, tokens.begin() + end);
    RETURN_IF_ERROR(emit(chunk));
  }

  for (const auto& a : m.artifacts()) {
    ASSIGN_OR_RETURN(std::string bytes,
                     reader->ReadArtifact(a.layer(), a.kv_head(), static_cast<uint8_t>(a.kind())));
    size_t off = 0;
    do {
      chunk.Clear();
      auto* r = chunk.mutable_artifact();
      r->set_layer(a.layer());
      r->set_kv_head(a.kv_head());
      r->set_kind(a.kind());
      r->set_name(a.name());
      r->set_offset(off);
      r->set_total_bytes(bytes.size());
      size_t n = std::min(max_chunk_bytes, bytes.size() - off);
      r->set_data(bytes.data() + off, n);
      off += n;
      RETURN_IF_ERROR(emit(chunk));
    } while (off < bytes.size());
  }

  // KV of tokens [first, n_tokens): a child's own tokens start at its
  // prefix (the parent's pages are the parent's, copied with the parent).
  const uint64_t first = m.parent_id().empty() ? 0 : m.prefix_tokens();
  const uint32_t B = m.block_tokens();
  const uint32_t head_dim = m.model().head_dim();
  const uint64_t n_tokens = m.n_tokens();
  ASSIGN_OR_RETURN(DType dtype, FromProtoDType(m.model().kv_dtype()));
  const size_t row_bytes = size_t{head_dim} * DTypeSize(dtype);
  const uint32_t blocks_per_msg =
      std::max<uint32_t>(1, static_cast<uint32_t>(max_chunk_bytes / (2 * B * row_bytes)));
  storage::PageBatch batch;
  std::vector<uint32_t> blocks;
  for (uint32_t layer = 0; layer < m.model().n_layers(); ++layer) {
    for (uint32_t head = 0; head < m.model().n_kv_heads(); ++head) {
      uint64_t tok = first;
      while (tok < n_tokens) {
        uint32_t b0 = static_cast<uint32_t>(tok / B);
        uint32_t b1 = std::min<uint32_t>(b0 + blocks_per_msg, reader->n_blocks());
        blocks.clear();
        for (uint32_t b = b0; b < b1; ++b) blocks.push_back(b);
        RETURN_IF_ERROR(reader->ReadPages(layer, head, blocks, &batch));
        chunk.Clear();
        auto* kv = chunk.mutable_kv();
        kv->set_layer(layer);
        kv->set_kv_head(head);
        kv->set_token_start(tok);
        kv->set_dtype(m.model().kv_dtype());
        std::string* k = kv->mutable_k();
        std::string* v = kv->mutable_v();
        uint64_t sent = 0;
        for (size_t i = 0; i < batch.size(); ++i) {
          uint64_t block_first = uint64_t{batch.blocks[i]} * B;
          uint64_t skip = tok + sent > block_first ? tok + sent - block_first : 0;
          if (skip >= batch.n_tokens[i]) continue;
          uint64_t rows = batch.n_tokens[i] - skip;
          k->append(reinterpret_cast<const char*>(batch.K(i)) + skip * row_bytes, rows * row_bytes);
          v->append(reinterpret_cast<const char*>(batch.V(i)) + skip * row_bytes, rows * row_bytes);
          sent += rows;
        }
        if (sent == 0)
          return InternalError("export " + id.ToHex() + ": no progress at token " +
                               std::to_string(tok));
        kv->set_n_tokens(static_cast<uint32_t>(sent));
        RETURN_IF_ERROR(emit(chunk));
        tok += sent;
      }
    }
  }
  chunk.Clear();
  chunk.set_done(true);
  return emit(chunk);
}

namespace {

// Receives one export stream into a ContextWriter.
class Importer {
 public:
  Importer(storage::Store* store, const storage::ContextId& id) : store_(store), id_(id) {}

  // Returns true when the context already exists here (nothing to do).
  StatusOr<bool> Accept(const v1::ReplicaChunk& c) {
    switch (c.msg_case()) {
      case v1::ReplicaChunk::kManifest:
        if (have_manifest_) return DataLossError("export stream: second manifest");
        manifest_ = c.manifest();
        have_manifest_ = true;
        if (manifest_.context_id() != id_.AsBytes()) {
          return DataLossError("export stream: manifest is for another context");
        }
        return false;
      case v1::ReplicaChunk::kTokens:
        if (!have_manifest_ || writer_) return DataLossError("export stream: tokens out of order");
        tokens_.insert(tokens_.end(), c.tokens().ids().begin(), c.tokens().ids().end());
        return false;
      case v1::ReplicaChunk::kArtifact: {
        ASSIGN_OR_RETURN(bool exists, EnsureWriter());
        if (exists) return true;
        const auto& a = c.artifact();
        if (a.offset() != artifact_.size()) return DataLossError("export stream: artifact gap");
        artifact_.append(a.data());
        bytes_ += a.data().size();
        if (artifact_.size() > a.total_bytes())
          return DataLossError("export stream: artifact size");
        if (artifact_.size() == a.total_bytes()) {
          RETURN_IF_ERROR(writer_->PutArtifact(
              a.layer(), a.kv_head(), static_cast<uint8_t>(a.kind()), a.name(), artifact_));
          artifact_.clear();
        }
        return false;
      }
      case v1::ReplicaChunk::kKv: {
        ASSIGN_OR_RETURN(bool exists, EnsureWriter());
        if (exists) return true;
        const auto& kv = c.kv();
        bytes_ += kv.k().size() + kv.v().size();
        ASSIGN_OR_RETURN(DType model_dtype, FromProtoDType(manifest_.model().kv_dtype()));
        const uint64_t want =
            uint64_t{kv.n_tokens()} * manifest_.model().head_dim() * DTypeSize(model_dtype);
        if (kv.k().size() != want || kv.v().size() != want) {
          return DataLossError("export stream: k/v of " + std::to_string(kv.k().size()) + "/" +
                               std::to_string(kv.v().size()) + " bytes for " +
                               std::to_string(kv.n_tokens()) + " tokens");
        }
        ASSIGN_OR_RETURN(DType dtype, FromProtoDType(kv.dtype()));
        RETURN_IF_ERROR(writer_->AppendKV(kv.layer(), kv.kv_head(), kv.token_start(), kv.n_tokens(),
                                          dtype, kv.k().data(), kv.v().data()));
        return false;
      }
      case v1::ReplicaChunk::kDone: {
        ASSIGN_OR_RETURN(bool exists, EnsureWriter());
        if (exists) return true;
        if (!artifact_.empty()) return DataLossError("export stream: truncated artifact");
        for (const auto& p : manifest_.index_params()) writer_->AddIndexParams(p);
        ASSIGN_OR_RETURN(auto committed, writer_->Commit());
        (void)committed;
        writer_.reset();
        RETURN_IF_ERROR(store_->SetExpiry(id_, manifest_.expires_at_ms()));
        if (manifest_.shared()) RETURN_IF_ERROR(store_->SetShared(id_, true));
        done_ = true;
        return false;
      }
      default:
        return DataLossError("export stream: empty message");
    }
  }

  bool done() const { return done_; }
  uint64_t bytes() const { return bytes_; }
  const v1::ContextManifest& manifest() const { return manifest_; }

 private:
  StatusOr<bool> EnsureWriter() {
    if (writer_) return false;
    if (!have_manifest_) return DataLossError("export stream: no manifest first");
    if (tokens_.size() != manifest_.n_tokens()) {
      return DataLossError("export stream: " + std::to_string(tokens_.size()) +
                           " token ids for a context of " + std::to_string(manifest_.n_tokens()));
    }
    storage::BuildRequest req;
    req.model = manifest_.model();
    req.id_namespace = manifest_.id_namespace();
    req.provenance = manifest_.provenance();
    req.tokens = tokens_;
    if (!manifest_.parent_id().empty()) {
      ASSIGN_OR_RETURN(auto pid, storage::ContextId::FromBytes(manifest_.parent_id()));
      req.parent = pid;
    }
    req.name = manifest_.name();
    req.tenant = manifest_.tenant();
    req.labels = {manifest_.labels().begin(), manifest_.labels().end()};
    req.pinned = manifest_.pinned();
    ASSIGN_OR_RETURN(auto start, store_->BeginBuild(req));
    if (!start.writer) return true;
    if (start.writer->id() != id_) {
      start.writer->Abort().IgnoreError();
      return DataLossError("export stream: the copied manifest and tokens give id " +
                           start.writer->id().ToHex() + ", not " + id_.ToHex());
    }
    writer_ = std::move(start.writer);
    return false;
  }

  storage::Store* store_;
  storage::ContextId id_;
  v1::ContextManifest manifest_;
  bool have_manifest_ = false;
  std::vector<uint32_t> tokens_;
  std::unique_ptr<storage::ContextWriter> writer_;
  std::string artifact_;
  uint64_t bytes_ = 0;
  bool done_ = false;
};

}  // namespace

StatusOr<PullResult> PullContext(storage::Store* store, const storage::ContextId& id,
                                 const std::string& source_addr, PeerChannels* peers,
                                 int64_t timeout_ms) {
  if (store->GetManifest(id).ok()) return PullResult{false, 0};
  auto stub = peers->ClusterStub(source_addr);
  grpc::ClientContext ctx;
  peers->Prepare(&ctx, timeout_ms);
  v1::ExportContextRequest req;
  req.set_context_id(id.ToHex());
  auto stream = stub->ExportContext(&ctx, req);
  Importer importer(store, id);
  v1::ReplicaChunk chunk;
  Status err;
  bool exists = false;
  PullResult result;
  while (stream->Read(&chunk)) {
    if (chunk.has_manifest() && !chunk.manifest().parent_id().empty()) {
      // The parent's pages are the parent's: copy it first.
      auto pid = storage::ContextId::FromBytes(chunk.manifest().parent_id());
      if (!pid.ok()) {
        err = pid.status();
        break;
      }
      if (!store->GetManifest(*pid).ok()) {
        auto parent = PullContext(store, *pid, source_addr, peers, timeout_ms);
        if (!parent.ok()) {
          err = parent.status().WithContext("copying parent " + pid->ToHex());
          break;
        }
        result.bytes += parent->bytes;
      }
    }
    auto r = importer.Accept(chunk);
    if (!r.ok()) {
      err = r.status();
      break;
    }
    if (*r) {
      exists = true;
      break;
    }
  }
  if (!err.ok() || exists) ctx.TryCancel();
  grpc::Status fin = stream->Finish();
  if (!err.ok()) return err.WithContext("copying " + id.ToHex() + " from " + source_addr);
  if (exists) return PullResult{false, result.bytes};
  if (!fin.ok()) return FromPeerStatus(fin, source_addr);
  if (!importer.done()) {
    return UnavailableError("copying " + id.ToHex() + " from " + source_addr +
                            ": the stream ended early");
  }
  result.copied = true;
  result.bytes += importer.bytes();
  return result;
}

StatusOr<PullResult> RequestReplica(PeerChannels* peers, const std::string& target_addr,
                                    const storage::ContextId& id, const std::string& source_addr,
                                    int64_t timeout_ms) {
  auto stub = peers->ClusterStub(target_addr);
  grpc::ClientContext ctx;
  peers->Prepare(&ctx, timeout_ms);
  v1::ReplicateContextRequest req;
  req.set_context_id(id.ToHex());
  req.set_source_addr(source_addr);
  v1::ReplicateContextResponse resp;
  grpc::Status s = stub->ReplicateContext(&ctx, req, &resp);
  if (!s.ok()) return FromPeerStatus(s, target_addr);
  return PullResult{resp.copied(), resp.bytes()};
}

}  // namespace ctxcache::cluster
