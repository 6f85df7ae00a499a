#include "service/config.h"

#include <CLI/CLI.hpp>
#include <sstream>

#include "common/version.h"


namespace ctxcache::service {

namespace {

// The store, the models and the listen addresses.
void AddStoreOptions(CLI::App& app, ServerConfig& c) {
  app.add_option("--data-dir", c.data_dir, "RocksDB data directory")->capture_default_str();
  app.add_option("--listen", c.listen, "gRPC listen address HOST:PORT")->capture_default_str();
  app.add_option("--metrics-listen", c.metrics_listen, "Prometheus endpoint HOST:PORT ('' = off)")
      ->capture_default_str();
  app.add_option("--model-dir", c.model_dir, "Directory of HF model directories")
      ->capture_default_str();
  app.add_option("--default-model", c.default_model, "Model used when a request names none")
      ->capture_default_str();
  app.add_option("--port-file", c.port_file, "Write the bound gRPC port to this file");
  app.add_option("--block-cache-mb", c.block_cache_mb, "RocksDB block cache (MiB)")
      ->capture_default_str();
  app.add_option("--capacity-bytes", c.capacity_bytes, "Capacity budget (bytes, 0 = unlimited)")
      ->capture_default_str();
  app.add_option("--high-watermark", c.high_watermark, "Evict above this fraction of capacity")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--low-watermark", c.low_watermark, "Evict down to this fraction of capacity")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--default-ttl-s", c.default_ttl_s, "Default context TTL (s, 0 = none)")
      ->capture_default_str();
}

// Builds: concurrency, queue, default indexes, prefill.
void AddBuildOptions(CLI::App& app, ServerConfig& c) {
  app.add_option("--max-concurrent-builds", c.max_concurrent_builds, "Builds running at once")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--build-queue-size", c.build_queue_size, "Builds allowed to wait")
      ->capture_default_str();
  app.add_option("--default-indexes", c.default_indexes, "Index methods built by default")
      ->capture_default_str();
  app.add_option("--prefill-chunk", c.prefill_chunk, "Prefill chunk size (tokens)")
      ->check(CLI::Range(1u, 65536u))
      ->capture_default_str();
  app.add_option("--max-context-tokens", c.max_context_tokens,
                 "Longest context to build/ingest (0 = the model's max_position_embeddings)")
      ->capture_default_str();
}

// Decode sessions: count, memory, appended tokens, page cache, timeouts.
void AddSessionOptions(CLI::App& app, ServerConfig& c) {
  app.add_option("--max-sessions", c.max_sessions, "Open decode sessions allowed")
      ->capture_default_str();
  app.add_option("--session-memory-mb", c.session_memory_mb,
                 "Memory budget for decode sessions and their loaded indexes, MiB (0 = unlimited)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--max-appended-tokens", c.max_appended_tokens,
                 "Tokens one decode session may append (0 = unlimited)")
      ->capture_default_str();
  app.add_option("--page-cache-mb", c.page_cache_mb,
                 "Decoded-page cache shared by decode sessions, MiB (0 = off)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--session-open-timeout-s", c.session_open_timeout_s,
                 "Cancel Decode streams that open no session within N s")
      ->check(CLI::Range(1u, 3600u))
      ->capture_default_str();
  app.add_option("--session-idle-timeout-s", c.session_idle_timeout_s, "Idle session timeout (s)")
      ->capture_default_str();
}

// gRPC transport: message size, keepalive, drain.
void AddTransportOptions(CLI::App& app, ServerConfig& c) {
  app.add_option("--max-message-bytes", c.max_message_bytes, "gRPC max message size (bytes)")
      ->check(CLI::Range(1u << 20, 1u << 30))
      ->capture_default_str();
  app.add_option("--keepalive-time-s", c.keepalive_time_s, "gRPC keepalive interval (s)")
      ->capture_default_str();
  app.add_option("--drain-timeout-s", c.drain_timeout_s, "Drain time on SIGTERM (s)")
      ->capture_default_str();
}

// Who may connect and how: TLS, API keys, tenants, audit, MapKV, streams.
void AddAccessOptions(CLI::App& app, ServerConfig& c) {
  app.add_option("--tls-cert", c.tls_cert, "TLS certificate chain (PEM)");
  app.add_option("--tls-key", c.tls_key, "TLS private key (PEM)");
  app.add_option("--tls-client-ca", c.tls_client_ca,
                 "Require client certificates from this CA (mTLS)");
  app.add_option("--tls-refresh-s", c.tls_refresh_s, "Re-read changed TLS files every N s")
      ->check(CLI::Range(1u, 3600u))
      ->capture_default_str();
  app.add_option("--keys-file", c.keys_file, "API keys file (enables authentication)");
  app.add_option("--tenants-file", c.tenants_file, "Per-tenant quotas file");
  app.add_option("--id-secret-file", c.id_secret_file,
                 "Secret salting tenant context ids (default <data-dir>/ID_SECRET)");
  app.add_flag("--insecure", c.insecure,
               "Allow a non-loopback --listen without TLS and API keys (not recommended)");
  app.add_option("--reflection", c.reflection, "Serve gRPC server reflection (true|false)")
      ->capture_default_str();
  app.add_option("--audit-log", c.audit_log, "Audit log file ('' = the server log)");
  app.add_option("--metrics-token-file", c.metrics_token_file,
                 "Bearer token the metrics endpoint requires");
  app.add_option("--shm-socket", c.shm_socket,
                 "Unix socket for MapKV's shared-memory segments ('' = <data-dir>/shm.sock, "
                 "off = no MapKV)");
  app.add_option("--shm-cache-mb", c.shm_cache_mb,
                 "Host memory (MiB) keeping filled MapKV segments for the next MapKV of the "
                 "same context and layers (0 = none)")
      ->capture_default_str();
  app.add_option("--max-streams-per-connection", c.max_streams_per_connection,
                 "Streaming calls one client connection may have open; the one past it "
                 "fails with RESOURCE_EXHAUSTED")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
}

// Cluster membership and replication (docs/cluster.md).
void AddClusterOptions(CLI::App& app, ServerConfig& c) {
  app.add_option("--cluster", c.cluster,
                 "Join the etcd cluster etcd://host:port[,host:port...]/<name> (docs/cluster.md)");
  app.add_option("--node-id", c.node_id, "Node id in the cluster (default <hostname>-<port>)");
  app.add_option("--advertise-addr", c.advertise_addr,
                 "HOST:PORT peers and clients dial (default the listen address)");
  app.add_option("--zone", c.zone, "Failure domain (owners spread across zones)");
  app.add_option("--replicas", c.replicas, "Copies per context (R)")
      ->check(CLI::Range(1u, 16u))
      ->capture_default_str();
  app.add_option("--min-replicas", c.min_replicas,
                 "Durable copies before READY is returned (0 = --replicas)")
      ->check(CLI::Range(0u, 16u))
      ->capture_default_str();
  app.add_option("--etcd-lease-ttl-s", c.etcd_lease_ttl_s, "etcd lease TTL (s)")
      ->check(CLI::Range(2u, 300u))
      ->capture_default_str();
  app.add_option("--cluster-key-file", c.cluster_key_file,
                 "API key (operator role) this node presents to its peers");
}

// Fault injection for tests, hidden from --help.
void AddTestingFaults(CLI::App& app, ServerConfig& c) {
  app.add_flag("--fault-corrupt-pages-for-testing", c.fault_corrupt_pages,
               "TESTING ONLY: corrupt every page sent (clients must report DATA_LOSS)")
      ->group("");
  app.add_option("--fault-throw-in-rpc-for-testing", c.fault_throw_in_rpc,
                 "TESTING ONLY: this RPC's handler throws (must become INTERNAL)")
      ->group("");
  app.add_option("--fault-slow-open-ms-for-testing", c.fault_slow_open_ms,
                 "TESTING ONLY: every session Open sleeps this long first")
      ->group("");
}

// The flags that only make sense together. InvalidArgument naming them.
Status CheckFlagCombinations(const ServerConfig& c) {
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return InvalidArgumentError("--tls-cert and --tls-key go together: give both or neither");
  }
  if (!c.tls_client_ca.empty() && c.tls_cert.empty()) {
    return InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS)");
  }
  if (c.min_replicas > c.replicas) {
    return InvalidArgumentError("--min-replicas must be <= --replicas");
  }
  if (c.cluster.empty() && (!c.node_id.empty() || !c.advertise_addr.empty() ||
                            !c.cluster_key_file.empty())) {
    return InvalidArgumentError(
        "--node-id, --advertise-addr and --cluster-key-file need --cluster");
  }
  if (!c.cluster.empty() && !c.keys_file.empty() && c.cluster_key_file.empty()) {
    return InvalidArgumentError(
        "--cluster with --keys-file needs --cluster-key-file (an operator key the nodes present "
        "to each other)");
  }
  if (c.low_watermark > c.high_watermark) {
    return InvalidArgumentError("--low-watermark must be <= --high-watermark");
  }
  if (c.shm_cache_mb > 0 && c.shm_socket == "off") {
    return InvalidArgumentError("--shm-cache-mb " + std::to_string(c.shm_cache_mb) +
                                " keeps MapKV segments, and --shm-socket off turns MapKV off: "
                                "give --shm-cache-mb 0 or a socket");
  }
  return Status::OK();
}

}  // namespace

std::string ServerConfig::ToToml() const {
  std::ostringstream os;
  auto q = [](const std::string& s) { return "\"" + s + "\""; };
  os << "data-dir = " << q(data_dir) << "\n"
     << "listen = " << q(listen) << "\n"
     << "metrics-listen = " << q(metrics_listen) << "\n"
     << "model-dir = " << q(model_dir) << "\n"
     << "default-model = " << q(default_model) << "\n"
     << "block-cache-mb = " << block_cache_mb << "\n"
     << "capacity-bytes = " << capacity_bytes << "\n"
     << "high-watermark = " << high_watermark << "\n"
     << "low-watermark = " << low_watermark << "\n"
     << "default-ttl-s = " << default_ttl_s << "\n"
     << "max-concurrent-builds = " << max_concurrent_builds << "\n"
     << "build-queue-size = " << build_queue_size << "\n"
     << "default-indexes = " << q(default_indexes) << "\n"
     << "prefill-chunk = " << prefill_chunk << "\n"
     << "max-context-tokens = " << max_context_tokens << "\n"
     << "max-sessions = " << max_sessions << "\n"
     << "session-memory-mb = " << session_memory_mb << "\n"
     << "max-appended-tokens = " << max_appended_tokens << "\n"
     << "page-cache-mb = " << page_cache_mb << "\n"
     << "session-idle-timeout-s = " << session_idle_timeout_s << "\n"
     << "session-open-timeout-s = " << session_open_timeout_s << "\n"
     << "max-message-bytes = " << max_message_bytes << "\n"
     << "keepalive-time-s = " << keepalive_time_s << "\n"
     << "drain-timeout-s = " << drain_timeout_s << "\n"
     << "tls-cert = " << q(tls_cert) << "\n"
     << "tls-key = " << q(tls_key) << "\n"
     << "tls-client-ca = " << q(tls_client_ca) << "\n"
     << "tls-refresh-s = " << tls_refresh_s << "\n"
     << "keys-file = " << q(keys_file) << "\n"
     << "tenants-file = " << q(tenants_file) << "\n"
     << "id-secret-file = " << q(id_secret_file) << "\n"
     << "insecure = " << (insecure ? "true" : "false") << "\n"
     << "reflection = " << (reflection ? "true" : "false") << "\n"
     << "audit-log = " << q(audit_log) << "\n"
     << "metrics-token-file = " << q(metrics_token_file) << "\n"
     << "max-streams-per-connection = " << max_streams_per_connection << "\n"
     << "shm-socket = " << q(shm_socket) << "\n"
     << "shm-cache-mb = " << shm_cache_mb << "\n"
     << "cluster = " << q(cluster) << "\n"
     << "node-id = " << q(node_id) << "\n"
     << "advertise-addr = " << q(advertise_addr) << "\n"
     << "zone = " << q(zone) << "\n"
     << "replicas = " << replicas << "\n"
     << "min-replicas = " << min_replicas << "\n"
     << "etcd-lease-ttl-s = " << etcd_lease_ttl_s << "\n"
     << "cluster-key-file = " << q(cluster_key_file) << "\n"
     << "log-level = " << q(log_level) << "\n";
  return os.str();
}

StatusOr<ServerConfig> ParseServerConfig(int argc, char** argv) {
  ServerConfig c;
  CLI::App app{"ctxcached: persistent context-cache server (gRPC + RocksDB)", "ctxcached"};
  app.set_config("--config", "", "Read options from a TOML/INI file (flags override it)");
  app.set_version_flag("--version", VersionString("ctxcached"), "Print the version and exit");
  AddStoreOptions(app, c);
  AddBuildOptions(app, c);
  AddSessionOptions(app, c);
  AddTransportOptions(app, c);
  AddAccessOptions(app, c);
  AddClusterOptions(app, c);
  app.add_option("--log-level", c.log_level, "trace|debug|info|warn|error|off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();
  AddTestingFaults(app, c);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return CancelledError(app.help());
  } catch (const CLI::CallForVersion& v) {
    return CancelledError(std::string(v.what()) + "\n");
  } catch (const CLI::ParseError& e) {
    return InvalidArgumentError(std::string(e.what()) + "; run ctxcached --help for the options");
  }
  RETURN_IF_ERROR(CheckFlagCombinations(c));
  return c;
}

}  // namespace ctxcache::service
