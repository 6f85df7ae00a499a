#include "cluster/cluster_node.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "common/clock.h"

namespace ctxcache::cluster {

namespace {

// Tombstones of cluster-wide evictions live this long, seconds.
constexpr int64_t kTombstoneTtlS = 3600;
// Rebalancer copies started per pass.
constexpr size_t kCopiesPerPass = 16;

}  // namespace

StatusOr<std::unique_ptr<ClusterNode>> ClusterNode::Start(ClusterOptions options,
                                                          storage::Store* store) {
  if (options.node_id.empty() || options.node_id.find('/') != std::string::npos) {
    return InvalidArgumentError("--node-id: must be non-empty and contain no '/'");
  }
  if (options.advertise_addr.empty()) return InvalidArgumentError("--advertise-addr: empty");
  if (options.replicas < 1) return InvalidArgumentError("--replicas: must be >= 1");
  if (options.min_replicas < 1 || options.min_replicas > options.replicas) {
    return InvalidArgumentError("--min-replicas: must be in [1, --replicas]");
  }
  if (options.lease_ttl_s < 2) return InvalidArgumentError("--etcd-lease-ttl-s: must be >= 2");
  EtcdClient::Options eo;
  eo.endpoints = options.uri.endpoints;
  ASSIGN_OR_RETURN(auto etcd, EtcdClient::Connect(eo));
  std::unique_ptr<ClusterNode> node(new ClusterNode(std::move(options), store, std::move(etcd)));
  RETURN_IF_ERROR(node->Register().WithContext("joining cluster " + node->options_.uri.cluster));
  // The first view before serving, so routing works from the first call.
  ASSIGN_OR_RETURN(node->mirror_, EtcdMirror::Start(node->etcd_.get(), {node->Key(""), 200}));
  RETURN_IF_ERROR(node->Refresh());
  node->etcd_ok_ = true;
  node->loops_.emplace_back([n = node.get()] { n->KeepAliveLoop(); });
  node->loops_.emplace_back([n = node.get()] { n->RefreshLoop(); });
  node->loops_.emplace_back([n = node.get()] { n->RebalanceLoop(); });
  spdlog::info("cluster {}: joined as {} ({}, zone '{}'), R={}, min_replicas={}",
               node->options_.uri.cluster, node->self_.node_id, node->self_.address,
               node->self_.zone, node->options_.replicas, node->options_.min_replicas);
  return node;
}

ClusterNode::ClusterNode(ClusterOptions options, storage::Store* store,
                         std::unique_ptr<EtcdClient> etcd)
    : options_(std::move(options)),
      store_(store),
      etcd_(std::move(etcd)),
      peers_(options_.peer),
      copies_(std::make_unique<ThreadPool>(std::max<uint32_t>(1, options_.copy_threads))) {
  self_.node_id = options_.node_id;
  self_.address = options_.advertise_addr;
  self_.zone = options_.zone;
  self_.capacity_bytes = options_.capacity_bytes;
}

ClusterNode::~ClusterNode() { Stop(); }

void ClusterNode::Stop() {
  {
    std::lock_guard lock(stop_mu_);
    if (stop_) return;
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (mirror_) mirror_->Stop();  // wakes the refresh loop
  for (auto& t : loops_) t.join();
  loops_.clear();
  copies_.reset();  // waits for running copies
  int64_t lease;
  {
    std::lock_guard lock(mu_);
    lease = lease_;
  }
  // Leaving now (instead of after the TTL) lets the others re-route at once.
  if (lease) etcd_->RevokeLease(lease).IgnoreError();
}

bool ClusterNode::WaitStop(int64_t ms) {
  std::unique_lock lock(stop_mu_);
  return stop_cv_.wait_for(lock, std::chrono::milliseconds(ms), [this] { return stop_; });
}

std::string ClusterNode::Key(const std::string& suffix) const {
  return std::string("/").append(options_.uri.cluster).append("/").append(suffix);
}

Status ClusterNode::Register() {
  ASSIGN_OR_RETURN(int64_t lease, etcd_->GrantLease(options_.lease_ttl_s));
  {
    std::lock_guard lock(mu_);
    lease_ = lease;
  }
  nlohmann::json j = {
      {"addr", self_.address}, {"zone", self_.zone}, {"capacity_bytes", self_.capacity_bytes}};
  RETURN_IF_ERROR(etcd_->Put(Key("nodes/" + self_.node_id), j.dump(), lease));
  for (const auto& m : store_->ListContexts()) {
    ASSIGN_OR_RETURN(auto id, storage::ContextId::FromBytes(m.context_id()));
    RETURN_IF_ERROR(RegisterHolder(id));
  }
  return Status::OK();
}

Status ClusterNode::RegisterHolder(const storage::ContextId& id) {
  int64_t lease;
  {
    std::lock_guard lock(mu_);
    lease = lease_;
  }
  return etcd_->Put(Key("holders/" + id.ToHex() + "/" + self_.node_id), "", lease);
}

void ClusterNode::KeepAliveLoop() {
  const int64_t period_ms = std::max<int64_t>(500, options_.lease_ttl_s * 1000 / 3);
  while (!WaitStop(period_ms)) {
    int64_t lease;
    {
      std::lock_guard lock(mu_);
      lease = lease_;
    }
    auto ttl = etcd_->KeepAlive(lease);
    if (ttl.ok()) continue;
    if (ttl.status().code() == StatusCode::kNotFound) {
      // Out of the cluster (etcd unreachable longer than the TTL, or a
      // restarted etcd): join again with everything stored here.
      spdlog::warn("cluster: {}; registering again", ttl.status().ToString());
      if (Status s = Register(); !s.ok()) spdlog::warn("cluster: re-register: {}", s.ToString());
    } else {
      spdlog::warn("cluster: keep-alive: {}", ttl.status().ToString());
    }
  }
}

void ClusterNode::RefreshLoop() {
  uint64_t seen = mirror_->version();
  bool was_ok = true;
  // A burst of changes (a build publishing, a node's holder keys) is
  // applied in passes at least this far apart.
  constexpr int64_t kMinPassMs = 50;
  while (!WaitStop(kMinPassMs)) {
    seen = mirror_->WaitChange(seen, options_.refresh_interval_ms);
    {
      std::lock_guard lock(stop_mu_);
      if (stop_) return;
    }
    bool ok = mirror_->connected();
    etcd_ok_ = ok;
    if (!ok && was_ok) spdlog::warn("cluster: etcd watch down; serving with the last view");
    was_ok = ok;
    Refresh().IgnoreError();
    if (ok) ApplyLifecycle();
  }
}

Status ClusterNode::Refresh() {
  const EtcdMirror::Map kvs = mirror_->Snapshot();
  View v;
  const std::string root = Key("");
  for (const auto& [key, kv] : kvs) {
    std::string rest = kv.key.substr(root.size());
    auto slash = rest.find('/');
    if (slash == std::string::npos) continue;
    std::string kind = rest.substr(0, slash);
    std::string name = rest.substr(slash + 1);
    try {
      if (kind == "nodes") {
        auto j = nlohmann::json::parse(kv.value);
        NodeInfo n;
        n.node_id = name;
        n.address = j.value("addr", "");
        n.zone = j.value("zone", "");
        n.capacity_bytes = j.value("capacity_bytes", uint64_t{0});
        if (!n.address.empty()) v.nodes[name] = n;
      } else if (kind == "contexts") {
        auto j = nlohmann::json::parse(kv.value);
        Record r;
        r.pinned = j.value("pinned", false);
        r.expires_at_ms = j.value("expires_at_ms", int64_t{0});
        r.shared = j.value("shared", false);
        v.contexts[name] = r;
      } else if (kind == "holders") {
        auto s2 = name.find('/');
        if (s2 != std::string::npos) v.holders[name.substr(0, s2)].insert(name.substr(s2 + 1));
      } else if (kind == "evicted") {
        v.evicted.insert(name);
      }
    } catch (const nlohmann::json::exception& e) {
      spdlog::warn("cluster: ignoring malformed etcd key {}: {}", kv.key, e.what());
    }
  }
  // Holder keys of nodes without a live node key do not count.
  for (auto& [ctx, hs] : v.holders) {
    for (auto it = hs.begin(); it != hs.end();) {
      it = v.nodes.count(*it) ? std::next(it) : hs.erase(it);
    }
  }
  uint64_t owned = 0, lag = 0;
  for (const auto& [hex, rec] : v.contexts) {
    auto owners = OwnersIn(v, hex);
    bool mine = std::any_of(owners.begin(), owners.end(),
                            [&](const NodeInfo& n) { return n.node_id == self_.node_id; });
    if (!mine) continue;
    ++owned;
    auto it = v.holders.find(hex);
    size_t copies = it == v.holders.end() ? 0 : it->second.size();
    if (copies < options_.replicas) ++lag;
  }
  std::lock_guard lock(mu_);
  view_ = std::move(v);
  owned_ = owned;
  lag_ = lag;
  return Status::OK();
}

std::vector<NodeInfo> ClusterNode::OwnersIn(const View& v, const std::string& hex) const {
  std::vector<NodeInfo> nodes;
  nodes.reserve(v.nodes.size());
  for (const auto& [id, n] : v.nodes) nodes.push_back(n);
  return OwnersOf(hex, std::move(nodes), options_.replicas);
}

void ClusterNode::ApplyLifecycle() {
  View v;
  {
    std::lock_guard lock(mu_);
    v = view_;
  }
  for (const auto& m : store_->ListContexts()) {
    auto id = storage::ContextId::FromBytes(m.context_id());
    if (!id.ok()) continue;
    const std::string hex = id->ToHex();
    if (v.evicted.count(hex)) {
      if (m.pinned()) store_->SetPinned(*id, false).IgnoreError();
      auto d = store_->Delete(*id);
      if (d.ok()) {
        etcd_->Delete(Key("holders/" + hex + "/" + self_.node_id)).IgnoreError();
        spdlog::info("cluster: evicted {} (cluster-wide eviction)", hex);
      }
      continue;
    }
    auto rec = v.contexts.find(hex);
    if (rec == v.contexts.end()) {
      // Stored here but unknown to the cluster (built while etcd was away,
      // or before clustering): publish it.
      nlohmann::json j = {
          {"pinned", m.pinned()}, {"expires_at_ms", m.expires_at_ms()}, {"shared", m.shared()}};
      etcd_->PutIfAbsent(Key("contexts/" + hex), j.dump()).status().IgnoreError();
      RegisterHolder(*id).IgnoreError();
      continue;
    }
    if (!v.holders[hex].count(self_.node_id)) RegisterHolder(*id).IgnoreError();
    const Record& r = rec->second;
    if (r.pinned != m.pinned()) store_->SetPinned(*id, r.pinned).IgnoreError();
    if (r.expires_at_ms != m.expires_at_ms()) store_->SetExpiry(*id, r.expires_at_ms).IgnoreError();
    if (r.shared != m.shared()) store_->SetShared(*id, r.shared).IgnoreError();
    // A surplus copy (not an owner) goes once every owner holds one.
    auto owners = OwnersIn(v, hex);
    bool mine = false, all_held = owners.size() == options_.replicas;
    for (const auto& o : owners) {
      if (o.node_id == self_.node_id) mine = true;
      if (!v.holders[hex].count(o.node_id)) all_held = false;
    }
    if (!mine && all_held) {
      if (m.pinned()) store_->SetPinned(*id, false).IgnoreError();
      auto d = store_->Delete(*id);
      if (d.ok()) {
        etcd_->Delete(Key("holders/" + hex + "/" + self_.node_id)).IgnoreError();
        spdlog::info("cluster: dropped surplus copy of {} (its {} owners hold it)", hex,
                     owners.size());
      } else if (m.pinned()) {
        store_->SetPinned(*id, true).IgnoreError();
      }
    }
  }
}

void ClusterNode::RebalanceLoop() {
  const std::string election = Key("rebalancer");
  while (!WaitStop(leader_ ? options_.refresh_interval_ms : 100)) {
    int64_t lease;
    {
      std::lock_guard lock(mu_);
      lease = lease_;
    }
    if (!leader_) {
      // Campaign returns when elected; the candidacy stays queued under our
      // lease between tries, so the wait is bounded without losing our turn.
      auto won = etcd_->Campaign(election, lease, self_.node_id, 2000);
      if (won.ok()) {
        leader_ = true;
        spdlog::info("cluster: {} leads the rebalancer", self_.node_id);
      }
    }
    auto leader = etcd_->Leader(election);
    {
      std::lock_guard lock(mu_);
      rebalancer_ = leader.ok() ? *leader : "";
    }
    if (leader_ && (!leader.ok() || *leader != self_.node_id)) {
      leader_ = false;  // lease lost or re-granted: campaign again
      continue;
    }
    if (leader_) RebalancePass();
  }
}

void ClusterNode::RebalancePass() {
  View v;
  {
    std::lock_guard lock(mu_);
    v = view_;
  }
  size_t started = 0;
  std::vector<std::pair<std::string, std::pair<std::string, std::string>>> jobs;
  const int64_t now = WallNowMs();
  for (const auto& [hex, rec] : v.contexts) {
    if (v.evicted.count(hex)) continue;
    const auto& holders = v.holders[hex];
    if (rec.expires_at_ms > 0 && rec.expires_at_ms <= now) {
      // Expired: every holder's own TTL pass deletes its copy; once none is
      // left the record goes too.
      if (holders.empty()) etcd_->Delete(Key("contexts/" + hex)).IgnoreError();
      continue;
    }
    if (holders.empty()) continue;  // no live copy: nothing to copy from
    auto owners = OwnersIn(v, hex);
    // Prefer a holder that is an owner as the source.
    std::string source = v.nodes.at(*holders.begin()).address;
    for (const auto& o : owners) {
      if (holders.count(o.node_id)) source = o.address;
    }
    for (const auto& o : owners) {
      if (holders.count(o.node_id)) continue;
      if (started++ >= kCopiesPerPass) break;
      jobs.push_back({hex, {o.address, source}});
    }
  }
  if (jobs.empty()) return;
  std::atomic<size_t> left{jobs.size()};
  std::mutex done_mu;
  std::condition_variable done_cv;
  for (const auto& job : jobs) {
    copies_->Submit([&, job] {
      auto id = storage::ContextId::FromHex(job.first);
      if (id.ok()) {
        auto r = RequestReplica(&peers_, job.second.first, *id, job.second.second,
                                options_.copy_timeout_ms);
        if (!r.ok()) {
          replication_errors_++;
          spdlog::warn("cluster: rebalance copy of {} to {}: {}", job.first, job.second.first,
                       r.status().ToString());
        } else {
          spdlog::info("cluster: rebalanced {} to {} from {}", job.first, job.second.first,
                       job.second.second);
        }
      }
      std::lock_guard lock(done_mu);
      if (--left == 0) done_cv.notify_all();
    });
  }
  std::unique_lock lock(done_mu);
  done_cv.wait(lock, [&] { return left == 0; });
}

Status ClusterNode::PublishReady(const v1::ContextManifest& m) {
  ASSIGN_OR_RETURN(auto id, storage::ContextId::FromBytes(m.context_id()));
  const std::string hex = id.ToHex();
  nlohmann::json j = {
      {"pinned", m.pinned()}, {"expires_at_ms", m.expires_at_ms()}, {"shared", m.shared()}};
  RETURN_IF_ERROR(etcd_->Delete(Key("evicted/" + hex)));
  ASSIGN_OR_RETURN(bool created, etcd_->PutIfAbsent(Key("contexts/" + hex), j.dump()));
  (void)created;
  RETURN_IF_ERROR(RegisterHolder(id));
  // The holders now, read from etcd (the watched view may be a few ms
  // behind the put above).
  const std::string holders_prefix = Key("holders/" + hex + "/");
  ASSIGN_OR_RETURN(auto held_kvs, etcd_->GetPrefix(holders_prefix));
  std::set<std::string> held;
  for (const auto& kv : held_kvs) held.insert(kv.key.substr(holders_prefix.size()));
  auto owners = Owners(id);
  held.insert(self_.node_id);
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    size_t durable = 0;
    size_t pending = 0;
    std::string errors;
  };
  auto st = std::make_shared<Shared>();
  st->durable = 0;
  for (const auto& o : owners) {
    if (held.count(o.node_id)) ++st->durable;
  }
  if (!std::any_of(owners.begin(), owners.end(),
                   [&](const NodeInfo& o) { return o.node_id == self_.node_id; })) {
    ++st->durable;  // this surplus copy counts until the owners hold theirs
  }
  for (const auto& o : owners) {
    if (held.count(o.node_id)) continue;
    {
      std::lock_guard lock(st->mu);
      ++st->pending;
    }
    copies_->Submit([this, st, id, target = o.address] {
      auto r = RequestReplica(&peers_, target, id, self_.address, options_.copy_timeout_ms);
      std::lock_guard lock(st->mu);
      --st->pending;
      if (r.ok()) {
        ++st->durable;
      } else {
        replication_errors_++;
        st->errors.append(st->errors.empty() ? "" : "; ").append(r.status().ToString());
      }
      st->cv.notify_all();
    });
  }
  std::unique_lock lock(st->mu);
  st->cv.wait(lock, [&] { return st->durable >= options_.min_replicas || st->pending == 0; });
  if (st->durable >= options_.min_replicas) return Status::OK();
  return UnavailableError(
      "context " + hex + " is READY on " + std::to_string(st->durable) +
      " node(s), fewer than --min-replicas " + std::to_string(options_.min_replicas) + " (" +
      std::to_string(owners.size()) + " live owner(s))" +
      (st->errors.empty() ? "" : ": " + st->errors) + "; the rebalancer keeps copying");
}

StatusOr<PullResult> ClusterNode::PullFrom(const storage::ContextId& id,
                                           const std::string& source_addr) {
  auto r = PullContext(store_, id, source_addr, &peers_, options_.copy_timeout_ms);
  if (!r.ok()) {
    replication_errors_++;
    return r.status();
  }
  replication_bytes_ += r->bytes;
  RETURN_IF_ERROR(RegisterHolder(id));
  return r;
}

Status ClusterNode::RecordLifecycle(const v1::ContextManifest& m) {
  ASSIGN_OR_RETURN(auto id, storage::ContextId::FromBytes(m.context_id()));
  nlohmann::json j = {
      {"pinned", m.pinned()}, {"expires_at_ms", m.expires_at_ms()}, {"shared", m.shared()}};
  return etcd_->Put(Key("contexts/" + id.ToHex()), j.dump());
}

Status ClusterNode::RecordEvicted(const storage::ContextId& id) {
  ASSIGN_OR_RETURN(int64_t lease, etcd_->GrantLease(kTombstoneTtlS));
  RETURN_IF_ERROR(etcd_->Put(Key("evicted/" + id.ToHex()), std::to_string(WallNowMs()), lease));
  RETURN_IF_ERROR(etcd_->Delete(Key("contexts/" + id.ToHex())));
  return etcd_->Delete(Key("holders/" + id.ToHex() + "/" + self_.node_id));
}

std::vector<NodeInfo> ClusterNode::LiveNodes() const {
  std::lock_guard lock(mu_);
  std::vector<NodeInfo> out;
  for (const auto& [id, n] : view_.nodes) out.push_back(n);
  return out;
}

std::vector<NodeInfo> ClusterNode::Owners(const storage::ContextId& id) const {
  std::lock_guard lock(mu_);
  return OwnersIn(view_, id.ToHex());
}

std::vector<NodeInfo> ClusterNode::RemoteHolders(const storage::ContextId& id) const {
  const std::string hex = id.ToHex();
  std::set<std::string> held;
  {
    std::lock_guard lock(mu_);
    auto it = view_.holders.find(hex);
    if (it != view_.holders.end()) held = it->second;
  }
  held.erase(self_.node_id);
  if (held.empty()) {
    const std::string prefix = Key("holders/" + hex + "/");
    auto kvs = etcd_->GetPrefix(prefix);
    if (kvs.ok()) {
      for (const auto& kv : *kvs) held.insert(kv.key.substr(prefix.size()));
    }
    held.erase(self_.node_id);
  }
  std::lock_guard lock(mu_);
  std::vector<NodeInfo> out;
  for (const auto& o : OwnersIn(view_, hex)) {
    if (held.count(o.node_id)) out.push_back(o);
  }
  for (const auto& h : held) {
    auto n = view_.nodes.find(h);
    if (n == view_.nodes.end()) continue;  // not live (as of the last refresh)
    if (std::none_of(out.begin(), out.end(), [&](const NodeInfo& x) { return x.node_id == h; })) {
      out.push_back(n->second);
    }
  }
  return out;
}

std::string ClusterNode::Rebalancer() const {
  std::lock_guard lock(mu_);
  return rebalancer_;
}

ClusterStats ClusterNode::GetStats() const {
  ClusterStats s;
  {
    std::lock_guard lock(mu_);
    s.live_nodes = view_.nodes.size();
    s.owned_contexts = owned_;
    s.lag_contexts = lag_;
  }
  s.replication_bytes = replication_bytes_;
  s.replication_errors = replication_errors_;
  s.rebalancer = leader_;
  s.etcd_reachable = etcd_ok_;
  return s;
}

}  // namespace ctxcache::cluster
