// `ctxcache health`: asks grpc.health.v1.Health; prints SERVING or
// NOT_SERVING and exits 0 or 1 (2 when the server is unreachable).
#pragma once

#include "client/cli/command.h"

namespace ctxcache::cli {

class HealthCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string service_;  // "" = the whole server
};

}  // namespace ctxcache::cli
