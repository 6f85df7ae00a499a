// The C++ SDK against a real cluster: Client::Connect("etcd://...") routes
// calls to holders, and a decode session survives SIGKILL of the node serving
// it with identical selections; the watched view sees a node leave within a
// second. Run by tests/cluster/test_sdk.py, which
// starts etcd and the nodes and passes:
//   CTXCACHE_CLUSTER_URI  etcd://127.0.0.1:<port>/<cluster>
//   CTXCACHE_CLUSTER_PIDS node_id=pid,... (the test kills the serving node)
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cluster/etcd_client.h"
#include "cluster/etcd_mirror.h"
#include "cluster/placement.h"
#include "ctxcache/client.h"

namespace ctxcache::client {
namespace {

// A client of the etcd behind a parsed cluster URI.
StatusOr<std::unique_ptr<cluster::EtcdClient>> ConnectEtcd(const cluster::ClusterUri& uri) {
  cluster::EtcdClient::Options eo;
  eo.endpoints = uri.endpoints;
  return cluster::EtcdClient::Connect(eo);
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::map<std::string, int> Pids() {
  std::map<std::string, int> out;
  std::string s = Env("CTXCACHE_CLUSTER_PIDS");
  size_t start = 0;
  while (start < s.size()) {
    size_t comma = s.find(',', start);
    std::string item =
        s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    auto eq = item.find('=');
    if (eq != std::string::npos) out[item.substr(0, eq)] = std::stoi(item.substr(eq + 1));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// Selected ids per (token, layer, q head) of `steps` tokens: deterministic
// queries and appends from `seed` (2 layers, 4 q / 2 kv heads, d 32).
StatusOr<std::vector<std::vector<int32_t>>> Decode(DecodeSession* s, int steps, uint32_t seed,
                                                   const std::function<void(int)>& before) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01;
  std::vector<std::vector<int32_t>> out;
  for (int t = 0; t < steps; ++t) {
    if (before) before(t);
    for (uint32_t layer = 0; layer < 2; ++layer) {
      std::vector<float> q(4 * 32);
      for (auto& x : q) x = n01(rng);
      SelectedKV sel;
      RETURN_IF_ERROR(s->Step(layer, q.data(), &sel));
      for (const auto& h : sel.heads) {
        for (const auto& ids : h.per_q_head) out.push_back(ids);
      }
    }
    std::vector<float> k(2 * 2 * 32), v(2 * 2 * 32), q(2 * 4 * 32);
    for (auto* a : {&k, &v, &q}) {
      for (auto& x : *a) x = n01(rng);
    }
    RETURN_IF_ERROR(s->Append(k.data(), v.data(), q.data()));
  }
  return out;
}

TEST(SdkClusterTest, RoutesAndFailsOverMidSessionWithIdenticalSelections) {
  const std::string uri = Env("CTXCACHE_CLUSTER_URI");
  ASSERT_FALSE(uri.empty()) << "run by tests/cluster/test_sdk.py";
  ClientOptions co;
  co.server = uri;
  co.timeout_s = 10;
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status().ToString();

  v1::BuildContextRequest req;
  for (uint32_t i = 0; i < 240; ++i) req.mutable_tokens()->add_ids((i * 29) % 450 + 5);
  auto built = (*client)->Build(req, nullptr);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  const std::string id = built->context().context_id();
  auto info = (*client)->GetContext(id);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->n_tokens(), 240u);

  // A routed ingest from caller buffers: a child of the context (the node
  // holding the parent takes it), its model the parent's.
  v1::IngestHeader ih;
  ih.set_parent_id(id);
  for (uint32_t t : {7u, 8u, 9u}) ih.mutable_tokens()->add_ids(t);
  ih.add_indexes()->set_method("quest");
  auto ingest = (*client)->StartIngest(ih, IngestOptions{});
  ASSERT_TRUE(ingest.ok()) << ingest.status().ToString();
  std::vector<float> kv(2 * 3 * 32, 0.5f);  // [kv heads][tokens][d]
  IngestLayerLayout layout;
  layout.k = layout.v = kv.data();
  layout.k_capacity = layout.v_capacity = kv.size() * sizeof(float);
  layout.dtype = v1::DTYPE_F32;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE((*ingest)->WriteLayer(layer, layout).ok());
  }
  auto child = (*ingest)->Commit();
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->n_tokens(), 243u);
  EXPECT_EQ(child->parent_id(), id);

  // The reference: an uninterrupted session.
  SessionOptions so;
  so.context_id = id;
  so.method = "csa";
  so.params = {{"rho", "0.1"}};
  auto ref_session = (*client)->OpenSession(so);
  ASSERT_TRUE(ref_session.ok()) << ref_session.status().ToString();
  auto reference = Decode(ref_session->get(), 10, 11, nullptr);
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  ASSERT_TRUE((*ref_session)->Close().ok());

  // The node a routed session opens on: the first owner holding the context.
  auto parsed = cluster::ParseClusterUri(uri);
  ASSERT_TRUE(parsed.ok());
  auto etcd = ConnectEtcd(*parsed);
  ASSERT_TRUE(etcd.ok());
  std::vector<cluster::NodeInfo> nodes;
  auto kvs = (*etcd)->GetPrefix("/" + parsed->cluster + "/nodes/");
  ASSERT_TRUE(kvs.ok());
  for (const auto& kv : *kvs) {
    cluster::NodeInfo n;
    n.node_id = kv.key.substr(parsed->cluster.size() + 8);
    nodes.push_back(n);
  }
  std::set<std::string> held;
  const std::string hp = "/" + parsed->cluster + "/holders/" + id + "/";
  auto hk = (*etcd)->GetPrefix(hp);
  ASSERT_TRUE(hk.ok());
  for (const auto& kv : *hk) held.insert(kv.key.substr(hp.size()));
  std::string serving;
  for (const auto& o : cluster::OwnersOf(id, nodes, 2)) {
    if (held.count(o.node_id)) {
      serving = o.node_id;
      break;
    }
  }
  ASSERT_FALSE(serving.empty());
  auto pids = Pids();
  ASSERT_TRUE(pids.count(serving)) << serving;

  auto session = (*client)->OpenSession(so);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  auto got = Decode(session->get(), 10, 11, [&](int t) {
    if (t == 4) {
      ASSERT_EQ(kill(pids[serving], SIGKILL), 0);
    }
  });
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, *reference);
  (*session)->Close().IgnoreError();
  std::printf("killed %s mid-session; selections identical\n", serving.c_str());
}

// The watch the routing client (and every node) keeps of the cluster prefix
// sees a node leave within a second of its lease's revocation (what a clean
// shutdown does), whatever the lease TTL.
TEST(SdkClusterTest, WatchSeesALeaseRevocationWithinASecond) {
  const std::string uri = Env("CTXCACHE_CLUSTER_URI");
  ASSERT_FALSE(uri.empty()) << "run by tests/cluster/test_sdk.py";
  auto parsed = cluster::ParseClusterUri(uri);
  ASSERT_TRUE(parsed.ok());
  auto etcd = ConnectEtcd(*parsed);
  ASSERT_TRUE(etcd.ok());
  const std::string prefix = "/" + parsed->cluster + "/";
  auto mirror = cluster::EtcdMirror::Start(etcd->get(), {prefix, 200});
  ASSERT_TRUE(mirror.ok()) << mirror.status().ToString();
  // A live node (the other test may have killed one).
  auto pids = Pids();
  std::string key;
  int64_t lease = 0;
  for (const auto& [k, kv] : (*mirror)->Snapshot()) {
    if (k.rfind(prefix + "nodes/", 0) != 0) continue;
    std::string node = k.substr(prefix.size() + 6);
    if (pids.count(node) && kill(pids[node], 0) == 0) {
      key = k;
      lease = kv.lease;
      break;
    }
  }
  ASSERT_FALSE(key.empty());
  ASSERT_NE(lease, 0);
  uint64_t seen = (*mirror)->version();
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*etcd)->RevokeLease(lease).ok());
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
    seen = (*mirror)->WaitChange(seen, 100);
    gone = (*mirror)->Snapshot().count(key) == 0;
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(gone);
  EXPECT_LT(s, 1.0) << key << " left the mirror after " << s << " s";
  EXPECT_TRUE((*mirror)->connected());
  std::printf("%s left the watched view %.1f ms after its lease was revoked\n", key.c_str(),
              s * 1e3);
}

}  // namespace
}  // namespace ctxcache::client
