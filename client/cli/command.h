// The `ctxcache` admin CLI: one class per subcommand, registered in
// cli/cli.cc. Output is a human-readable table by default and JSON with
// --json. Failures print one line "ctxcache: <what went wrong>; <what to do>"
// to stderr and exit non-zero.
//
// Thread-safety: commands run once on the main thread.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <ostream>
#include <string>

namespace ctxcache::cli {

// Exit codes of every subcommand (docs/cli.md).
enum ExitCode : int {
  kExitOk = 0,
  // The server refused the call (any gRPC error but the two below), health
  // is not SERVING, or an offline check found a problem (fsck).
  kExitFailed = 1,
  // Bad flags, values or input files: nothing was sent.
  kExitUsage = 2,
  // The server (or etcd) could not be reached, or the deadline passed.
  kExitUnreachable = 3,
};

// Options shared by every subcommand.
struct GlobalOptions {
  std::string server = "127.0.0.1:7700";
  bool json = false;
  // Deadline for each RPC, seconds.
  double timeout_s = 10.0;
  // Time to wait for the connection before the first call, seconds.
  double dial_timeout_s = 5.0;
  // TLS and credentials (client::ClientOptions; docs/security.md).
  std::string tls_ca, tls_cert, tls_key, tls_server_name;
  // The API key: --api-key-file, else $CTXCACHE_API_KEY, else --api-key.
  std::string api_key, api_key_file;
};

class Command {
 public:
  virtual ~Command() = default;
  // Adds the subcommand's flags to `sub`.
  virtual void Configure(CLI::App* sub) = 0;
  // Runs it; returns the process exit code.
  virtual int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) = 0;
};

// Entry point of the CLI (the 3-line main calls this).
int RunCli(int argc, char** argv);

}  // namespace ctxcache::cli
