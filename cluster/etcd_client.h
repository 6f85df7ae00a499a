// EtcdClient: the few etcd v3 calls the cluster needs (KV, leases, the
// v3election service), over gRPC stubs generated from etcd's own protos.
//
// Endpoints are tried in order; a call that fails with UNAVAILABLE moves to
// the next endpoint and is retried once per endpoint. Every call has a
// deadline (Options::rpc_timeout_ms) unless it says otherwise.
//
// Thread-safety: safe for concurrent use without external synchronization.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace ctxcache::cluster {

// etcd://host:port[,host:port...]/<cluster-name>
struct ClusterUri {
  std::vector<std::string> endpoints;  // host:port
  std::string cluster;                 // [A-Za-z0-9._-]+
};
// INVALID_ARGUMENT naming `flag` for anything else.
StatusOr<ClusterUri> ParseClusterUri(const std::string& uri, const char* flag = "--cluster");

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t lease = 0;
  int64_t mod_revision = 0;
};

class EtcdClient {
 public:
  struct Options {
    std::vector<std::string> endpoints;  // host:port, at least one
    // Deadline of every unary call, ms. Default: 3000.
    int64_t rpc_timeout_ms = 3000;
  };
  static StatusOr<std::unique_ptr<EtcdClient>> Connect(const Options& options);
  ~EtcdClient();

  // Leases.
  StatusOr<int64_t> GrantLease(int64_t ttl_s);
  // One keep-alive round trip; returns the remaining TTL in seconds
  // (NOT_FOUND when the lease has expired).
  StatusOr<int64_t> KeepAlive(int64_t lease);
  Status RevokeLease(int64_t lease);

  // KV. lease 0 = none.
  Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Puts only if the key does not exist; returns whether it did the put.
  StatusOr<bool> PutIfAbsent(const std::string& key, const std::string& value, int64_t lease = 0);
  // NOT_FOUND if absent.
  StatusOr<EtcdKeyValue> Get(const std::string& key);
  // All keys with this prefix, ordered by key.
  StatusOr<std::vector<EtcdKeyValue>> GetPrefix(const std::string& prefix);
  Status Delete(const std::string& key);
  Status DeletePrefix(const std::string& prefix);

  // v3election: waits up to wait_ms to become leader of `election` with
  // `value` under `lease` (DEADLINE_EXCEEDED if not elected by then; the
  // candidacy stays queued under the lease). Returns the leader key.
  StatusOr<std::string> Campaign(const std::string& election, int64_t lease,
                                 const std::string& value, int64_t wait_ms);
  // The current leader's value (NOT_FOUND if none).
  StatusOr<std::string> Leader(const std::string& election);

 private:
  struct Impl;
  explicit EtcdClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxcache::cluster
