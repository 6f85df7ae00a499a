// ContextAdmin: build, ingest, extend, inspect, pin and evict contexts.
// See docs/api.md for the contract of each RPC and its status codes.
//
// Thread-safety: gRPC calls the handlers concurrently; all shared state is
// in ServiceContext, whose members are thread-safe.
#pragma once

#include <functional>
#include <optional>

#include "auth/principal.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"
#include "service/cluster_service.h"
#include "service/service_context.h"
#include "storage/keys.h"

namespace ctxcache::service {

struct BuildJob;
class RpcScope;

class AdminServiceImpl final : public v1::ContextAdmin::Service {
 public:
  explicit AdminServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::Status BuildContext(grpc::ServerContext* context, const v1::BuildContextRequest* request,
                            grpc::ServerWriter<v1::BuildProgress>* writer) override;
  grpc::Status ExtendContext(grpc::ServerContext* context, const v1::ExtendContextRequest* request,
                             grpc::ServerWriter<v1::BuildProgress>* writer) override;
  grpc::Status IngestContext(grpc::ServerContext* context,
                             grpc::ServerReader<v1::IngestChunk>* reader,
                             v1::ContextInfo* response) override;
  grpc::Status GetContext(grpc::ServerContext* context, const v1::GetContextRequest* request,
                          v1::ContextInfo* response) override;
  grpc::Status ListContexts(grpc::ServerContext* context, const v1::ListContextsRequest* request,
                            v1::ListContextsResponse* response) override;
  grpc::Status EvictContext(grpc::ServerContext* context, const v1::EvictContextRequest* request,
                            v1::EvictContextResponse* response) override;
  grpc::Status PinContext(grpc::ServerContext* context, const v1::PinContextRequest* request,
                          v1::ContextInfo* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                        v1::ServerStats* response) override;
  grpc::Status ShareContext(grpc::ServerContext* context, const v1::ShareContextRequest* request,
                            v1::ContextInfo* response) override;

 private:
  // Shared by Build and Extend: queue, run, stream progress, publish events.
  // Quotas (service/quotas.h) are admitted here; `new_tokens` counts
  // against build_tokens_per_minute.
  grpc::Status RunBuildRpc(grpc::ServerContext* context, BuildJob* job,
                           grpc::ServerWriter<v1::BuildProgress>* writer, bool extend,
                           RpcScope* rpc, uint64_t new_tokens);
  // Shared by Pin and Share: check access, apply `update`, return the info.
  grpc::Status UpdateFlag(RpcScope* rpc, const std::string& context_id, auth::Action action,
                          const std::function<Status(const storage::ContextId&)>& update,
                          v1::ContextInfo* response);

  // Pin and Share of a context stored elsewhere in the cluster: the
  // forwarded call's status (or the refusal); nullopt to handle it here.
  template <typename CallFn>
  std::optional<grpc::Status> MaybeForwardFlag(grpc::ServerContext* context, const char* method,
                                               const std::string& context_id, CallFn call) {
    auto id = storage::ContextId::FromHex(context_id);
    if (!id.ok()) return std::nullopt;  // UpdateFlag reports it
    grpc::Status refuse;
    if (auto target = ForwardTarget(ctx_, context, *id, &refuse)) {
      return ForwardUnary(ctx_, context, method, *target, call);
    }
    if (!refuse.ok()) return refuse;
    return std::nullopt;
  }

  ServiceContext* ctx_;
};

}  // namespace ctxcache::service
