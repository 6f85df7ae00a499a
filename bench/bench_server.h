// The ctxcached a service bench (e2e, tasks) runs against: the server from the
// bench's own bin directory on a temp data dir, loopback with ephemeral ports,
// metrics off, one hosted model. The process spawn and port-file wait are
// tests/service/server_process.h.
// Thread-safety: free functions over a caller-owned ServerProcess.
#pragma once

#include <signal.h>

#include <filesystem>
#include <string>

#include "tests/service/server_process.h"

namespace ctxcache::bench {

// Directory of the running bench binary (where ctxcached is built next to it).
inline std::string SelfDir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
}

// Starts ctxcached with data under dir/data, hosting `model` from model_dir
// as its default model. False if it does not come up (see log_path()).
inline bool StartBenchServer(const std::string& dir, const std::string& model_dir,
                             const std::string& model, testing::ServerProcess* server) {
  return server->Start(dir + "/data",
                       {"--metrics-listen", "", "--model-dir", model_dir, "--default-model", model,
                        "--max-message-bytes", "67108864", "--log-level", "warn"});
}

// Stops the server with SIGTERM when the bench returns (drains; SIGKILL after
// ServerProcess::Stop's timeout).
struct StopOnExit {
  testing::ServerProcess* server;
  ~StopOnExit() { server->Stop(SIGTERM); }
};

}  // namespace ctxcache::bench
