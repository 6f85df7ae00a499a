// State shared by the gRPC service implementations of one ctxcached.
// Internal to service/.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>

#include <spdlog/logger.h>

#include "cluster/cluster_node.h"
#include "service/access.h"
#include "service/build_queue.h"
#include "service/config.h"
#include "service/connection_streams.h"
#include "service/events.h"
#include "service/metrics.h"
#include "service/model_registry.h"
#include "service/quotas.h"
#include "service/session_memory.h"
#include "service/shm_broker.h"
#include "service/shm_cache.h"
#include "storage/store.h"

namespace ctxcache::service {

struct ServiceContext {
  explicit ServiceContext(ServerConfig c)
      : config(std::move(c)),
        models(config.model_dir, config.default_model),
        build_queue(config.max_concurrent_builds, config.build_queue_size) {}

  ServerConfig config;
  std::unique_ptr<storage::Store> store;
  // Cluster membership and replication; null without --cluster. Set before
  // the gRPC server starts, reset after it stopped and before the store.
  std::unique_ptr<cluster::ClusterNode> cluster;
  // Authentication, authorization, tenancy (set by Start before serving).
  std::unique_ptr<AccessControl> access;
  std::unique_ptr<TenantQuotas> quotas;
  // The audit log (rpc_metrics.h RpcScope).
  std::shared_ptr<spdlog::logger> audit;
  ModelRegistry models;
  BuildQueue build_queue;
  EventHub events;
  MetricsRegistry metrics;
  std::chrono::steady_clock::time_point start_time;
  // Set when SIGTERM drain starts; new sessions/builds get UNAVAILABLE.
  std::atomic<bool> draining{false};
  std::atomic<uint32_t> open_sessions{0};
  // Streaming calls per client connection (--max-streams-per-connection).
  ConnectionStreams connection_streams{config.max_streams_per_connection};
  // Decode sessions' memory (service/session_memory.h).
  MemoryBudget session_memory{
      config.session_memory_mb << 20,
      metrics.GetGauge("ctxcache_session_memory_bytes",
                       "Bytes accounted to decode sessions: loaded index tables (once per "
                       "context and method) plus each session's own state")};
  SharedIndexCache indexes{&session_memory};
  SharedPageCache pages{config.page_cache_mb << 20};
  // MapKV's segment hand-over (null with --shm-socket off).
  std::unique_ptr<ShmBroker> shm;
  // Filled MapKV segments kept for later calls (null unless --shm-cache-mb).
  std::unique_ptr<ShmCache> shm_cache;
};

}  // namespace ctxcache::service
