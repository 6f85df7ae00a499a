// `ctxcache keys`: manage the keys file ctxcached reads (auth/keys_file.h)
// offline: create (prints the new key once), list, revoke, map-cert. The
// server picks up the change by itself (it re-reads the file when it
// changes) or on SIGHUP.
#pragma once

#include <string>

#include "client/cli/command.h"

namespace ctxcache::cli {

class KeysCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  CLI::App* create_ = nullptr;
  CLI::App* list_ = nullptr;
  CLI::App* revoke_ = nullptr;
  CLI::App* map_cert_ = nullptr;
  std::string keys_file_;
  std::string tenant_;
  std::string role_;
  std::string id_;
  std::string cn_;
};

}  // namespace ctxcache::cli
