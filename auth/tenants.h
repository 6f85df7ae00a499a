// Per-tenant quotas (the tenants file) and the per-tenant id namespace.
//
// Tenants file (docs/security.md), INI-style; every value optional, 0 or
// absent = unlimited; sizes accept K/M/G/T (powers of 1024) suffixes:
//   [default]                 # applies to every tenant without a section
//   max_stored_bytes = 10G
//   [tenant.acme]
//   max_stored_bytes = 100G
//   max_contexts = 500
//   max_sessions = 64
//   max_builds = 2
//   build_tokens_per_minute = 2000000
//   max_streams = 256
//   max_messages_per_second = 5000
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "common/status.h"

namespace ctxcache::auth {

struct TenantQuota {
  // Bytes stored by the tenant's READY contexts. Default: 0 (unlimited).
  uint64_t max_stored_bytes = 0;
  // READY contexts. Default: 0 (unlimited).
  uint64_t max_contexts = 0;
  // Concurrently open decode sessions. Default: 0 (unlimited).
  uint64_t max_sessions = 0;
  // Concurrently running or queued builds, extends and ingests. Default: 0.
  uint64_t max_builds = 0;
  // Tokens submitted to builds, extends and ingests per sliding minute.
  // Default: 0 (unlimited).
  uint64_t build_tokens_per_minute = 0;
  // Concurrently open streaming calls (Decode, Watch, FetchIndex,
  // FetchPages, Build, Extend, Ingest). Default: 0 (unlimited).
  uint64_t max_streams = 0;
  // Calls plus Decode-stream messages per second (token bucket, burst of
  // one second's worth). Default: 0 (unlimited).
  uint64_t max_messages_per_second = 0;
};

struct TenantsConfig {
  TenantQuota defaults;
  std::map<std::string, TenantQuota> tenants;

  const TenantQuota& QuotaFor(const std::string& tenant) const {
    auto it = tenants.find(tenant);
    return it == tenants.end() ? defaults : it->second;
  }

  // INVALID_ARGUMENT naming the line on an unknown section or key or a bad value.
  static StatusOr<TenantsConfig> Parse(std::string_view text);
  static StatusOr<TenantsConfig> Read(const std::string& path);
};

// The id namespace of contexts that `tenant` builds ('B') or ingests ('I'):
// provenance byte || HMAC-SHA256(id_secret, "tenant\0" || tenant). Built
// contexts of the default tenant ("") get "" (ids as in storage format 1),
// so data written before tenancy keeps its ids.
std::string IdNamespace(std::string_view id_secret, std::string_view tenant, bool ingested);

// The server's id secret: 32 random bytes in `path` (created with mode 0600
// on first use; every node of a cluster must share it).
StatusOr<std::string> LoadOrCreateIdSecret(const std::string& path);

}  // namespace ctxcache::auth
