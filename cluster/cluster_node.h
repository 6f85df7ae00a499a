// ClusterNode: this ctxcached's membership in an etcd-coordinated cluster
// (docs/cluster.md).
//
// etcd keys under /<cluster>/ (only membership and lifecycle, never pages):
//   nodes/<node-id>             {"addr","zone","capacity_bytes"}, node lease
//   holders/<ctx-id>/<node-id>  a durable READY copy on that node, node lease
//   contexts/<ctx-id>           {"pinned","expires_at_ms","shared"}: the
//                               context's cluster-wide lifecycle, no lease
//   evicted/<ctx-id>            tombstone of a cluster-wide eviction (1 h lease)
//   rebalancer                  v3election: one node re-replicates at a time
// A node whose lease expires is out, and so are its holder keys, so the
// live copies of a context are its holder keys.
//
// Background work: a watch of the cluster prefix (EtcdMirror: a node that
// leaves, a holder key put, a pin recorded are in this node's view at watch
// latency), a keep-alive loop (re-registering after a lease loss), a
// refresh loop (on every change of the mirror, and at least every
// refresh_interval_ms: rebuilds the view, applies pins/expiry/sharing/
// evictions to local copies, publishes local contexts that etcd does not
// know, drops surplus copies once every owner holds one), and a rebalancer
// loop that campaigns for the election and, while leader, asks owners
// lacking a copy to pull it from a live holder.
//
// Thread-safety: safe for concurrent use without external synchronization.
// The Store must outlive the ClusterNode.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cluster/etcd_client.h"
#include "cluster/etcd_mirror.h"
#include "cluster/placement.h"
#include "cluster/replication.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "storage/keys.h"
#include "storage/store.h"

namespace ctxcache::cluster {

struct ClusterOptions {
  // Parsed --cluster.
  ClusterUri uri;
  // This node's id. Required.
  std::string node_id;
  // host:port peers and clients dial. Required.
  std::string advertise_addr;
  // Failure domain; owners spread across zones first. Default: "".
  std::string zone;
  // Advertised capacity, bytes (0 = unlimited). Default: 0.
  uint64_t capacity_bytes = 0;
  // Owners per context (R). Default: 2.
  uint32_t replicas = 2;
  // A publish succeeds once this many durable copies exist. Default: 2.
  uint32_t min_replicas = 2;
  // etcd lease TTL, seconds: a node silent this long is out. Default: 10.
  int64_t lease_ttl_s = 10;
  // Longest wait of the refresh loop between two passes (it also runs on
  // every membership/lifecycle change seen by the watch), and period of
  // rebalancer passes, ms. Default: 1000.
  int64_t refresh_interval_ms = 1000;
  // Deadline of one context copy, ms. Default: 10 minutes.
  int64_t copy_timeout_ms = 600'000;
  // Copies running at once (publish fan-out and rebalancing). Default: 4.
  uint32_t copy_threads = 4;
  PeerOptions peer;
};

struct ClusterStats {
  uint64_t live_nodes = 0;
  uint64_t owned_contexts = 0;
  // Owned contexts with fewer than `replicas` live copies.
  uint64_t lag_contexts = 0;
  uint64_t replication_bytes = 0;   // payload bytes pulled into this node
  uint64_t replication_errors = 0;  // failed copies started or served here
  bool rebalancer = false;          // this node leads the rebalancer election
  bool etcd_reachable = false;      // the last refresh read etcd
};

class ClusterNode {
 public:
  // Connects to etcd, registers the node and every READY local context
  // (a restarted node rejoins with its data, no copy), and starts the loops.
  static StatusOr<std::unique_ptr<ClusterNode>> Start(ClusterOptions options,
                                                      storage::Store* store);
  // Stop(): leaves the cluster (revokes the lease) and joins the loops.
  ~ClusterNode();
  void Stop();

  const NodeInfo& self() const { return self_; }
  const ClusterOptions& options() const { return options_; }
  PeerChannels* peers() { return &peers_; }

  // Live nodes (as of the last change seen by the watch), ordered by node id.
  std::vector<NodeInfo> LiveNodes() const;
  // The context's owners among the live nodes, first owner first.
  std::vector<NodeInfo> Owners(const storage::ContextId& id) const;
  // Live nodes other than this one holding a READY copy, owners first. When
  // the last refresh saw none, etcd is asked (a context published since).
  std::vector<NodeInfo> RemoteHolders(const storage::ContextId& id) const;
  // The rebalancer leader's node id ("" if unknown).
  std::string Rebalancer() const;

  // A context became READY here by a build, ingest or extend: records its
  // lifecycle and this copy in etcd and has its other owners pull it.
  // Returns once min_replicas durable copies exist (this one included);
  // UNAVAILABLE naming the count if that cannot happen by copy_timeout_ms
  // (the copy here stays; the rebalancer completes the rest).
  Status PublishReady(const v1::ContextManifest& manifest);
  // Pulls `id` from source_addr into the local store and registers the copy.
  StatusOr<PullResult> PullFrom(const storage::ContextId& id, const std::string& source_addr);
  // Records a pin / expiry / share change for every holder to apply.
  Status RecordLifecycle(const v1::ContextManifest& manifest);
  // Records a cluster-wide eviction: every holder deletes its copy.
  Status RecordEvicted(const storage::ContextId& id);

  ClusterStats GetStats() const;
  // Counts a failed copy served to a peer (ExportContext).
  void CountReplicationError() { replication_errors_++; }

 private:
  ClusterNode(ClusterOptions options, storage::Store* store, std::unique_ptr<EtcdClient> etcd);
  std::string Key(const std::string& suffix) const;
  Status Register();
  Status RegisterHolder(const storage::ContextId& id);
  void KeepAliveLoop();
  void RefreshLoop();
  void RebalanceLoop();
  Status Refresh();
  void ApplyLifecycle();
  void RebalancePass();
  bool WaitStop(int64_t ms);

  struct Record {
    bool pinned = false;
    int64_t expires_at_ms = 0;
    bool shared = false;
  };
  // The last read of /<cluster>/.
  struct View {
    std::map<std::string, NodeInfo> nodes;                 // by node id
    std::map<std::string, Record> contexts;                // by ctx hex
    std::map<std::string, std::set<std::string>> holders;  // ctx hex -> node ids
    std::set<std::string> evicted;                         // ctx hex
  };
  std::vector<NodeInfo> OwnersIn(const View& v, const std::string& hex) const;

  ClusterOptions options_;
  storage::Store* store_;
  std::unique_ptr<EtcdClient> etcd_;
  std::unique_ptr<EtcdMirror> mirror_;  // /<cluster>/, set by Start()
  PeerChannels peers_;
  NodeInfo self_;

  mutable std::mutex mu_;
  View view_;               // guarded by mu_
  std::string rebalancer_;  // guarded by mu_
  int64_t lease_ = 0;       // guarded by mu_
  uint64_t owned_ = 0;      // guarded by mu_
  uint64_t lag_ = 0;        // guarded by mu_

  std::atomic<uint64_t> replication_bytes_{0};
  std::atomic<uint64_t> replication_errors_{0};
  std::atomic<bool> leader_{false};
  std::atomic<bool> etcd_ok_{false};

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // guarded by stop_mu_
  std::unique_ptr<ThreadPool> copies_;
  std::vector<std::thread> loops_;
};

}  // namespace ctxcache::cluster
