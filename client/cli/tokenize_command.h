// `ctxcache tokenize`: a model directory's tokenizer (tokenizer.model) over
// text, printing the token ids as a JSON list, offline. For workers that
// need the same token ids as ctxcached's text builds (e.g. the HF bench,
// python/bench/hf_decode.py).
#pragma once

#include <string>
#include <vector>

#include "client/cli/command.h"

namespace ctxcache::cli {

class TokenizeCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string model_dir_ = "models";
  std::string model_ = "ctxcache-ref";
  std::vector<std::string> files_;
  std::string text_;
  bool bos_ = false;
};

}  // namespace ctxcache::cli
