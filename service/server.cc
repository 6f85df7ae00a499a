#include "service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <signal.h>
#include <unistd.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <cctype>

#include "common/logging.h"
#include "common/version.h"
#include "grpc/health/v1/health.pb.h"
#include "service/access.h"
#include "service/admin_service.h"
#include "service/cluster_service.h"
#include "service/decode_service.h"
#include "service/metrics.h"
#include "service/process_metrics.h"
#include "service/service_context.h"
#include "storage/store.h"


namespace ctxcache::service {

namespace {

std::string ReadSmallFile(const std::string& path, Status* error, const char* flag) {
  std::ifstream f(path);
  if (!f) {
    *error = InvalidArgumentError(std::string(flag) + ": cannot read '" + path + "'");
    return "";
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The file's text without trailing whitespace (a key or token file).
StatusOr<std::string> ReadSecretFile(const std::string& path, const char* flag) {
  Status err;
  std::string text = ReadSmallFile(path, &err, flag);
  if (!err.ok()) return err;
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return text;
}

// The metrics endpoint's bearer token from --metrics-token-file ("" when
// the flag is empty): InvalidArgument when unreadable or shorter than 16.
StatusOr<std::string> ReadMetricsToken(const std::string& path) {
  if (path.empty()) return std::string();
  ASSIGN_OR_RETURN(std::string token, ReadSecretFile(path, "--metrics-token-file"));
  if (token.size() < 16) {
    return InvalidArgumentError("--metrics-token-file: the token must have >= 16 characters");
  }
  return token;
}

// The PEM files must exist and look like PEM before gRPC's watcher takes
// over (it only logs what it cannot read).
Status CheckPem(const std::string& path, const char* flag, const char* what) {
  if (path.empty()) return Status::OK();
  Status err;
  std::string text = ReadSmallFile(path, &err, flag);
  if (!err.ok()) return err;
  if (text.find("-----BEGIN ") == std::string::npos || text.find(what) == std::string::npos) {
    return InvalidArgumentError(std::string(flag) + ": '" + path + "' holds no PEM " + what);
  }
  return Status::OK();
}

// Linking grpc++_reflection registers its plugin with every ServerBuilder at
// static initialisation (gRPC 1.51), so a server serves reflection unless the
// plugin is removed from its builder: this option does that.
class WithoutReflectionOption : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    using grpc::reflection::ProtoServerReflectionPlugin;
    auto is_reflection = [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return dynamic_cast<ProtoServerReflectionPlugin*>(p.get()) != nullptr;
    };
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(), is_reflection),
                   plugins->end());
  }
};

}  // namespace

bool IsLoopbackListen(const std::string& listen) {
  if (listen.rfind("unix:", 0) == 0) return true;
  std::string host = listen;
  auto colon = listen.rfind(':');
  if (colon != std::string::npos) host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

class ServerImpl {
 public:
  explicit ServerImpl(ServerConfig config) : ctx_(std::move(config)) {}

  Status Start() {
    const ServerConfig& c = ctx_.config;
    ctx_.start_time = std::chrono::steady_clock::now();
    // Open the store first: a second ctxcached on the same dir must fail
    // before it touches any port.
    RETURN_IF_ERROR(OpenStore());
    RETURN_IF_ERROR(CheckListenIsGuarded());
    RETURN_IF_ERROR(OpenAccessControl());
    ASSIGN_OR_RETURN(const std::string metrics_token, ReadMetricsToken(c.metrics_token_file));

    RegisterServerMetrics();
    RETURN_IF_ERROR(StartShmBroker());

    admin_ = std::make_unique<AdminServiceImpl>(&ctx_);
    decode_ = std::make_unique<DecodeServiceImpl>(&ctx_);
    cluster_ = std::make_unique<ClusterServiceImpl>(&ctx_);
    if (!c.cluster.empty()) {
      if (Status s = StartCluster(); !s.ok()) return s;
      RegisterClusterMetrics();
    }
    RETURN_IF_ERROR(StartGrpc());

    if (!c.metrics_listen.empty()) {
      metrics_http_ = std::make_unique<MetricsHttpServer>(&ctx_.metrics);
      Status s = metrics_http_->Start(c.metrics_listen, metrics_token);
      if (!s.ok()) {
        Shutdown();
        return s;
      }
    }
    WritePortFile();
    LogServing(metrics_token);
    return Status::OK();
  }

  // SIGHUP: re-read the keys and tenants files now, and check the TLS files
  // (gRPC's watcher swaps them in within --tls-refresh-s).
  void Reload() {
    if (!ctx_.access) return;
    Status s = ctx_.access->Reload();
    if (!s.ok())
      spdlog::error("reload: {}; the previous configuration stays in force", s.ToString());
    ApplyTenantShares();
    const ServerConfig& c = ctx_.config;
    for (Status t : {CheckPem(c.tls_cert, "--tls-cert", "CERTIFICATE"),
                     CheckPem(c.tls_key, "--tls-key", "PRIVATE KEY"),
                     CheckPem(c.tls_client_ca, "--tls-client-ca", "CERTIFICATE")}) {
      if (!t.ok()) spdlog::error("reload: {}", t.ToString());
    }
    if (!c.tls_cert.empty()) {
      spdlog::info("reload: TLS files are picked up within {} s (--tls-refresh-s)",
                   c.tls_refresh_s);
    }
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
    if (ctx_.cluster) ctx_.cluster->Stop();  // leaves the cluster (revokes its lease)
    admin_.reset();
    decode_.reset();
    cluster_.reset();
    ctx_.shm.reset();
    ctx_.shm_cache.reset();
    ctx_.cluster.reset();
    ctx_.store.reset();  // closes RocksDB
    spdlog::info("store closed");
  }

  int port() const { return port_; }
  int metrics_port() const { return metrics_http_ ? metrics_http_->port() : 0; }

 private:
  // Opens --data-dir into ctx_.store; a locked dir names the other process.
  Status OpenStore() {
    const ServerConfig& c = ctx_.config;
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
    return Status::OK();
  }

  // Safe defaults: without TLS and keys, loopback only (unless --insecure).
  Status CheckListenIsGuarded() const {
    const ServerConfig& c = ctx_.config;
    const bool secured = !c.tls_cert.empty() && !c.keys_file.empty();
    if (!secured && !IsLoopbackListen(c.listen)) {
      if (!c.insecure) {
        return FailedPreconditionError(
            "--listen " + c.listen +
            " is not a loopback address, and the server has no TLS (--tls-cert/--tls-key) and "
            "no API keys (--keys-file): anyone who reaches the port could read every context. "
            "Configure both (docs/security.md), listen on 127.0.0.1, or pass --insecure");
      }
      spdlog::warn("--insecure: serving {} without {}; any client that reaches it can read, "
                   "build and evict every context",
                   c.listen,
                   c.tls_cert.empty() && c.keys_file.empty() ? "TLS or API keys"
                   : c.tls_cert.empty()                       ? "TLS"
                                                              : "API keys");
    }
    return Status::OK();
  }

  // The TLS files, the access control (keys, tenants), the tenant quotas
  // and shares, and the audit log.
  Status OpenAccessControl() {
    const ServerConfig& c = ctx_.config;
    RETURN_IF_ERROR(CheckPem(c.tls_cert, "--tls-cert", "CERTIFICATE"));
    RETURN_IF_ERROR(CheckPem(c.tls_key, "--tls-key", "PRIVATE KEY"));
    RETURN_IF_ERROR(CheckPem(c.tls_client_ca, "--tls-client-ca", "CERTIFICATE"));
    auto access = AccessControl::Create(c);
    if (!access.ok()) return access.status();
    ctx_.access = std::move(access).value();
    ctx_.quotas =
        std::make_unique<TenantQuotas>(ctx_.access.get(), ctx_.store.get(), &ctx_.metrics);
    ApplyTenantShares();
    return OpenAuditLog();
  }

  // MapKV's broker on --shm-socket; a default path that fails only warns.
  Status StartShmBroker() {
    const ServerConfig& c = ctx_.config;
    if (c.shm_socket != "off") {
      const std::string path =
          c.shm_socket.empty() ? c.data_dir + "/shm.sock" : c.shm_socket;
      auto broker = ShmBroker::Start(path);
      if (!broker.ok()) {
        if (!c.shm_socket.empty()) return broker.status();
        spdlog::warn("MapKV off: {} (set --shm-socket to a shorter path)",
                     broker.status().ToString());
      } else {
        ctx_.shm = std::move(*broker);
        if (c.shm_cache_mb > 0) {
          ctx_.shm_cache = std::make_unique<ShmCache>(c.shm_cache_mb << 20);
          ctx_.metrics.AddCallbackGauge(
              "ctxcache_shm_cache_bytes", "Bytes of MapKV segments kept by --shm-cache-mb",
              [this] { return ctx_.shm_cache ? double(ctx_.shm_cache->bytes()) : 0.0; });
        }
      }
    }
    return Status::OK();
  }

  // Builds and starts the gRPC server on --listen with the three services,
  // health (and reflection unless --reflection false); sets port_.
  Status StartGrpc() {
    const ServerConfig& c = ctx_.config;
    grpc::EnableDefaultHealthCheckService(true);
    // Reflection describes services from protobuf's generated pool; gRPC's
    // health service is built on upb, so health.proto's C++ descriptors are
    // linked in (and referenced here, so the linker keeps them).
    const google::protobuf::Descriptor* health_descriptor =
        grpc::health::v1::HealthCheckRequest::descriptor();
    (void)health_descriptor;
    if (c.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    if (!c.reflection) builder.SetOption(std::make_unique<WithoutReflectionOption>());
    int bound_port = 0;
    builder.AddListeningPort(c.listen, ServerCredentials(), &bound_port);
    // Streaming calls are counted per connection by ConnectionStreams, which
    // refuses the one past the limit; HTTP/2 only caps the sum with unary calls.
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONCURRENT_STREAMS,
        static_cast<int>(std::min<uint64_t>(
            uint64_t{c.max_streams_per_connection} + kUnaryStreamHeadroom, INT32_MAX)));
    builder.SetMaxReceiveMessageSize(static_cast<int>(c.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(c.max_message_bytes));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                               static_cast<int>(c.keepalive_time_s) * 1000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.RegisterService(admin_.get());
    builder.RegisterService(decode_.get());
    builder.RegisterService(cluster_.get());
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
    health->SetServingStatus("ctxcache.v1.ClusterService", true);
    health->SetServingStatus(kPrefillHealthService, CheckModelDir());
    return Status::OK();
  }

  void WritePortFile() const {
    const ServerConfig& c = ctx_.config;
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
  }

  void LogServing(const std::string& metrics_token) const {
    const ServerConfig& c = ctx_.config;
    std::string services =
        "ctxcache.v1.ContextAdmin, ctxcache.v1.DecodeService, ctxcache.v1.ClusterService, "
        "grpc.health.v1.Health";
    if (c.reflection) services += ", grpc.reflection.v1alpha.ServerReflection";
    spdlog::info(
        "serving gRPC on port {} ({}) over {}{}; "
        "authentication {}; metrics on {}{}; MapKV segments on {}",
        port_, services, c.tls_cert.empty() ? "plaintext" : "TLS",
        c.tls_client_ca.empty() ? "" : " with client certificates (mTLS)",
        ctx_.access->enabled() ? "required (keys file " + c.keys_file + ")" : "off",
        metrics_http_ ? std::to_string(metrics_http_->port()) : "(off)",
        metrics_token.empty() ? "" : " (bearer token required)",
        ctx_.shm ? ctx_.shm->path() : std::string("(off)"));
  }

  // Whether --default-model is hosted, so builds from text or token ids can
  // run; warns otherwise. Sessions, reads and ingests need no model, so the
  // server still serves: only the kPrefillHealthService status says so.
  bool CheckModelDir() const {
    const ServerConfig& c = ctx_.config;
    std::error_code ec;
    const std::string where =
        std::filesystem::absolute(c.model_dir, ec).lexically_normal().string();
    const char* consequence =
        "builds from text or token ids fail with NOT_FOUND; sessions, reads and ingests work. "
        "Pass --model-dir with an absolute path (docs/api.md, \"Health\")";
    if (!std::filesystem::is_directory(c.model_dir, ec)) {
      spdlog::warn("--model-dir '{}' ({}) is not a directory: {}", c.model_dir, where,
                   consequence);
      return false;
    }
    const std::vector<std::string> models = ctx_.models.Available();
    if (models.empty()) {
      spdlog::warn("--model-dir '{}' ({}) holds no model (no <name>/config.json): {}",
                   c.model_dir, where, consequence);
      return false;
    }
    std::string names;
    for (const auto& m : models) names += (names.empty() ? "" : ", ") + m;
    if (!ctx_.models.IsHosted(c.default_model)) {
      spdlog::warn("--default-model '{}' is not in --model-dir '{}' ({}; holds {}): builds that "
                   "name no model fail with NOT_FOUND",
                   c.default_model, c.model_dir, where, names);
      return false;
    }
    spdlog::info("models in {}: {} (default {})", where, names, c.default_model);
    return true;
  }

  // Joins the --cluster (before serving: handlers read ctx_.cluster).
  Status StartCluster() {
    const ServerConfig& c = ctx_.config;
    ASSIGN_OR_RETURN(auto uri, cluster::ParseClusterUri(c.cluster));
    cluster::ClusterOptions o;
    o.uri = uri;
    std::string listen_port = c.listen.substr(c.listen.rfind(':') + 1);
    o.advertise_addr = c.advertise_addr.empty() ? c.listen : c.advertise_addr;
    if (c.advertise_addr.empty() && listen_port == "0") {
      return InvalidArgumentError(
          "--cluster needs a fixed --listen port or an --advertise-addr (peers and clients dial "
          "the advertised address)");
    }
    if (c.node_id.empty()) {
      char host[256] = {0};
      gethostname(host, sizeof(host) - 1);
      o.node_id = std::string(host).append("-").append(
          o.advertise_addr.substr(o.advertise_addr.rfind(':') + 1));
    } else {
      o.node_id = c.node_id;
    }
    o.zone = c.zone;
    if (c.zone.empty() && c.replicas > 1) {
      spdlog::warn("--zone is empty: a context's {} copies are placed without failure domains "
                   "(pass --zone; on Kubernetes, ctxcache-config's zone key, docs/deploy.md)",
                   c.replicas);
    }
    o.capacity_bytes = c.capacity_bytes;
    o.replicas = c.replicas;
    o.min_replicas = c.min_replicas == 0 ? c.replicas : c.min_replicas;
    o.lease_ttl_s = c.etcd_lease_ttl_s;
    o.peer.max_message_bytes = c.max_message_bytes;
    if (!c.cluster_key_file.empty()) {
      ASSIGN_OR_RETURN(o.peer.cluster_key,
                       ReadSecretFile(c.cluster_key_file, "--cluster-key-file"));
      if (o.peer.cluster_key.empty()) return InvalidArgumentError("--cluster-key-file: empty");
      RETURN_IF_ERROR(ctx_.access->CheckPeerKey(o.peer.cluster_key, "--cluster-key-file"));
    }
    Status err;
    if (!c.tls_cert.empty()) {
      // Peers are verified against --tls-client-ca when set (the CA of the
      // node certificates), else against this node's own certificate.
      o.peer.tls_root_ca = ReadSmallFile(c.tls_client_ca.empty() ? c.tls_cert : c.tls_client_ca,
                                         &err, "--tls-client-ca");
      if (!err.ok()) return err;
      o.peer.tls_cert = ReadSmallFile(c.tls_cert, &err, "--tls-cert");
      if (!err.ok()) return err;
      o.peer.tls_key = ReadSmallFile(c.tls_key, &err, "--tls-key");
      if (!err.ok()) return err;
    }
    auto node = cluster::ClusterNode::Start(std::move(o), ctx_.store.get());
    if (!node.ok()) return node.status().WithContext("--cluster " + c.cluster);
    ctx_.cluster = std::move(node).value();
    return Status::OK();
  }

  void RegisterClusterMetrics() {
    auto& m = ctx_.metrics;
    cluster::ClusterNode* n = ctx_.cluster.get();
    m.AddCallbackGauge("ctxcache_cluster_nodes", "Live cluster nodes seen in etcd",
                       [n] { return static_cast<double>(n->GetStats().live_nodes); });
    m.AddCallbackGauge("ctxcache_cluster_owned_contexts",
                       "Contexts this node owns (rendezvous placement over live nodes)",
                       [n] { return static_cast<double>(n->GetStats().owned_contexts); });
    m.AddCallbackGauge("ctxcache_replication_lag_contexts",
                       "Contexts this node owns with fewer than --replicas live copies",
                       [n] { return static_cast<double>(n->GetStats().lag_contexts); });
    m.AddCallbackCounter("ctxcache_replication_bytes_total",
                         "Context bytes copied into this node from peers",
                         [n] { return static_cast<double>(n->GetStats().replication_bytes); });
    m.AddCallbackCounter("ctxcache_replication_errors_total",
                         "Failed context copies started or served by this node",
                         [n] { return static_cast<double>(n->GetStats().replication_errors); });
  }

  void RegisterServerMetrics() {
    auto& m = ctx_.metrics;
    m.GetGauge("ctxcache_build_info", "Build information (value 1); version and revision in labels",
               {{"version", std::string(Version())}, {"revision", std::string(GitRevision())}})
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
    // Counters, not a ratio since start: PromQL takes the ratio over any window.
    m.AddCallbackCounter(
        "ctxcache_block_cache_hits_total", "RocksDB block cache hits",
        [this] { return static_cast<double>(ctx_.store->GetStats().block_cache_hits); });
    m.AddCallbackCounter(
        "ctxcache_block_cache_misses_total", "RocksDB block cache misses",
        [this] { return static_cast<double>(ctx_.store->GetStats().block_cache_misses); });
    // Exported from the start (0), not from the first EvictContext.
    m.GetCounter("ctxcache_evictions_total", kEvictionsHelp);
    RegisterProcessMetrics(&m);
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

  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() {
    const ServerConfig& c = ctx_.config;
    if (c.tls_cert.empty()) return grpc::InsecureServerCredentials();
    // The watcher re-reads the files every tls_refresh_s: a renewed
    // certificate takes effect for new handshakes, existing connections
    // (and their sessions) stay up.
    cert_provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        c.tls_key, c.tls_cert, c.tls_client_ca, c.tls_refresh_s);
    grpc::experimental::TlsServerCredentialsOptions opts(cert_provider_);
    opts.watch_identity_key_cert_pairs();
    if (!c.tls_client_ca.empty()) {
      opts.watch_root_certs();
      opts.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    } else {
      opts.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    }
    return grpc::experimental::TlsServerCredentials(opts);
  }

  // Fair capacity eviction: each tenant's byte quota is its share.
  void ApplyTenantShares() {
    auto t = ctx_.access->tenants();
    std::map<std::string, uint64_t> shares;
    for (const auto& [name, q] : t->tenants) {
      if (q.max_stored_bytes) shares[name] = q.max_stored_bytes;
    }
    ctx_.store->SetTenantShares(std::move(shares), t->defaults.max_stored_bytes);
  }

  Status OpenAuditLog() {
    const std::string& path = ctx_.config.audit_log;
    const std::string name = "audit-" + std::to_string(reinterpret_cast<uintptr_t>(this));
    try {
      if (path.empty()) {
        auto def = spdlog::default_logger();
        ctx_.audit = std::make_shared<spdlog::logger>("audit", def->sinks().begin(),
                                                      def->sinks().end());
      } else {
        auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path);
        ctx_.audit = std::make_shared<spdlog::logger>(name, sink);
        ctx_.audit->set_pattern("%v");
        ctx_.audit->flush_on(spdlog::level::info);
      }
      ctx_.audit->set_level(spdlog::level::info);
    } catch (const std::exception& e) {
      return InvalidArgumentError("--audit-log '" + path + "': " + e.what());
    }
    return Status::OK();
  }

  ServiceContext ctx_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> cert_provider_;
  std::unique_ptr<AdminServiceImpl> admin_;
  std::unique_ptr<DecodeServiceImpl> decode_;
  std::unique_ptr<ClusterServiceImpl> cluster_;
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
void Server::Reload() { impl_->Reload(); }

int RunCtxcached(int argc, char** argv) {
  auto config = ParseServerConfig(argc, argv);
  if (!config.ok()) {
    if (config.status().code() == StatusCode::kCancelled) {  // --help, --version
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
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  std::fprintf(stderr, "ctxcached %s (%s) effective config:\n%s",
               std::string(Version()).c_str(), std::string(GitRevision()).c_str(),
               config->ToToml().c_str());
  Server server(*config);
  if (Status s = server.Start(); !s.ok()) {
    spdlog::error("{}", s.ToString());
    std::fprintf(stderr, "ctxcached: %s\n", s.ToString().c_str());
    return 1;
  }
  int sig = 0;
  for (;;) {
    sigwait(&sigs, &sig);
    if (sig != SIGHUP) break;
    spdlog::info("received SIGHUP: reloading keys, tenants and TLS files");
    server.Reload();
  }
  spdlog::info("received {}, shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  server.Shutdown();
  spdlog::info("bye");
  return 0;
}

}  // namespace ctxcache::service
