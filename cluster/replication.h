// Replication of immutable READY contexts between nodes (docs/cluster.md).
//
// A copy is a pull: the receiving node calls ClusterService.ExportContext on
// a node holding the context and writes the stream through an ordinary
// storage::ContextWriter (same id check, same atomic READY commit, so a
// crash mid-copy leaves nothing visible and Store::Open collects it). The
// manifest's id_namespace, provenance, tenant, labels, shared flag, pin and
// absolute expiry are carried over, so the copy has the same ContextId and
// the same access rules. A child context's parent is pulled first.
//
// PeerChannels dials other nodes with the cluster key (bearer) and, when
// TLS is on, the node's own certificate (mTLS) and CA.
//
// Thread-safety: every function and PeerChannels are safe for concurrent
// use; concurrent pulls of one id are serialized by Store::BeginBuild.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "ctxcache/v1/cluster_service.grpc.pb.h"
#include "storage/keys.h"
#include "storage/store.h"

namespace ctxcache::cluster {

struct PeerOptions {
  // API key (operator role) sent as "authorization: Bearer <key>"; "" = none.
  std::string cluster_key;
  // PEM contents; root_ca empty = plaintext channels. cert/key (both or
  // neither) are presented as the client certificate (mTLS).
  std::string tls_root_ca;
  std::string tls_cert;
  std::string tls_key;
  // Max message size sent and received, bytes. Default: 8 MiB.
  uint32_t max_message_bytes = 8u << 20;
};

class PeerChannels {
 public:
  explicit PeerChannels(PeerOptions options) : options_(std::move(options)) {}
  // The cached channel to a peer's host:port.
  std::shared_ptr<grpc::Channel> Get(const std::string& address);
  // Adds the cluster key and a deadline to a call.
  void Prepare(grpc::ClientContext* ctx, int64_t timeout_ms) const;
  std::unique_ptr<v1::ClusterService::Stub> ClusterStub(const std::string& address) {
    return v1::ClusterService::NewStub(Get(address));
  }

 private:
  PeerOptions options_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
};

// Emits the READY context `id` as ReplicaChunks (order: manifest, tokens,
// artifacts, KV, done), no message above max_chunk_bytes of payload. Stops
// at the first error of `emit` or of the store.
Status ExportContext(storage::Store* store, const storage::ContextId& id, size_t max_chunk_bytes,
                     const std::function<Status(const v1::ReplicaChunk&)>& emit);

struct PullResult {
  bool copied = false;  // false: already stored here
  uint64_t bytes = 0;   // payload bytes received
};

// Copies `id` from the node at source_addr into `store` (its parent first
// if missing). Returns once the copy is READY and durable. timeout_ms bounds
// each ExportContext stream.
StatusOr<PullResult> PullContext(storage::Store* store, const storage::ContextId& id,
                                 const std::string& source_addr, PeerChannels* peers,
                                 int64_t timeout_ms);

// Asks the node at target_addr to pull `id` from source_addr
// (ClusterService.ReplicateContext).
StatusOr<PullResult> RequestReplica(PeerChannels* peers, const std::string& target_addr,
                                    const storage::ContextId& id, const std::string& source_addr,
                                    int64_t timeout_ms);

// Maps a gRPC status from a peer to a Status (the code kept, the peer named).
Status FromPeerStatus(const grpc::Status& s, const std::string& peer);

}  // namespace ctxcache::cluster
