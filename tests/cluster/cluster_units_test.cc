// Placement (rendezvous hashing), the etcd:// address parser and the
// cluster flags' validation.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "cluster/etcd_client.h"
#include "cluster/placement.h"
#include "service/config.h"

namespace ctxcache::cluster {
namespace {

std::vector<NodeInfo> Nodes(int n, int zones = 1) {
  std::vector<NodeInfo> out;
  for (int i = 0; i < n; ++i) {
    NodeInfo x;
    x.node_id = std::string("n").append(std::to_string(i));
    x.address = std::string("a").append(std::to_string(i));
    x.zone = std::string("z").append(std::to_string(i % zones));
    out.push_back(x);
  }
  return out;
}

std::string HexId(int i) {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%032x", i * 2654435761u);
  return buf;
}

TEST(PlacementTest, ScoreMatchesThePythonRoutingClient) {
  // Values from python/ctxcache/cluster.py:rendezvous_score (hashlib): the
  // routing clients and the nodes must agree on owners.
  EXPECT_EQ(RendezvousScore("n0", "00112233445566778899aabbccddeeff"), 8757784162351915363ull);
  EXPECT_EQ(RendezvousScore("node-b", "ffffffffffffffffffffffffffffffff"), 10354402899574390293ull);
  std::vector<NodeInfo> nodes = Nodes(5, 2);
  auto owners = OwnersOf("0123456789abcdef0123456789abcdef", nodes, 3);
  ASSERT_EQ(owners.size(), 3u);
  EXPECT_EQ(owners[0].node_id, "n2");
  EXPECT_EQ(owners[1].node_id, "n3");
  EXPECT_EQ(owners[2].node_id, "n4");
}

TEST(PlacementTest, OwnersAreDistinctDeterministicAndCapped) {
  auto nodes = Nodes(4);
  for (int i = 0; i < 200; ++i) {
    auto a = OwnersOf(HexId(i), nodes, 2);
    std::vector<NodeInfo> shuffled(nodes.rbegin(), nodes.rend());
    auto b = OwnersOf(HexId(i), shuffled, 2);
    ASSERT_EQ(a.size(), 2u);
    EXPECT_NE(a[0].node_id, a[1].node_id);
    EXPECT_EQ(a[0].node_id, b[0].node_id);  // independent of the list order
    EXPECT_EQ(a[1].node_id, b[1].node_id);
  }
  EXPECT_EQ(OwnersOf(HexId(1), Nodes(1), 3).size(), 1u);
  EXPECT_TRUE(OwnersOf(HexId(1), {}, 2).empty());
}

TEST(PlacementTest, SpreadsEvenlyAndALeaveMovesOnlyTheLeaversContexts) {
  auto nodes = Nodes(4);
  std::map<std::string, int> primaries;
  const int kContexts = 4000;
  int moved = 0, had_leaver = 0;
  auto without = std::vector<NodeInfo>(nodes.begin(), nodes.end() - 1);  // n3 leaves
  for (int i = 0; i < kContexts; ++i) {
    auto before = OwnersOf(HexId(i), nodes, 2);
    primaries[before[0].node_id]++;
    auto after = OwnersOf(HexId(i), without, 2);
    std::set<std::string> b{before[0].node_id, before[1].node_id};
    std::set<std::string> a{after[0].node_id, after[1].node_id};
    bool leaver = b.count("n3") > 0;
    had_leaver += leaver;
    if (a != b) ++moved;
    if (!leaver) {
      EXPECT_EQ(a, b) << "context " << i << " moved without losing an owner";
    }
  }
  EXPECT_EQ(moved, had_leaver);
  for (const auto& [node, n] : primaries) {
    EXPECT_GT(n, kContexts / 4 * 8 / 10) << node;  // within 20% of even
    EXPECT_LT(n, kContexts / 4 * 12 / 10) << node;
  }
}

TEST(PlacementTest, OwnersSpreadAcrossZonesFirst) {
  auto nodes = Nodes(6, 3);  // zones z0..z2, two nodes each
  for (int i = 0; i < 300; ++i) {
    auto owners = OwnersOf(HexId(i), nodes, 3);
    std::set<std::string> zones;
    for (const auto& o : owners) zones.insert(o.zone);
    EXPECT_EQ(zones.size(), 3u);
  }
  auto two_zones = Nodes(4, 2);
  for (int i = 0; i < 300; ++i) {
    auto owners = OwnersOf(HexId(i), two_zones, 3);
    ASSERT_EQ(owners.size(), 3u);
    EXPECT_NE(owners[0].zone, owners[1].zone);
  }
}

TEST(ClusterUriTest, ParsesEndpointsAndName) {
  auto u = ParseClusterUri("etcd://127.0.0.1:2379,etcd-1:2379/prod-a");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->cluster, "prod-a");
  ASSERT_EQ(u->endpoints.size(), 2u);
  EXPECT_EQ(u->endpoints[1], "etcd-1:2379");
}

TEST(ClusterUriTest, RejectsBadAddressesNamingTheFlag) {
  for (const char* bad : {"http://h:1/c", "etcd://h:1", "etcd://h:1/", "etcd://h/c",
                          "etcd://h:1,/c", "etcd://h:1/a/b", "etcd://:1/c"}) {
    auto u = ParseClusterUri(bad);
    ASSERT_FALSE(u.ok()) << bad;
    EXPECT_EQ(u.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(u.status().message()).find("--cluster"), std::string::npos) << bad;
  }
}

StatusOr<service::ServerConfig> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ctxcached");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return service::ParseServerConfig(static_cast<int>(argv.size()), argv.data());
}

TEST(ClusterFlagsTest, DefaultsAndValidation) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->cluster, "");
  EXPECT_EQ(c->replicas, 2u);
  EXPECT_EQ(c->min_replicas, 0u);  // = replicas
  EXPECT_EQ(c->etcd_lease_ttl_s, 10u);
  c = Parse({"--cluster", "etcd://h:1/c", "--replicas", "3", "--min-replicas", "2", "--zone", "r1",
             "--node-id", "a", "--advertise-addr", "h:7"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->replicas, 3u);
  EXPECT_EQ(c->min_replicas, 2u);
  EXPECT_NE(c->ToToml().find("min-replicas = 2"), std::string::npos);

  auto bad = Parse({"--cluster", "etcd://h:1/c", "--replicas", "2", "--min-replicas", "3"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("--min-replicas"), std::string::npos);
  bad = Parse({"--node-id", "a"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("need --cluster"), std::string::npos);
  bad = Parse({"--cluster", "etcd://h:1/c", "--keys-file", "k"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("--cluster-key-file"), std::string::npos);
}

}  // namespace
}  // namespace ctxcache::cluster
