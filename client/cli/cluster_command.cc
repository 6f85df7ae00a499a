#include "client/cli/cluster_command.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "client/cli/cli_util.h"
#include "client/sdk/channel.h"
#include "cluster/etcd_client.h"
#include "ctxcache/v1/cluster_service.grpc.pb.h"

namespace ctxcache::cli {

namespace {

// host:port of the live nodes registered under an etcd:// address.
StatusOr<std::vector<std::string>> NodesFromEtcd(const std::string& uri) {
  ASSIGN_OR_RETURN(auto parsed, cluster::ParseClusterUri(uri, "--server"));
  cluster::EtcdClient::Options eo;
  eo.endpoints = parsed.endpoints;
  ASSIGN_OR_RETURN(auto etcd, cluster::EtcdClient::Connect(eo));
  ASSIGN_OR_RETURN(auto kvs, etcd->GetPrefix("/" + parsed.cluster + "/nodes/"));
  std::vector<std::string> out;
  for (const auto& kv : kvs) {
    auto j = nlohmann::json::parse(kv.value, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("addr") && j["addr"].is_string()) out.push_back(j["addr"]);
  }
  if (out.empty()) return UnavailableError("no live node registered in " + uri);
  return out;
}

}  // namespace

void ClusterCommand::Configure(CLI::App* sub) {
  sub->add_option("action", action_, "status")->check(CLI::IsMember({"status"}));
}

int ClusterCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  std::vector<std::string> servers = {global.server};
  if (global.server.rfind("etcd://", 0) == 0) {
    auto nodes = NodesFromEtcd(global.server);
    if (!nodes.ok()) {
      err << "ctxcache: " << nodes.status().message() << "\n";
      const StatusCode code = nodes.status().code();
      return code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded
                 ? kExitUnreachable
                 : kExitUsage;
    }
    servers = *nodes;
  }
  v1::ClusterStatus st;
  grpc::Status last;
  std::string answered;
  for (const auto& server : servers) {
    client::ClientOptions o;
    o.server = server;
    if (Status s = ApplyCredentials(global, &o); !s.ok()) {
      err << "ctxcache: " << s.message() << "\n";
      return kExitUsage;
    }
    auto channel = client::internal::MakeChannel(o);
    if (!channel.ok()) {
      err << "ctxcache: " << channel.status().message() << "\n";
      return kExitUsage;
    }
    grpc::ClientContext ctx;
    client::internal::AddCallCredentials(o, &ctx);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(global.timeout_s * 1000)));
    last = v1::ClusterService::NewStub(*channel)->GetClusterStatus(&ctx, v1::ClusterStatusRequest(),
                                                                   &st);
    if (last.ok()) {
      answered = server;
      break;
    }
    if (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
        last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      break;
    }
  }
  if (!last.ok()) {
    err << "ctxcache: cluster status: " << last.error_message()
        << (last.error_code() == grpc::StatusCode::UNAVAILABLE
                ? "; is ctxcached running? pass --server HOST:PORT or etcd://HOST:PORT/<cluster>"
                : "")
        << "\n";
    return last.error_code() == grpc::StatusCode::UNAVAILABLE ||
                   last.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
               ? kExitUnreachable
               : kExitFailed;
  }
  bool healthy = true;
  for (const auto& n : st.nodes()) {
    if (n.health() != "SERVING" || n.replication_lag_contexts() > 0) healthy = false;
  }
  if (global.json) {
    nlohmann::json j = {{"cluster", st.cluster()},
                        {"replicas", st.replicas()},
                        {"rebalancer", st.rebalancer()},
                        {"answered_by", answered},
                        {"nodes", nlohmann::json::array()}};
    for (const auto& n : st.nodes()) {
      j["nodes"].push_back({{"node_id", n.node_id()},
                            {"address", n.address()},
                            {"zone", n.zone()},
                            {"health", n.health()},
                            {"capacity_bytes", n.capacity_bytes()},
                            {"stored_contexts", n.stored_contexts()},
                            {"owned_contexts", n.owned_contexts()},
                            {"replication_lag_contexts", n.replication_lag_contexts()}});
    }
    out << j.dump() << "\n";
    return healthy ? 0 : 1;
  }
  out << "cluster " << st.cluster() << ": " << st.nodes_size()
      << " live node(s), R=" << st.replicas() << ", rebalancer "
      << (st.rebalancer().empty() ? "-" : st.rebalancer()) << "\n";
  char line[512];
  std::snprintf(line, sizeof(line), "%-16s %-22s %-8s %-10s %8s %8s %8s\n", "NODE", "ADDRESS",
                "ZONE", "HEALTH", "STORED", "OWNED", "LAG");
  out << line;
  for (const auto& n : st.nodes()) {
    std::snprintf(line, sizeof(line), "%-16s %-22s %-8s %-10s %8llu %8llu %8llu\n",
                  n.node_id().c_str(), n.address().c_str(),
                  n.zone().empty() ? "-" : n.zone().c_str(), n.health().c_str(),
                  static_cast<unsigned long long>(n.stored_contexts()),
                  static_cast<unsigned long long>(n.owned_contexts()),
                  static_cast<unsigned long long>(n.replication_lag_contexts()));
    out << line;
  }
  return healthy ? 0 : 1;
}

}  // namespace ctxcache::cli
