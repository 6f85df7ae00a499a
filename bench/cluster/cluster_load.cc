// ctxcache-cluster-load: a C++ read-load generator for a ctxcached cluster
// (bench/cluster/cluster_scaling.py drives it; docs/benchmarks.md, "Cluster
// read throughput").
//
// Through the C++ SDK's routing client (ClientOptions::server =
// etcd://host:port/<cluster>):
//   1. builds --contexts contexts of --tokens tokens (ids from --seed), or
//      reuses them when they exist (a build of the same tokens is the same
//      context);
//   2. waits until every context is held by exactly its R owners (etcd
//      holder keys vs rendezvous placement over the live nodes);
//   3. runs --concurrency threads for --seconds, each calling FetchPages in
//      a loop: --pages random pages of one random (context, layer, kv head)
//      per call, routed by the client to a holder (owners first);
//   4. prints one JSON line: pages/s, calls/s, call latency p50/p99, errors,
//      and the calls routed to each node (the routing client's first
//      candidate for each context).
// Exit status 0 when every call succeeded and at least one page was read.
//
// Usage: ctxcache-cluster-load --server etcd://127.0.0.1:2379/bench
//          [--replicas 2] [--contexts 12] [--tokens 1024] [--pages 64]
//          [--concurrency 32] [--seconds 8] [--warmup-s 1] [--seed 1]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cluster/etcd_client.h"
#include "cluster/placement.h"
#include "ctxcache/client.h"

namespace {

using ctxcache::Status;
using ctxcache::StatusOr;
namespace v1 = ctxcache::v1;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string JsonField(const std::string& json, const std::string& field) {
  try {
    return nlohmann::json::parse(json).value(field, "");
  } catch (const nlohmann::json::exception&) {
    return "";
  }
}

struct Placement {
  bool placed = false;
  std::map<std::string, std::string> first_owner;  // ctx -> node id
  std::map<std::string, std::string> addr;         // node id -> address
};

// Holders of every context == its owners over the live nodes?
StatusOr<Placement> CheckPlacement(ctxcache::cluster::EtcdClient* etcd, const std::string& cluster,
                                   const std::vector<std::string>& ids, uint32_t replicas) {
  const std::string nodes_prefix = "/" + cluster + "/nodes/";
  ASSIGN_OR_RETURN(auto kvs, etcd->GetPrefix(nodes_prefix));
  std::vector<ctxcache::cluster::NodeInfo> nodes;
  Placement p;
  for (const auto& kv : kvs) {
    ctxcache::cluster::NodeInfo n;
    n.node_id = kv.key.substr(nodes_prefix.size());
    n.address = JsonField(kv.value, "addr");
    n.zone = JsonField(kv.value, "zone");
    p.addr[n.node_id] = n.address;
    nodes.push_back(n);
  }
  p.placed = true;
  for (const auto& id : ids) {
    const std::string hp = "/" + cluster + "/holders/" + id + "/";
    ASSIGN_OR_RETURN(auto hs, etcd->GetPrefix(hp));
    std::set<std::string> held;
    for (const auto& kv : hs) held.insert(kv.key.substr(hp.size()));
    std::set<std::string> owners;
    auto o = ctxcache::cluster::OwnersOf(id, nodes, replicas);
    for (const auto& n : o) owners.insert(n.node_id);
    if (!o.empty()) p.first_owner[id] = o[0].node_id;
    if (held != owners) p.placed = false;
  }
  return p;
}

int Run(int argc, char** argv) {
  std::string server;
  uint32_t replicas = 2;
  int contexts = 12, tokens = 1024, pages = 64, concurrency = 32;
  double seconds = 8, warmup_s = 1, placement_timeout_s = 120;
  uint32_t seed = 1;
  CLI::App app{"ctxcache-cluster-load: FetchPages load through the routing client"};
  app.add_option("--server", server, "etcd://host:port/<cluster>")->required();
  app.add_option("--replicas", replicas, "the cluster's R");
  app.add_option("--contexts", contexts, "contexts to build and read");
  app.add_option("--tokens", tokens, "tokens per context");
  app.add_option("--pages", pages, "pages per FetchPages call");
  app.add_option("--concurrency", concurrency, "calls in flight (one thread each)");
  app.add_option("--seconds", seconds, "measured duration");
  app.add_option("--warmup-s", warmup_s, "unmeasured load before it");
  app.add_option("--placement-timeout-s", placement_timeout_s, "wait for R copies on owners");
  app.add_option("--seed", seed, "token and request seed");
  CLI11_PARSE(app, argc, argv);

  ctxcache::client::ClientOptions co;
  co.server = server;
  co.cluster_replicas = replicas;
  co.timeout_s = 120;
  co.max_message_bytes = 256 << 20;
  auto client = ctxcache::client::Client::Connect(co);
  if (!client.ok()) {
    std::cerr << "connect: " << client.status().ToString() << "\n";
    return 1;
  }
  auto uri = ctxcache::cluster::ParseClusterUri(server, "--server");
  if (!uri.ok()) {
    std::cerr << uri.status().ToString() << "\n";
    return 2;
  }
  auto etcd = ctxcache::cluster::EtcdClient::Connect({uri->endpoints, 3000});
  if (!etcd.ok()) {
    std::cerr << etcd.status().ToString() << "\n";
    return 1;
  }

  // 1. Contexts.
  const double t_build = Now();
  std::vector<std::string> ids;
  uint32_t n_layers = 0, n_kv = 0, block_tokens = 0;
  uint64_t n_tokens = 0;
  for (int j = 0; j < contexts; ++j) {
    v1::BuildContextRequest req;
    std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(j));
    for (int i = 0; i < tokens; ++i) {
      req.mutable_tokens()->add_ids(static_cast<int32_t>(1 + rng() % 500));
    }
    auto r = (*client)->Build(req, nullptr);
    if (!r.ok()) {
      std::cerr << "build " << j << ": " << r.status().ToString() << "\n";
      return 1;
    }
    const auto& info = r->context();
    ids.push_back(info.context_id());
    n_layers = info.model().n_layers();
    n_kv = info.model().n_kv_heads();
    block_tokens = info.block_tokens();
    n_tokens = info.n_tokens();
  }
  const double build_s = Now() - t_build;

  // 2. Placement.
  const double t_place = Now();
  Placement placement;
  for (;;) {
    auto p = CheckPlacement(etcd->get(), uri->cluster, ids, replicas);
    if (p.ok() && p->placed) {
      placement = *p;
      break;
    }
    if (Now() - t_place > placement_timeout_s) {
      std::cerr << "contexts not on exactly their owners after " << placement_timeout_s << " s\n";
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const double place_s = Now() - t_place;

  // 3. Load.
  const uint32_t n_blocks = static_cast<uint32_t>((n_tokens + block_tokens - 1) / block_tokens);
  const int want_pages = std::min<int>(pages, static_cast<int>(n_blocks));
  std::atomic<bool> measuring{false}, stop{false};
  std::mutex mu;
  std::vector<double> lat_us;
  uint64_t total_pages = 0, total_calls = 0, errors = 0;
  std::string first_error;
  std::map<std::string, uint64_t> calls_by_node;
  std::vector<std::thread> threads;
  for (int t = 0; t < concurrency; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(seed * 104729u + static_cast<uint32_t>(t));
      std::vector<uint32_t> all(n_blocks);
      for (uint32_t b = 0; b < n_blocks; ++b) all[b] = b;
      std::vector<double> my_lat;
      std::map<std::string, uint64_t> my_nodes;
      uint64_t my_pages = 0, my_calls = 0, my_errors = 0;
      std::string my_error;
      std::vector<v1::Page> got;
      while (!stop.load(std::memory_order_relaxed)) {
        const std::string& id = ids[rng() % ids.size()];
        v1::FetchPagesRequest req;
        req.set_context_id(id);
        auto* table = req.add_tables();
        table->set_layer(rng() % n_layers);
        table->set_kv_head(rng() % n_kv);
        for (int i = 0; i < want_pages; ++i) {
          std::swap(all[i], all[i + rng() % (n_blocks - i)]);
        }
        std::vector<uint32_t> blocks(all.begin(), all.begin() + want_pages);
        std::sort(blocks.begin(), blocks.end());
        for (uint32_t b : blocks) table->add_blocks(b);
        const bool m = measuring.load(std::memory_order_relaxed);
        const double t0 = Now();
        Status s = (*client)->FetchPages(req, &got);
        const double us = (Now() - t0) * 1e6;
        if (!m) continue;
        if (!s.ok()) {
          if (my_errors++ == 0) my_error = s.ToString();
          continue;
        }
        my_lat.push_back(us);
        my_pages += got.size();
        ++my_calls;
        ++my_nodes[placement.first_owner[id]];
      }
      std::lock_guard lock(mu);
      lat_us.insert(lat_us.end(), my_lat.begin(), my_lat.end());
      total_pages += my_pages;
      total_calls += my_calls;
      errors += my_errors;
      if (first_error.empty()) first_error = my_error;
      for (const auto& [n, c] : my_nodes) calls_by_node[n] += c;
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(warmup_s));
  measuring = true;
  const double t0 = Now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  measuring = false;
  const double wall = Now() - t0;
  stop = true;
  for (auto& t : threads) t.join();

  std::sort(lat_us.begin(), lat_us.end());
  auto pct = [&](double q) {
    return lat_us.empty() ? 0.0 : lat_us[std::min(lat_us.size() - 1, size_t(q * lat_us.size()))];
  };
  nlohmann::json nodes = nlohmann::json::object();
  for (const auto& [n, a] : placement.addr) {
    nodes[n] = {{"address", a}, {"calls", calls_by_node.count(n) ? calls_by_node[n] : 0}};
  }
  nlohmann::json out = {
      {"bench", "cluster_load"},
      {"server", server},
      {"replicas", replicas},
      {"live_nodes", placement.addr.size()},
      {"contexts", contexts},
      {"tokens", n_tokens},
      {"block_tokens", block_tokens},
      {"pages_per_call", want_pages},
      {"concurrency", concurrency},
      {"seconds", wall},
      {"build_s", build_s},
      {"placement_s", place_s},
      {"pages", total_pages},
      {"calls", total_calls},
      {"errors", errors},
      {"first_error", first_error},
      {"pages_per_s", total_pages / wall},
      {"calls_per_s", total_calls / wall},
      {"p50_ms", pct(0.5) / 1e3},
      {"p99_ms", pct(0.99) / 1e3},
      {"nodes", nodes},
  };
  std::cout << out.dump() << std::endl;
  return errors == 0 && total_pages > 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
