// EtcdMirror: a local copy of every key under an etcd prefix, kept current
// by an etcd Watch (docs/cluster.md, "Membership by watch").
//
// Start() lists the prefix at revision N and watches from N + 1; each watch
// response is applied in revision order, so a change in etcd (a node key
// deleted by its lease's revocation, a holder key put) is in the mirror at
// watch latency (milliseconds on a LAN). When the stream breaks (etcd
// restarted or unreachable, an endpoint lost, the start revision compacted)
// the mirror keeps its last contents, lists the prefix again (retrying every
// Options::retry_ms) and watches from the new revision; a re-list replaces
// the contents whole, so keys deleted meanwhile go too.
//
// Thread-safety: safe for concurrent use without external synchronization.
// The EtcdClient must outlive the mirror.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "cluster/etcd_client.h"
#include "common/status.h"

namespace ctxcache::cluster {

class EtcdMirror {
 public:
  struct Options {
    // Keys mirrored: every key starting with this. Required.
    std::string prefix;
    // Wait between attempts to list and watch again while etcd is away, ms.
    // Default: 200.
    int64_t retry_ms = 200;
  };
  using Map = std::map<std::string, EtcdKeyValue>;

  // Lists the prefix (UNAVAILABLE if etcd cannot be read) and starts the
  // watch thread.
  static StatusOr<std::unique_ptr<EtcdMirror>> Start(EtcdClient* etcd, Options options);
  ~EtcdMirror();
  // Ends the watch and wakes every WaitChange. Idempotent.
  void Stop();

  // The mirrored keys now; *version (if given) is the version they are at.
  Map Snapshot(uint64_t* version = nullptr) const;
  // Bumped by every applied change (watch response with events, re-list).
  uint64_t version() const { return version_.load(); }
  // Waits until version() != seen, Stop(), or timeout_ms; returns version().
  uint64_t WaitChange(uint64_t seen, int64_t timeout_ms) const;
  // True while the watch stream is live (false from a break until the
  // re-list and the new watch succeed).
  bool connected() const { return connected_.load(); }
  // etcd revision the contents reflect.
  int64_t revision() const;

 private:
  EtcdMirror(EtcdClient* etcd, Options options) : etcd_(etcd), options_(std::move(options)) {}
  Status List();
  void Loop();
  void Apply(const EtcdWatchBatch& batch);

  EtcdClient* etcd_;
  const Options options_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  Map map_;               // guarded by mu_
  int64_t revision_ = 0;  // guarded by mu_
  bool stop_ = false;     // guarded by mu_
  std::atomic<uint64_t> version_{0};
  std::atomic<bool> connected_{false};
  EtcdWatchCanceller canceller_;
  std::thread thread_;
};

}  // namespace ctxcache::cluster
