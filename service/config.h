// ctxcached configuration: every knob with its default, parsed from flags
// and an optional TOML/INI file (--config FILE; flags override the file).
//
// Thread-safety: a plain value; copy it freely.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "index/methods.h"

namespace ctxcache::service {

// HTTP/2 streams a connection may open beyond max_streams_per_connection,
// for unary calls (server.cc advertises the sum as MAX_CONCURRENT_STREAMS).
inline constexpr uint32_t kUnaryStreamHeadroom = 64;

struct ServerConfig {
  // --- Addresses and paths ---
  // RocksDB data directory; created if missing. Default: ./ctxcache-data
  std::string data_dir = "./ctxcache-data";
  // gRPC listen address. Port 0 picks a free port (printed at start).
  std::string listen = "127.0.0.1:7700";
  // Prometheus text endpoint (GET /metrics). "" disables it.
  std::string metrics_listen = "127.0.0.1:7701";
  // Directory holding one HF model directory per model (models/<name>/).
  std::string model_dir = "./models";
  // Model used when a request names none.
  std::string default_model = "ctxcache-ref";
  // Unix socket that hands MapKV's shared-memory segments to workers on
  // this host (service/shm_broker.h). "" = <data_dir>/shm.sock; "off"
  // disables MapKV. Default: "".
  std::string shm_socket;
  // Host memory, MiB, that keeps filled MapKV segments for later MapKV calls
  // of the same context and layers (service/shm_cache.h), least recently
  // used out first; 0 = every MapKV fills a segment of its own. Default: 0
  uint64_t shm_cache_mb = 0;
  // If non-empty, once serving, write the bound gRPC port (line 1) and
  // metrics port (line 2) here (for scripts and tests).
  std::string port_file;

  // --- Storage ---
  // RocksDB block cache, MiB.
  uint64_t block_cache_mb = 256;
  // Capacity budget for stored contexts, bytes; 0 = unlimited.
  uint64_t capacity_bytes = 0;
  // Eviction starts above high_watermark * capacity and stops below low.
  double high_watermark = 0.95;
  double low_watermark = 0.85;
  // TTL applied to contexts built without one, seconds; 0 = none.
  int64_t default_ttl_s = 0;

  // --- Builds ---
  // Builds running at once.
  uint32_t max_concurrent_builds = 1;
  // Builds waiting in the queue; beyond this BuildContext is RESOURCE_EXHAUSTED.
  uint32_t build_queue_size = 8;
  // Index methods built by default (comma-separated).
  std::string default_indexes = std::string(index::kDefaultMethod);
  // Prefill chunk size, tokens.
  uint32_t prefill_chunk = 512;

  // Longest context a build, extend or ingest may have, tokens. 0 = the
  // model's max_position_embeddings (for ingests of models not hosted here:
  // 1,048,576). A value > 0 replaces the model's limit (it may raise it:
  // the operator's call). Default: 0.
  uint64_t max_context_tokens = 0;

  // --- Sessions ---
  // Open decode sessions, all clients together; an Open past it is
  // RESOURCE_EXHAUSTED. Default: 256 (= max_streams_per_connection).
  uint32_t max_sessions = 256;
  // Budget for decode-session memory, MiB: the loaded index tables (once
  // per context and method, shared by its sessions) plus every session's
  // own state (appended tokens, overlays, schedules). An Open or Append past
  // it is RESOURCE_EXHAUSTED with the numbers. 0 = unlimited. Default: 4096.
  uint64_t session_memory_mb = 4096;
  // Tokens one session may append (a session may ask for fewer with the
  // Open param max_appended_tokens); the next Append is
  // FAILED_PRECONDITION. 0 = unlimited. Default: 8192.
  uint64_t max_appended_tokens = 8192;
  // Decoded-page cache shared by all sessions (exact-scoring methods
  // gather the same stored keys each step), MiB, LRU. 0 disables it.
  // Default: 256.
  uint64_t page_cache_mb = 256;
  // A session with no message for this long is closed, seconds.
  uint32_t session_idle_timeout_s = 300;
  // A Decode stream that has not opened a session this long after it
  // started is cancelled (it holds a server thread), seconds. Default: 10.
  uint32_t session_open_timeout_s = 10;

  // --- gRPC ---
  // Max message size sent and received, bytes.
  uint32_t max_message_bytes = 8 << 20;
  // Keepalive ping interval, seconds.
  uint32_t keepalive_time_s = 60;
  // Seconds to wait for in-flight RPCs on SIGTERM before cancelling them.
  uint32_t drain_timeout_s = 5;

  // --- Security (docs/security.md) ---
  // TLS server certificate chain and private key (PEM). Both or neither.
  // Re-read when the files change (every tls_refresh_s) without dropping
  // connections or sessions. Default: "" (plaintext).
  std::string tls_cert;
  std::string tls_key;
  // CA bundle (PEM) that client certificates must chain to; set = mTLS
  // required. Default: "" (no client certificates).
  std::string tls_client_ca;
  // How often gRPC's certificate watcher re-reads the TLS files, seconds.
  // Default: 5.
  uint32_t tls_refresh_s = 5;
  // API keys and mTLS subject mappings (auth/keys_file.h); set = every
  // ContextAdmin and DecodeService call must authenticate. Re-read when it
  // changes and on SIGHUP. Default: "" (no authentication: loopback only).
  std::string keys_file;
  // Per-tenant quotas (auth/tenants.h). Re-read on SIGHUP. Default: "" (none).
  std::string tenants_file;
  // 32-byte secret that salts tenant context ids; created on first start.
  // Every node of a cluster must share it. Default: "" = <data_dir>/ID_SECRET.
  std::string id_secret_file;
  // Allow a non-loopback --listen without TLS and keys (logs a warning).
  // Default: false.
  bool insecure = false;
  // Serve gRPC server reflection. Default: true.
  bool reflection = true;
  // One JSON line per ContextAdmin call that changes state (who, tenant,
  // what, context, result): "" = the server log (logger "audit"), else a
  // file appended to. Default: "".
  std::string audit_log;
  // File holding a bearer token the metrics endpoint requires
  // ("Authorization: Bearer <token>"). Default: "" (open).
  std::string metrics_token_file;
  // Streaming calls (Decode, FetchKV, Watch, ...) one client connection may
  // have open at once; the one past it fails with RESOURCE_EXHAUSTED. HTTP/2
  // MAX_CONCURRENT_STREAMS is advertised as this plus kUnaryStreamHeadroom,
  // so unary calls still pass, and a stream past the limit reaches the
  // server and is refused instead of waiting in the client. Equal to
  // max_sessions by default: one worker's channel can hold every session.
  // Default: 256.
  uint32_t max_streams_per_connection = 256;

  // --- Cluster (docs/cluster.md) ---
  // etcd://host:port[,host:port...]/<cluster-name>; "" = a single node, no
  // cluster code runs. Default: "".
  std::string cluster;
  // This node's id in the cluster. Default: "" = <hostname>-<listen port>.
  std::string node_id;
  // host:port other nodes and clients dial. Default: "" = the listen
  // address (with the bound port when --listen has port 0).
  std::string advertise_addr;
  // Failure domain; a context's owners spread across zones first. Default: "".
  std::string zone;
  // Owners (copies) per context, R. Default: 2.
  uint32_t replicas = 2;
  // A build/ingest/extend reports READY once this many durable copies
  // exist. Default: 0 = replicas.
  uint32_t min_replicas = 0;
  // etcd lease TTL: a node silent this long leaves the cluster, seconds.
  // Default: 10.
  uint32_t etcd_lease_ttl_s = 10;
  // File holding the API key (operator role, `ctxcache keys create`) this node
  // presents to its peers. Required when --keys-file is set. Default: "".
  std::string cluster_key_file;

  // --- Testing ---
  // Flips one bit of every page payload sent (after its crc32c is computed),
  // so tests can prove clients detect corruption. Never set in production.
  bool fault_corrupt_pages = false;
  // Makes the named RPC throw from its handler, so tests can prove no
  // exception escapes a handler. Never set in production.
  std::string fault_throw_in_rpc;
  // Sleeps this long in every session Open before loading the session, so
  // tests can stand in for a slow index load. Never set in production.
  int fault_slow_open_ms = 0;

  // --- Logging ---
  // trace|debug|info|warn|error|off
  std::string log_level = "info";

  // The effective configuration as TOML (printed at start).
  std::string ToToml() const;
};

// Parses argv (and --config FILE if given). On --help or --version returns
// a CANCELLED status whose message is the text to print (the help, or
// ctxcache::VersionString("ctxcached"), common/version.h).
StatusOr<ServerConfig> ParseServerConfig(int argc, char** argv);

}  // namespace ctxcache::service
