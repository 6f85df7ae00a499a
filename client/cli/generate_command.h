// `ctxcache generate`: runs the reference decode worker against a context
// and prints the continuation; with --compare full also a dense run and the
// agreement, KL, latency and bytes comparison.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "client/cli/command.h"
#include "client/worker/decode_worker.h"
#include "index/methods.h"
#include "model/model.h"
#include "model/tokenizer.h"

namespace ctxcache::cli {

class GenerateCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  // The worker's side: the local model, its tokenizer and the prompt.
  struct Worker {
    std::unique_ptr<model::Model> model;
    std::unique_ptr<model::Tokenizer> tokenizer;
    std::vector<int32_t> prompt;
  };
  // Each returns 0, or the exit code after writing the error to err.
  int SessionOptionsFromFlags(client::GenerateOptions* go, std::ostream& err) const;
  int LoadWorker(const v1::ContextInfo& info, const GlobalOptions& global, Worker* w,
                 std::ostream& err) const;
  int CompareWithDense(client::Client* client, const Worker& w, const client::GenerateOptions& go,
                       nlohmann::json* j, const GlobalOptions& global, std::ostream& err) const;
  void PrintText(const nlohmann::json& j, std::ostream& out) const;

  std::string context_, prompt_, method_ = std::string(index::kDefaultMethod), mode_ = "server",
                                 compare_, model_dir_ = "models", model_;
  int max_tokens_ = 64;
  double rho_ = 0.05;
  double page_fraction_ = 0;
  std::vector<std::string> session_params_;  // KEY=VALUE
};

}  // namespace ctxcache::cli
