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
#include <functional>
#include <memory>
#include <mutex>
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

// One WatchResponse of a prefix watch: the events of one or more revisions,
// in order, and the store revision they bring the watcher to.
struct EtcdWatchBatch {
  struct Event {
    bool deleted = false;  // DELETE (kv.value empty) or PUT
    EtcdKeyValue kv;
  };
  int64_t revision = 0;
  bool created = false;  // the stream's first response: the watch is live
  std::vector<Event> events;
};

// Ends a running EtcdClient::Watch from another thread. Cancel() is final:
// a Watch started after it returns at once.
class EtcdWatchCanceller {
 public:
  void Cancel();
  bool cancelled() const;

 private:
  friend class EtcdClient;
  mutable std::mutex mu_;
  std::function<void()> cancel_;  // guarded by mu_; set while a stream is open
  bool cancelled_ = false;        // guarded by mu_
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
  // All keys with this prefix, ordered by key; *revision (if given) is the
  // store revision the read saw.
  StatusOr<std::vector<EtcdKeyValue>> GetPrefix(const std::string& prefix,
                                                int64_t* revision = nullptr);
  Status Delete(const std::string& key);
  Status DeletePrefix(const std::string& prefix);

  // Watches every key with `prefix` from `start_revision` (events with a
  // revision >= start_revision; 0 = from now), calling on_batch for each
  // response, on this thread, until the stream ends. Returns OK once
  // `canceller` is cancelled; OUT_OF_RANGE naming the compact revision if
  // start_revision was compacted (re-list, then watch again); UNAVAILABLE
  // when the stream breaks (etcd gone: the next call tries the next
  // endpoint). No deadline: a dead peer is detected by gRPC keep-alive
  // pings (10 s).
  Status Watch(const std::string& prefix, int64_t start_revision,
               EtcdWatchCanceller* canceller,
               const std::function<void(const EtcdWatchBatch&)>& on_batch);

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
