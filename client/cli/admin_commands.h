// Admin subcommands of the `ctxcache` CLI: build, ls, show, evict, pin,
// unpin, stats, watch. Each is one small class.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "client/cli/command.h"

namespace ctxcache::cli {

class BuildCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string file_, text_, model_, name_, tenant_;
  std::vector<std::string> labels_, indexes_, index_params_;
  int64_t ttl_s_ = 0;
  bool pin_ = false, bos_ = false, stdin_ = false;
  std::vector<uint32_t> token_ids_;
};

class ListCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::vector<std::string> labels_;
  std::string tenant_;
  uint32_t limit_ = 1000;
};

class ShowCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string id_;
};

class EvictCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string id_;
};

class ShareCommand final : public Command {
 public:
  explicit ShareCommand(bool share) : share_(share) {}
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  bool share_;
  std::string id_;
};

class PinCommand final : public Command {
 public:
  explicit PinCommand(bool pin) : pin_(pin) {}
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  bool pin_;
  std::string id_;
};

class StatsCommand final : public Command {
 public:
  void Configure(CLI::App*) override {}
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;
};

class WatchCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string id_;
  double seconds_ = 0;
  uint32_t count_ = 0;
};

}  // namespace ctxcache::cli
