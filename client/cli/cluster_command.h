// `ctxcache cluster status`: the cluster's live nodes as one node sees them
// (ClusterService.GetClusterStatus, operator role): node id, address, zone,
// health, stored and owned contexts, replication lag; plus the rebalancer.
// --server is any node's HOST:PORT, or etcd://host:port/<cluster> (the first
// live node registered there answers). Exit 0 when every node is SERVING and
// no node reports lag, 1 otherwise, 2 when no node answers.
#pragma once

#include "client/cli/command.h"

namespace ctxcache::cli {

class ClusterCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string action_ = "status";
};

}  // namespace ctxcache::cli
