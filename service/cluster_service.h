// The cluster side of ctxcached (docs/cluster.md): the ClusterService
// (node-to-node replication and status, operator role) and forwarding of calls
// for contexts this node does not store to a node that does.
//
// Forwarding: a call naming a context absent here goes, unchanged, to a
// live holder (owners first) with the caller's own "authorization"
// metadata, so the holder authenticates and authorizes the caller exactly
// as if it had been called directly; "ctxcache-forwarded: <node-id>" marks
// it so it is never forwarded twice. A caller authenticated only by a
// client certificate cannot be forwarded (its certificate stays on the
// first hop): it gets FAILED_PRECONDITION naming the holder's address, and
// routing clients (etcd://) dial owners directly anyway.
//
// Thread-safety: safe for concurrent use (gRPC handlers).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <optional>
#include <string>

#include "ctxcache/v1/cluster_service.grpc.pb.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"
#include "service/service_context.h"
#include "storage/keys.h"

namespace ctxcache::service {

class ClusterServiceImpl final : public v1::ClusterService::Service {
 public:
  explicit ClusterServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::Status ExportContext(grpc::ServerContext* context, const v1::ExportContextRequest* request,
                             grpc::ServerWriter<v1::ReplicaChunk>* writer) override;
  grpc::Status ReplicateContext(grpc::ServerContext* context,
                                const v1::ReplicateContextRequest* request,
                                v1::ReplicateContextResponse* response) override;
  grpc::Status GetClusterStatus(grpc::ServerContext* context,
                                const v1::ClusterStatusRequest* request,
                                v1::ClusterStatus* response) override;
  grpc::Status LocalStatus(grpc::ServerContext* context, const v1::ClusterStatusRequest* request,
                           v1::ClusterNodeStatus* response) override;

 private:
  ServiceContext* ctx_;
};

// Where a call for context `id` should go instead of this node: nullopt to
// serve it here (cluster off, the context stored here, the call already
// forwarded once, or no live holder elsewhere). Sets *refuse when it must
// not be forwarded (see above) and returns nullopt.
std::optional<std::string> ForwardTarget(ServiceContext* ctx, const grpc::ServerContext* in,
                                         const storage::ContextId& id, grpc::Status* refuse);

// A client context for forwarding `in` to a peer: the caller's
// authorization, the forwarded mark, and in's deadline.
void PrepareForward(ServiceContext* ctx, const grpc::ServerContext* in, grpc::ClientContext* out,
                    const char* method);

// Proxies a whole Decode stream whose first request (already read) is
// `first` to `target`; on_message runs for every message relayed either way.
grpc::Status ForwardDecode(ServiceContext* ctx, grpc::ServerContext* in, const std::string& target,
                           const v1::DecodeRequest& first,
                           grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream,
                           const std::function<void()>& on_message);

// Proxies a unary call: call(channel, client_context) returns its status.
template <typename CallFn>
grpc::Status ForwardUnary(ServiceContext* ctx, grpc::ServerContext* in, const char* method,
                          const std::string& target, CallFn call) {
  grpc::ClientContext out;
  PrepareForward(ctx, in, &out, method);
  return call(ctx->cluster->peers()->Get(target), &out);
}

// Proxies a server-streaming call.
template <typename Req, typename Resp, typename StartFn>
grpc::Status ForwardServerStream(ServiceContext* ctx, grpc::ServerContext* in, const char* method,
                                 const std::string& target, const Req& request,
                                 grpc::ServerWriter<Resp>* writer, StartFn start) {
  grpc::ClientContext out;
  PrepareForward(ctx, in, &out, method);
  auto channel = ctx->cluster->peers()->Get(target);
  auto reader = start(channel, &out, request);
  Resp msg;
  while (reader->Read(&msg)) {
    if (!writer->Write(msg)) {
      out.TryCancel();
      break;
    }
  }
  return reader->Finish();
}

// Proxies a client-streaming call whose first message (already read) is
// `first`: relays it and every further message, then the peer's response.
template <typename Req, typename Resp, typename StartFn>
grpc::Status ForwardClientStream(ServiceContext* ctx, grpc::ServerContext* in, const char* method,
                                 const std::string& target, const Req& first,
                                 grpc::ServerReader<Req>* reader, Resp* response, StartFn start) {
  grpc::ClientContext out;
  PrepareForward(ctx, in, &out, method);
  auto channel = ctx->cluster->peers()->Get(target);
  auto writer = start(channel, &out, response);
  bool ok = writer->Write(first);
  Req msg;
  while (ok && reader->Read(&msg)) ok = writer->Write(msg);
  if (ok) writer->WritesDone();
  return writer->Finish();
}

}  // namespace ctxcache::service
