#include "client/sdk/routing_client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>

#include "cluster/etcd_client.h"
#include "cluster/etcd_mirror.h"
#include "cluster/placement.h"

namespace ctxcache::client::internal {

namespace {

using cluster::NodeInfo;

// A string field of the node key's flat JSON value ({"addr":"h:p",...}).
std::string JsonString(const std::string& json, const std::string& field) {
  const std::string key = "\"" + field + "\":\"";
  auto p = json.find(key);
  if (p == std::string::npos) return "";
  p += key.size();
  auto e = json.find('"', p);
  return e == std::string::npos ? "" : json.substr(p, e - p);
}

bool FailsOver(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kCancelled;
}

class RoutingClient;

class FailoverSession final : public DecodeSession {
 public:
  FailoverSession(RoutingClient* client, SessionOptions options)
      : client_(client), options_(std::move(options)) {}
  Status Reopen(const std::string& skip);

  const v1::ContextInfo& context() const override { return session_->context(); }
  int64_t n_tokens() const override { return session_->n_tokens(); }
  Status Step(uint32_t layer, const float* queries, SelectedKV* out) override {
    return Retry([&] { return session_->Step(layer, queries, out); });
  }
  Status Prefetch(uint32_t layer, const float* predicted_queries) override {
    return session_->Prefetch(layer, predicted_queries);  // advisory: never fails over
  }
  Status Append(const float* k, const float* v, const float* q) override {
    RETURN_IF_ERROR(Retry([&] { return session_->Append(k, v, q); }));
    const auto& m = session_->context().model();
    const size_t kv = size_t{m.n_layers()} * m.n_kv_heads() * m.head_dim();
    const size_t qn = size_t{m.n_layers()} * m.n_q_heads() * m.head_dim();
    appended_.push_back({std::vector<float>(k, k + kv), std::vector<float>(v, v + kv),
                         q ? std::vector<float>(q, q + qn) : std::vector<float>()});
    return Status::OK();
  }
  Status Close() override { return session_ ? session_->Close() : Status::OK(); }
  PageCacheStats page_cache_stats() const override { return session_->page_cache_stats(); }
  int failovers() const { return failovers_; }

 private:
  template <typename Fn>
  Status Retry(Fn fn) {
    Status s = fn();
    for (int i = 0; i < 3 && FailsOver(s); ++i) {
      ++failovers_;
      RETURN_IF_ERROR(Reopen(address_).WithContext("failing over after: " + s.ToString()));
      s = fn();
    }
    return s;
  }

  struct Appended {
    std::vector<float> k, v, q;
  };
  RoutingClient* client_;
  SessionOptions options_;
  std::unique_ptr<DecodeSession> session_;
  std::string address_;
  std::vector<Appended> appended_;
  int failovers_ = 0;
};

class RoutingClient final : public Client {
 public:
  RoutingClient(ClientOptions options, cluster::ClusterUri uri,
                std::unique_ptr<cluster::EtcdClient> etcd)
      : options_(std::move(options)), uri_(std::move(uri)), etcd_(std::move(etcd)) {}

  // Lists /<cluster>/ and starts watching it.
  Status StartWatch() {
    ASSIGN_OR_RETURN(mirror_,
                     cluster::EtcdMirror::Start(etcd_.get(), {"/" + uri_.cluster + "/", 200}));
    return Status::OK();
  }

  // Live nodes, as the watch of the cluster prefix last saw them.
  StatusOr<std::vector<NodeInfo>> Nodes() {
    auto v = CurrentView();
    if (v->nodes.empty()) return UnavailableError("cluster " + uri_.cluster + ": no live node");
    return v->nodes;
  }

  // Holders (owners first), then the other owners, then every live node.
  StatusOr<std::vector<NodeInfo>> Candidates(const std::string& context_id) {
    auto v = CurrentView();
    if (v->nodes.empty()) return UnavailableError("cluster " + uri_.cluster + ": no live node");
    static const std::set<std::string> kNone;
    auto h = v->holders.find(context_id);
    const std::set<std::string>& held = h == v->holders.end() ? kNone : h->second;
    auto owners = cluster::OwnersOf(context_id, v->nodes, options_.cluster_replicas);
    std::vector<NodeInfo> order;
    order.reserve(v->nodes.size());
    auto add = [&](const NodeInfo& n) {
      if (std::none_of(order.begin(), order.end(),
                       [&](const NodeInfo& x) { return x.node_id == n.node_id; })) {
        order.push_back(n);
      }
    };
    for (const auto& o : owners) {
      if (held.count(o.node_id)) add(o);
    }
    for (const auto& n : v->nodes) {
      if (held.count(n.node_id)) add(n);
    }
    for (const auto& o : owners) add(o);
    for (const auto& n : v->nodes) add(n);
    return order;
  }

  StatusOr<Client*> On(const std::string& address) {
    std::lock_guard lock(mu_);
    auto it = clients_.find(address);
    if (it != clients_.end()) return it->second.get();
    ClientOptions o = options_;
    o.server = address;
    o.max_attempts = 1;  // UNAVAILABLE moves to the next node instead
    ASSIGN_OR_RETURN(auto c, Client::Connect(o));
    Client* raw = c.get();
    clients_[address] = std::move(c);
    return raw;
  }

  // Runs fn on each candidate until one answers with something other than
  // UNAVAILABLE.
  template <typename T, typename Fn>
  StatusOr<T> Route(const std::vector<NodeInfo>& nodes, Fn fn) {
    Status last = UnavailableError("cluster " + uri_.cluster + ": no live node");
    for (const auto& n : nodes) {
      ASSIGN_OR_RETURN(Client * c, On(n.address));
      StatusOr<T> r = fn(c);
      if (r.ok() || r.status().code() != StatusCode::kUnavailable) return r;
      last = r.status();
    }
    return last;
  }
  template <typename T, typename Fn>
  StatusOr<T> OnContext(const std::string& context_id, Fn fn) {
    ASSIGN_OR_RETURN(auto nodes, Candidates(context_id));
    return Route<T>(nodes, fn);
  }
  template <typename T, typename Fn>
  StatusOr<T> OnAny(Fn fn) {
    ASSIGN_OR_RETURN(auto nodes, Nodes());
    std::rotate(nodes.begin(), nodes.begin() + (next_++ % nodes.size()), nodes.end());
    return Route<T>(nodes, fn);
  }

  StatusOr<v1::BuildProgress> Build(
      const v1::BuildContextRequest& request,
      const std::function<void(const v1::BuildProgress&)>& on_progress) override {
    return OnAny<v1::BuildProgress>([&](Client* c) { return c->Build(request, on_progress); });
  }
  StatusOr<v1::BuildProgress> Extend(
      const v1::ExtendContextRequest& request,
      const std::function<void(const v1::BuildProgress&)>& on_progress) override {
    return OnContext<v1::BuildProgress>(request.parent_id(),
                                        [&](Client* c) { return c->Extend(request, on_progress); });
  }
  StatusOr<v1::ContextInfo> GetContext(const std::string& id) override {
    return OnContext<v1::ContextInfo>(id, [&](Client* c) { return c->GetContext(id); });
  }
  StatusOr<v1::ListContextsResponse> ListContexts(const v1::ListContextsRequest& r) override {
    return OnAny<v1::ListContextsResponse>([&](Client* c) { return c->ListContexts(r); });
  }
  StatusOr<v1::EvictContextResponse> Evict(const std::string& id) override {
    return OnContext<v1::EvictContextResponse>(id, [&](Client* c) { return c->Evict(id); });
  }
  StatusOr<v1::ContextInfo> Pin(const std::string& id, bool pinned) override {
    return OnContext<v1::ContextInfo>(id, [&](Client* c) { return c->Pin(id, pinned); });
  }
  StatusOr<v1::ContextInfo> Share(const std::string& id, bool shared) override {
    return OnContext<v1::ContextInfo>(id, [&](Client* c) { return c->Share(id, shared); });
  }
  StatusOr<v1::ServerStats> GetStats() override {
    return OnAny<v1::ServerStats>([&](Client* c) { return c->GetStats(); });
  }
  Status Watch(const v1::WatchRequest& request,
               const std::function<bool(const v1::ContextEvent&)>& on_event,
               double max_seconds) override {
    return OnAny<bool>([&](Client* c) -> StatusOr<bool> {
             RETURN_IF_ERROR(c->Watch(request, on_event, max_seconds));
             return true;
           })
        .status();
  }
  using Client::FetchIndex;
  StatusOr<std::map<std::pair<uint32_t, uint32_t>, std::string>> FetchIndex(
      const std::string& id, const std::string& method,
      const std::vector<uint32_t>& layers) override {
    return OnContext<std::map<std::pair<uint32_t, uint32_t>, std::string>>(
        id, [&](Client* c) { return c->FetchIndex(id, method, layers); });
  }
  Status FetchPages(const v1::FetchPagesRequest& request, std::vector<v1::Page>* pages) override {
    return OnContext<bool>(request.context_id(),
                           [&](Client* c) -> StatusOr<bool> {
                             pages->clear();
                             RETURN_IF_ERROR(c->FetchPages(request, pages));
                             return true;
                           })
        .status();
  }
  Status FetchPagesInto(const v1::FetchPagesRequest& request, const KVLayout& layout) override {
    return OnContext<bool>(request.context_id(),
                           [&](Client* c) -> StatusOr<bool> {
                             RETURN_IF_ERROR(c->FetchPagesInto(request, layout));
                             return true;
                           })
        .status();
  }
  StatusOr<std::unique_ptr<KVLoad>> StartLoadKV(const std::string& id,
                                                const KVLoadOptions& options,
                                                const KVLayout& layout) override {
    return OnContext<std::unique_ptr<KVLoad>>(
        id, [&](Client* c) { return c->StartLoadKV(id, options, layout); });
  }
  StatusOr<std::unique_ptr<KVMapping>> MapKV(const std::string& id,
                                             const std::vector<uint32_t>& layers) override {
    return OnContext<std::unique_ptr<KVMapping>>(id,
                                                 [&](Client* c) { return c->MapKV(id, layers); });
  }
  // The node is chosen when the stream opens (a child's: one holding its
  // parent); a node lost mid-stream fails the ingest (nothing stored).
  StatusOr<std::unique_ptr<IngestStream>> StartIngest(const v1::IngestHeader& header,
                                                      const IngestOptions& options) override {
    auto open = [&](Client* c) { return c->StartIngest(header, options); };
    if (header.parent_id().empty()) return OnAny<std::unique_ptr<IngestStream>>(open);
    return OnContext<std::unique_ptr<IngestStream>>(header.parent_id(), open);
  }
  StatusOr<std::unique_ptr<DecodeSession>> OpenSession(const SessionOptions& options) override {
    auto s = std::make_unique<FailoverSession>(this, options);
    RETURN_IF_ERROR(s->Reopen(""));
    return std::unique_ptr<DecodeSession>(std::move(s));
  }
  const ClientOptions& options() const override { return options_; }

 private:
  ClientOptions options_;
  cluster::ClusterUri uri_;
  std::unique_ptr<cluster::EtcdClient> etcd_;
  // Live nodes and the live holders of each context, derived from the
  // mirror at one version.
  struct View {
    std::vector<NodeInfo> nodes;                            // by node id
    std::map<std::string, std::set<std::string>> holders;  // ctx hex -> node ids
  };
  std::shared_ptr<const View> CurrentView() {
    const uint64_t want = mirror_->version();
    {
      std::lock_guard lock(view_mu_);
      if (view_ && view_version_ == want) return view_;
    }
    uint64_t version = 0;
    const auto kvs = mirror_->Snapshot(&version);
    auto v = std::make_shared<View>();
    const std::string nodes_prefix = "/" + uri_.cluster + "/nodes/";
    const std::string holders_prefix = "/" + uri_.cluster + "/holders/";
    std::set<std::string> live;
    for (auto it = kvs.lower_bound(nodes_prefix);
         it != kvs.end() && it->first.compare(0, nodes_prefix.size(), nodes_prefix) == 0; ++it) {
      NodeInfo n;
      n.node_id = it->first.substr(nodes_prefix.size());
      n.address = JsonString(it->second.value, "addr");
      n.zone = JsonString(it->second.value, "zone");
      if (n.address.empty()) continue;
      live.insert(n.node_id);
      v->nodes.push_back(std::move(n));
    }
    for (auto it = kvs.lower_bound(holders_prefix);
         it != kvs.end() && it->first.compare(0, holders_prefix.size(), holders_prefix) == 0;
         ++it) {
      std::string rest = it->first.substr(holders_prefix.size());
      auto slash = rest.find('/');
      if (slash == std::string::npos) continue;
      std::string node = rest.substr(slash + 1);
      if (live.count(node)) v->holders[rest.substr(0, slash)].insert(std::move(node));
    }
    std::lock_guard lock(view_mu_);
    if (!view_ || version >= view_version_) {
      view_ = std::move(v);
      view_version_ = version;
    }
    return view_;
  }

  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Client>> clients_;  // guarded by mu_
  std::mutex view_mu_;
  std::shared_ptr<const View> view_;  // guarded by view_mu_
  uint64_t view_version_ = 0;         // guarded by view_mu_
  std::unique_ptr<cluster::EtcdMirror> mirror_;  // after etcd_: stopped first
  std::atomic<size_t> next_{0};

  friend class FailoverSession;
};

Status FailoverSession::Reopen(const std::string& skip) {
  if (session_) session_->Close().IgnoreError();
  session_.reset();
  ASSIGN_OR_RETURN(auto nodes, client_->Candidates(options_.context_id));
  Status last = UnavailableError("no live node holds " + options_.context_id);
  for (const auto& n : nodes) {
    if (n.address == skip) continue;
    ASSIGN_OR_RETURN(Client * c, client_->On(n.address));
    auto s = c->OpenSession(options_);
    if (!s.ok()) {
      if (!FailsOver(s.status())) return s.status();
      last = s.status();
      continue;
    }
    Status replay;
    for (const auto& a : appended_) {
      replay = (*s)->Append(a.k.data(), a.v.data(), a.q.empty() ? nullptr : a.q.data());
      if (!replay.ok()) break;
    }
    if (!replay.ok()) {
      if (!FailsOver(replay)) return replay;
      last = replay;
      continue;
    }
    session_ = std::move(s).value();
    address_ = n.address;
    return Status::OK();
  }
  return last;
}

}  // namespace

StatusOr<std::unique_ptr<Client>> ConnectCluster(const ClientOptions& options) {
  ASSIGN_OR_RETURN(auto uri, cluster::ParseClusterUri(options.server, "server"));
  if (options.cluster_replicas < 1) return InvalidArgumentError("cluster_replicas must be >= 1");
  cluster::EtcdClient::Options eo;
  eo.endpoints = uri.endpoints;
  eo.rpc_timeout_ms = static_cast<int64_t>(std::min(options.timeout_s, 5.0) * 1000);
  ASSIGN_OR_RETURN(auto etcd, cluster::EtcdClient::Connect(eo));
  auto client = std::make_unique<RoutingClient>(options, uri, std::move(etcd));
  RETURN_IF_ERROR(client->StartWatch());
  RETURN_IF_ERROR(client->Nodes().status());
  return std::unique_ptr<Client>(std::move(client));
}

}  // namespace ctxcache::client::internal
