#include "service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "common/logging.h"
#include "service/admin_service.h"
#include "service/decode_service.h"
#include "service/metrics.h"
#include "service/service_context.h"
#include "storage/store.h"

#ifndef CTXCACHE_VERSION
#define CTXCACHE_VERSION "0.0.0"
#endif
#ifndef CTXCACHE_GIT_REVISION
#define CTXCACHE_GIT_REVISION "unknown"
#endif

namespace ctxcache::service {

class ServerImpl {
 public:
  explicit ServerImpl(ServerConfig config) : ctx_(std::move(config)) {}

  Status Start() {
    const ServerConfig& c = ctx_.config;
    ctx_.start_time = std::chrono::steady_clock::now();

    // Open the store first: a second ctxcached on the same dir must fail
    // before it touches any port.
    storage::StoreOptions so;
    so.block_cache_bytes = c.block_cache_mb << 20;
    so.eviction.capacity_bytes = c.capacity_bytes;
    so.eviction.high_watermark = c.high_watermark;
    so.eviction.low_watermark = c.low_watermark;
    so.default_ttl_ms = c.default_ttl_s * 1000;
    auto store = storage::Store::Open(so, c.data_dir);
    if (!store.ok()) {
      const Status& s = store.status();
      if (storage::IsDataDirLockedError(s.message())) {
        return Status(s.code(), "data dir '" + c.data_dir +
                                    "' is locked by another process (RocksDB LOCK file " +
                                    c.data_dir +
                                    "/LOCK): stop the other ctxcached or pass a "
                                    "different --data-dir. Detail: " +
                                    std::string(s.message()));
      }
      return s.WithContext("opening data dir '" + c.data_dir + "'");
    }
    ctx_.store = std::move(store).value();

    RegisterProcessMetrics();

    admin_ = std::make_unique<AdminServiceImpl>(&ctx_);
    decode_ = std::make_unique<DecodeServiceImpl>(&ctx_);

    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int bound_port = 0;
    builder.AddListeningPort(c.listen, grpc::InsecureServerCredentials(), &bound_port);
    builder.SetMaxReceiveMessageSize(static_cast<int>(c.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(c.max_message_bytes));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                               static_cast<int>(c.keepalive_time_s) * 1000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.RegisterService(admin_.get());
    builder.RegisterService(decode_.get());
    server_ = builder.BuildAndStart();
    if (!server_ || bound_port == 0) {
      return UnavailableError("cannot listen on --listen " + c.listen +
                              " (address in use or invalid); pick another address or port");
    }
    port_ = bound_port;
    auto* health = server_->GetHealthCheckService();
    health->SetServingStatus(true);
    health->SetServingStatus("ctxcache.v1.ContextAdmin", true);
    health->SetServingStatus("ctxcache.v1.DecodeService", true);

    if (!c.metrics_listen.empty()) {
      metrics_http_ = std::make_unique<MetricsHttpServer>(&ctx_.metrics);
      Status s = metrics_http_->Start(c.metrics_listen);
      if (!s.ok()) {
        Shutdown();
        return s;
      }
    }
    if (!c.port_file.empty()) {
      // Line 1: gRPC port; line 2: metrics port (0 if off). Written to a
      // temp name and renamed, so readers never see a partial file.
      std::string tmp = c.port_file + ".tmp";
      {
        std::ofstream f(tmp);
        f << port_ << "\n" << metrics_port() << "\n";
      }
      std::rename(tmp.c_str(), c.port_file.c_str());
    }
    spdlog::info(
        "serving gRPC on port {} (ContextAdmin, DecodeService, health, reflection); "
        "metrics on {}",
        port_, metrics_http_ ? std::to_string(metrics_http_->port()) : "(off)");
    return Status::OK();
  }

  void Shutdown() {
    if (shut_down_) return;
    shut_down_ = true;
    if (server_) {
      server_->GetHealthCheckService()->SetServingStatus(false);
      spdlog::info("draining: health NOT_SERVING, waiting up to {} s for in-flight RPCs",
                   ctx_.config.drain_timeout_s);
      ctx_.draining = true;
      ctx_.events.CloseAll();
      server_->Shutdown(std::chrono::system_clock::now() +
                        std::chrono::seconds(ctx_.config.drain_timeout_s));
      server_->Wait();
      server_.reset();
    }
    if (metrics_http_) metrics_http_->Stop();
    admin_.reset();
    decode_.reset();
    ctx_.store.reset();  // closes RocksDB
    spdlog::info("store closed");
  }

  int port() const { return port_; }
  int metrics_port() const { return metrics_http_ ? metrics_http_->port() : 0; }

 private:
  void RegisterProcessMetrics() {
    auto& m = ctx_.metrics;
    m.GetGauge("ctxcache_build_info", "Build information (value 1); version and revision in labels",
               {{"version", CTXCACHE_VERSION}, {"revision", CTXCACHE_GIT_REVISION}})
        ->Set(1);
    m.AddCallbackGauge("ctxcache_uptime_seconds", "Seconds since ctxcached started", [this] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - ctx_.start_time)
          .count();
    });
    m.AddCallbackGauge("ctxcache_contexts", "READY contexts in the store", [this] {
      return static_cast<double>(ctx_.store->GetStats().ready_contexts);
    });
    m.AddCallbackGauge("ctxcache_stored_bytes", "Bytes stored by READY contexts",
                       [this] { return static_cast<double>(ctx_.store->GetStats().stored_bytes); });
    m.AddCallbackCounter(
        "ctxcache_policy_evictions_total", "Contexts evicted by TTL or the capacity watermarks",
        [this] { return static_cast<double>(ctx_.store->GetStats().policy_evictions); });
    m.AddCallbackGauge("ctxcache_block_cache_hit_ratio",
                       "RocksDB block cache hits / (hits + misses) since start", [this] {
                         auto st = ctx_.store->GetStats();
                         uint64_t total = st.block_cache_hits + st.block_cache_misses;
                         return total ? static_cast<double>(st.block_cache_hits) / total : 0.0;
                       });
    m.AddCallbackGauge(
        "ctxcache_block_cache_bytes", "Bytes held by the RocksDB block cache",
        [this] { return static_cast<double>(ctx_.store->GetStats().block_cache_usage_bytes); });
    for (const char* kind : {"meta", "tokens", "pages", "index"}) {
      m.AddCallbackGauge(
          "ctxcache_storage_bytes", "Live SST/blob bytes by kind (RocksDB column family)",
          [this, kind] {
            auto st = ctx_.store->GetStats();
            auto it = st.bytes_by_cf.find(kind);
            return it == st.bytes_by_cf.end() ? 0.0 : static_cast<double>(it->second);
          },
          {{"kind", kind}});
    }
    m.AddCallbackGauge("ctxcache_capacity_bytes", "Capacity budget in bytes (0 = unlimited)",
                       [this] { return static_cast<double>(ctx_.config.capacity_bytes); });
  }

  ServiceContext ctx_;
  std::unique_ptr<AdminServiceImpl> admin_;
  std::unique_ptr<DecodeServiceImpl> decode_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  int port_ = 0;
  bool shut_down_ = false;
};

Server::Server(ServerConfig config) : impl_(std::make_unique<ServerImpl>(std::move(config))) {}
Server::~Server() { impl_->Shutdown(); }
Status Server::Start() { return impl_->Start(); }
int Server::port() const { return impl_->port(); }
int Server::metrics_port() const { return impl_->metrics_port(); }
void Server::Shutdown() { impl_->Shutdown(); }

int RunCtxcached(int argc, char** argv) {
  auto config = ParseServerConfig(argc, argv);
  if (!config.ok()) {
    if (config.status().code() == StatusCode::kCancelled) {  // --help
      std::cout << config.status().message();
      return 0;
    }
    std::fprintf(stderr, "ctxcached: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  if (Status s = InitLogging(config->log_level, "ctxcached"); !s.ok()) {
    std::fprintf(stderr, "ctxcached: %s\n", s.ToString().c_str());
    return 2;
  }
  // Block the termination signals in every thread; the main thread waits
  // for them with sigwait (no async-signal-safety concerns).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  std::fprintf(stderr, "ctxcached %s (%s) effective config:\n%s", CTXCACHE_VERSION,
               CTXCACHE_GIT_REVISION, config->ToToml().c_str());
  Server server(*config);
  if (Status s = server.Start(); !s.ok()) {
    spdlog::error("{}", s.ToString());
    std::fprintf(stderr, "ctxcached: %s\n", s.ToString().c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&sigs, &sig);
  spdlog::info("received {}, shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  server.Shutdown();
  spdlog::info("bye");
  return 0;
}

}  // namespace ctxcache::service
