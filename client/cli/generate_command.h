// `ctxcache generate`: runs the reference decode worker against a context
// and prints the continuation; with --compare full also a dense run and the
// agreement, KL, latency and bytes comparison.
#pragma once

#include <string>
#include <vector>

#include "client/cli/command.h"

namespace ctxcache::cli {

class GenerateCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string context_, prompt_, method_ = "csa", mode_ = "server", compare_, model_dir_ = "models",
                                 model_;
  int max_tokens_ = 64;
  double rho_ = 0.05;
  double page_fraction_ = 0;
  std::vector<std::string> session_params_;  // KEY=VALUE
};

}  // namespace ctxcache::cli
