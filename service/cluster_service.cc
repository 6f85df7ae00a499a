#include "service/cluster_service.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "cluster/replication.h"
#include "service/grpc_status.h"
#include "service/rpc_metrics.h"
#include "service/wire.h"

namespace ctxcache::service {

namespace {

constexpr const char* kForwardedHeader = "ctxcache-forwarded";
// Payload bytes per ReplicaChunk.
constexpr size_t kReplicaChunkBytes = 1u << 20;
// Deadline of a peer's LocalStatus answer, ms.
constexpr int64_t kStatusTimeoutMs = 2000;

grpc::Status ClusterOff() {
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "this ctxcached is not in a cluster (start it with --cluster)");
}

void FillLocal(ServiceContext* ctx, v1::ClusterNodeStatus* out) {
  const auto& self = ctx->cluster->self();
  auto st = ctx->cluster->GetStats();
  out->set_node_id(self.node_id);
  out->set_address(self.address);
  out->set_zone(self.zone);
  out->set_capacity_bytes(self.capacity_bytes);
  out->set_health(ctx->draining ? "DRAINING" : "SERVING");
  out->set_owned_contexts(st.owned_contexts);
  out->set_replication_lag_contexts(st.lag_contexts);
  out->set_stored_contexts(ctx->store->GetStats().ready_contexts);
}

}  // namespace

grpc::Status ClusterServiceImpl::ExportContext(grpc::ServerContext* context,
                                               const v1::ExportContextRequest* request,
                                               grpc::ServerWriter<v1::ReplicaChunk>* writer) {
  const RpcSpec spec{"ExportContext", auth::Action::kCluster};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    if (!ctx_->cluster) return ClusterOff();
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    rpc.set_context_id(id->ToHex());
    Status s = cluster::ExportContext(ctx_->store.get(), *id, kReplicaChunkBytes,
                                      [&](const v1::ReplicaChunk& c) -> Status {
                                        if (context->IsCancelled() || !writer->Write(c)) {
                                          return CancelledError("the receiving node went away");
                                        }
                                        return Status::OK();
                                      });
    if (!s.ok()) ctx_->cluster->CountReplicationError();
    return ToGrpc(s);
  });
}

grpc::Status ClusterServiceImpl::ReplicateContext(grpc::ServerContext* context,
                                                  const v1::ReplicateContextRequest* request,
                                                  v1::ReplicateContextResponse* response) {
  const RpcSpec spec{"ReplicateContext", auth::Action::kCluster};
  return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
    if (!ctx_->cluster) return ClusterOff();
    auto id = ParseContextId(request->context_id());
    if (!id.ok()) return ToGrpc(id.status());
    rpc.set_context_id(id->ToHex());
    if (request->source_addr().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "source_addr: empty (host:port of a node holding the context)");
    }
    auto r = ctx_->cluster->PullFrom(*id, request->source_addr());
    if (!r.ok()) return ToGrpc(r.status());
    response->set_copied(r->copied);
    response->set_bytes(r->bytes);
    if (r->copied) {
      spdlog::info("cluster: copied {} from {} ({} bytes)", id->ToHex(), request->source_addr(),
                   r->bytes);
    }
    return grpc::Status::OK;
  });
}

grpc::Status ClusterServiceImpl::LocalStatus(grpc::ServerContext* context,
                                             const v1::ClusterStatusRequest*,
                                             v1::ClusterNodeStatus* response) {
  const RpcSpec spec{"LocalStatus", auth::Action::kCluster};
  return HandleRpc(ctx_, context, spec, [&](RpcScope&) -> grpc::Status {
    if (!ctx_->cluster) return ClusterOff();
    FillLocal(ctx_, response);
    return grpc::Status::OK;
  });
}

grpc::Status ClusterServiceImpl::GetClusterStatus(grpc::ServerContext* context,
                                                  const v1::ClusterStatusRequest*,
                                                  v1::ClusterStatus* response) {
  const RpcSpec spec{"GetClusterStatus", auth::Action::kCluster};
  return HandleRpc(ctx_, context, spec, [&](RpcScope&) -> grpc::Status {
    if (!ctx_->cluster) return ClusterOff();
    auto* node = ctx_->cluster.get();
    response->set_cluster(node->options().uri.cluster);
    response->set_replicas(node->options().replicas);
    response->set_rebalancer(node->Rebalancer());
    for (const auto& n : node->LiveNodes()) {
      v1::ClusterNodeStatus* out = response->add_nodes();
      if (n.node_id == node->self().node_id) {
        FillLocal(ctx_, out);
        continue;
      }
      out->set_node_id(n.node_id);
      out->set_address(n.address);
      out->set_zone(n.zone);
      out->set_capacity_bytes(n.capacity_bytes);
      auto stub = node->peers()->ClusterStub(n.address);
      grpc::ClientContext cc;
      node->peers()->Prepare(&cc, kStatusTimeoutMs);
      v1::ClusterNodeStatus peer;
      grpc::Status s = stub->LocalStatus(&cc, v1::ClusterStatusRequest(), &peer);
      if (s.ok()) {
        *out = peer;
      } else {
        out->set_health("UNREACHABLE: " + s.error_message());
      }
    }
    return grpc::Status::OK;
  });
}

std::optional<std::string> ForwardTarget(ServiceContext* ctx, const grpc::ServerContext* in,
                                         const storage::ContextId& id, grpc::Status* refuse) {
  if (!ctx->cluster) return std::nullopt;
  if (in->client_metadata().count(kForwardedHeader)) return std::nullopt;
  auto local = ctx->store->GetManifest(id);
  if (local.ok() || local.status().code() != StatusCode::kNotFound) return std::nullopt;
  auto holders = ctx->cluster->RemoteHolders(id);
  if (holders.empty()) return std::nullopt;
  if (ctx->access->enabled() && !in->client_metadata().count("authorization")) {
    *refuse = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                           "context " + id.ToHex() + " is stored on node " +
                               holders.front().node_id + " (" + holders.front().address +
                               "), not here; a call authenticated by a client certificate is "
                               "not forwarded: connect there, or use an etcd:// address");
    return std::nullopt;
  }
  return holders.front().address;
}

void PrepareForward(ServiceContext* ctx, const grpc::ServerContext* in, grpc::ClientContext* out,
                    const char* method) {
  const auto& md = in->client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) {
    out->AddMetadata("authorization", std::string(it->second.data(), it->second.size()));
  }
  out->AddMetadata(kForwardedHeader, ctx->cluster->self().node_id);
  out->set_deadline(in->deadline());
  ctx->metrics
      .GetCounter("ctxcache_forwarded_requests_total",
                  "Calls forwarded to the node holding their context", {{"method", method}})
      ->Inc();
}

grpc::Status ForwardDecode(ServiceContext* ctx, grpc::ServerContext* in, const std::string& target,
                           const v1::DecodeRequest& first,
                           grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream,
                           const std::function<void()>& on_message) {
  grpc::ClientContext out;
  PrepareForward(ctx, in, &out, "Decode");
  auto stub = v1::DecodeService::NewStub(ctx->cluster->peers()->Get(target));
  auto upstream = stub->Decode(&out);
  if (!upstream->Write(first)) return upstream->Finish();
  // Responses flow back on their own thread; requests are pumped here. When
  // the holder goes away the caller's stream is cancelled too, so a client
  // waiting for a response sees the failure instead of hanging.
  std::atomic<bool> client_done{false};
  std::thread back([&] {
    v1::DecodeResponse resp;
    while (upstream->Read(&resp)) {
      on_message();
      if (!stream->Write(resp)) {
        out.TryCancel();
        break;
      }
    }
    if (!client_done) in->TryCancel();
  });
  v1::DecodeRequest req;
  while (stream->Read(&req)) {
    on_message();
    if (!upstream->Write(req)) break;
  }
  client_done = true;
  if (in->IsCancelled()) out.TryCancel();
  upstream->WritesDone();
  back.join();
  return upstream->Finish();
}

}  // namespace ctxcache::service
