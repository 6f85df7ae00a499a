// The ctxcached server: owns the store, the gRPC server (ContextAdmin,
// DecodeService, grpc.health.v1.Health, server reflection) and the metrics
// endpoint.
//
// Lifecycle: Start() opens the data dir (failing fast if another process
// holds its RocksDB LOCK), binds the ports and starts serving. Shutdown()
// flips health to NOT_SERVING, stops accepting RPCs, waits up to
// drain_timeout_s for in-flight ones, then closes the store.
//
// Thread-safety: Start/Shutdown are called from one thread; everything else
// is internal.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "service/config.h"

namespace ctxcache::service {

class ServerImpl;

// The health service name that is SERVING when --default-model is hosted
// (builds from text or token ids can run). The overall status ("") and the
// gRPC services' stay SERVING without a model: sessions, reads and ingests
// need none.
inline constexpr const char kPrefillHealthService[] = "ctxcache.prefill";

// Whether a --listen address only accepts local connections (127.0.0.0/8,
// ::1, localhost, unix:).
bool IsLoopbackListen(const std::string& listen);

class Server {
 public:
  explicit Server(ServerConfig config);
  ~Server();

  Status Start();
  // The bound gRPC port (after Start).
  int port() const;
  int metrics_port() const;
  void Shutdown();
  // Re-reads the keys and tenants files (what SIGHUP does).
  void Reload();

 private:
  std::unique_ptr<ServerImpl> impl_;
};

// The whole ctxcached process: parse flags, log the effective config, start,
// wait for SIGTERM/SIGINT (draining) or SIGHUP (Reload). Returns the
// process exit code.
int RunCtxcached(int argc, char** argv);

}  // namespace ctxcache::service
