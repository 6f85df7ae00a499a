// Per-tenant quotas (auth::TenantQuota, from the tenants file) and per-tenant
// usage metrics.
//
// Admission points:
//   AdmitBuild   - before a build, extend or ingest does any work: concurrent
//                  builds, build tokens per sliding minute, and a fast check
//                  that the tenant is not already at its context or byte
//                  quota;
//   AdmitCommit  - right before the commit, with the exact bytes the new
//                  context stores: contexts and stored bytes, counting
//                  commits in flight, so two concurrent builds cannot both
//                  pass. A refusal aborts the build: nothing stays stored;
//   AdmitSession - before a decode session opens;
//   AdmitStream  - at the start of every streaming call;
//   AdmitMessage - for every call and every Decode-stream message.
// Refusals are RESOURCE_EXHAUSTED naming the quota and its value, and are
// counted in ctxcache_tenant_rejected_total{tenant,reason}.
//
// Thread-safety: safe for concurrent use. Guards release on destruction.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "auth/tenants.h"
#include "common/status.h"
#include "service/metrics.h"
#include "storage/store.h"

namespace ctxcache::service {

class AccessControl;
class TenantQuotas;

// Holds an admitted build's or session's share of its tenant's limits.
class QuotaGuard {
 public:
  QuotaGuard() = default;
  ~QuotaGuard();
  QuotaGuard(QuotaGuard&& o) noexcept;
  QuotaGuard& operator=(QuotaGuard&& o) noexcept;
  QuotaGuard(const QuotaGuard&) = delete;
  QuotaGuard& operator=(const QuotaGuard&) = delete;

 private:
  friend class TenantQuotas;
  enum class Kind { kNone, kBuild, kSession, kStream };
  void Release();
  TenantQuotas* owner_ = nullptr;
  Kind kind_ = Kind::kNone;
  std::string tenant_;
  uint64_t reserved_bytes_ = 0;  // kBuild: admitted by AdmitCommit
  bool reserved_context_ = false;
};

struct TenantUsage {
  uint64_t contexts = 0;
  uint64_t stored_bytes = 0;
};

class TenantQuotas {
 public:
  TenantQuotas(const AccessControl* access, storage::Store* store, MetricsRegistry* metrics)
      : access_(access), store_(store), metrics_(metrics) {}

  StatusOr<QuotaGuard> AdmitBuild(const std::string& tenant, uint64_t tokens);
  Status AdmitCommit(const std::string& tenant, uint64_t bytes, QuotaGuard* build);
  StatusOr<QuotaGuard> AdmitSession(const std::string& tenant);
  // A streaming call (max_streams).
  StatusOr<QuotaGuard> AdmitStream(const std::string& tenant);
  // One call or Decode-stream message (max_messages_per_second).
  Status AdmitMessage(const std::string& tenant);

  // READY contexts and their bytes, from the store.
  TenantUsage Usage(const std::string& tenant) const;

  // Registers the per-tenant gauges for `tenant` (once).
  void Track(const std::string& tenant);

 private:
  friend class QuotaGuard;
  Status Reject(const std::string& tenant, const char* reason, const std::string& msg);
  // max_sessions or max_streams: one more of `kind` for the tenant.
  StatusOr<QuotaGuard> AdmitCounted(const std::string& tenant, QuotaGuard::Kind kind);

  const AccessControl* access_;
  storage::Store* store_;
  MetricsRegistry* metrics_;
  std::mutex mu_;
  struct State {
    uint64_t builds = 0;
    uint64_t sessions = 0;
    uint64_t pending_bytes = 0;  // admitted commits not yet visible in the store
    uint64_t pending_contexts = 0;
    uint64_t streams = 0;
    double tokens = -1;  // message bucket; -1 = full
    int64_t refilled_us = 0;
    std::deque<std::pair<int64_t, uint64_t>> recent_tokens;  // (ms, tokens)
  };
  std::map<std::string, State> state_;  // guarded by mu_
  std::set<std::string> tracked_;       // guarded by mu_
};

}  // namespace ctxcache::service
