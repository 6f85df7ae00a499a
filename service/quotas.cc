#include "service/quotas.h"

#include <algorithm>
#include <chrono>

#include "common/clock.h"
#include "service/access.h"

namespace ctxcache::service {

namespace {

std::string TenantLabel(const std::string& tenant) { return tenant.empty() ? "-" : tenant; }

}  // namespace

QuotaGuard::~QuotaGuard() { Release(); }

QuotaGuard::QuotaGuard(QuotaGuard&& o) noexcept { *this = std::move(o); }

QuotaGuard& QuotaGuard::operator=(QuotaGuard&& o) noexcept {
  if (this != &o) {
    Release();
    owner_ = o.owner_;
    kind_ = o.kind_;
    tenant_ = std::move(o.tenant_);
    reserved_bytes_ = o.reserved_bytes_;
    reserved_context_ = o.reserved_context_;
    o.owner_ = nullptr;
    o.kind_ = Kind::kNone;
  }
  return *this;
}

void QuotaGuard::Release() {
  if (!owner_) return;
  std::lock_guard<std::mutex> l(owner_->mu_);
  auto& st = owner_->state_[tenant_];
  if (kind_ == Kind::kBuild) {
    --st.builds;
    st.pending_bytes -= reserved_bytes_;
    if (reserved_context_) --st.pending_contexts;
  } else if (kind_ == Kind::kSession) {
    --st.sessions;
  } else if (kind_ == Kind::kStream) {
    --st.streams;
  }
  owner_ = nullptr;
  kind_ = Kind::kNone;
}

Status TenantQuotas::Reject(const std::string& tenant, const char* reason, const std::string& msg) {
  metrics_
      ->GetCounter("ctxcache_tenant_rejected_total", "Calls refused by a tenant quota, by reason",
                   {{"tenant", TenantLabel(tenant)}, {"reason", reason}})
      ->Inc();
  return ResourceExhaustedError("tenant '" + tenant + "': " + msg);
}

TenantUsage TenantQuotas::Usage(const std::string& tenant) const {
  TenantUsage u;
  for (const auto& m : store_->ListContexts()) {
    if (m.tenant() != tenant || m.state() != v1::CONTEXT_STATE_READY) continue;
    ++u.contexts;
    u.stored_bytes += m.stored_bytes();
  }
  return u;
}

void TenantQuotas::Track(const std::string& tenant) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!tracked_.insert(tenant).second) return;
  }
  const std::map<std::string, std::string> labels{{"tenant", TenantLabel(tenant)}};
  metrics_->AddCallbackGauge(
      "ctxcache_tenant_stored_bytes", "Bytes stored by the tenant's READY contexts",
      [this, tenant] { return static_cast<double>(Usage(tenant).stored_bytes); }, labels);
  metrics_->AddCallbackGauge(
      "ctxcache_tenant_contexts", "The tenant's READY contexts",
      [this, tenant] { return static_cast<double>(Usage(tenant).contexts); }, labels);
  metrics_->AddCallbackGauge(
      "ctxcache_tenant_sessions", "The tenant's open decode sessions",
      [this, tenant] {
        std::lock_guard<std::mutex> l(mu_);
        auto it = state_.find(tenant);
        return it == state_.end() ? 0.0 : static_cast<double>(it->second.sessions);
      },
      labels);
}

StatusOr<QuotaGuard> TenantQuotas::AdmitBuild(const std::string& tenant, uint64_t tokens) {
  Track(tenant);
  const auth::TenantQuota q = access_->tenants()->QuotaFor(tenant);
  if (q.max_contexts || q.max_stored_bytes) {
    TenantUsage u = Usage(tenant);
    if (q.max_contexts && u.contexts >= q.max_contexts) {
      return Reject(tenant, "max_contexts",
                    "quota max_contexts=" + std::to_string(q.max_contexts) + " reached (" +
                        std::to_string(u.contexts) + " contexts stored); evict some first");
    }
    if (q.max_stored_bytes && u.stored_bytes >= q.max_stored_bytes) {
      return Reject(tenant, "max_stored_bytes",
                    "quota max_stored_bytes=" + std::to_string(q.max_stored_bytes) + " reached (" +
                        std::to_string(u.stored_bytes) + " bytes stored); evict some first");
    }
  }
  std::unique_lock<std::mutex> l(mu_);
  State& st = state_[tenant];
  if (q.max_builds && st.builds >= q.max_builds) {
    l.unlock();
    return Reject(tenant, "max_builds",
                  "quota max_builds=" + std::to_string(q.max_builds) +
                      " concurrent builds reached; retry when one finishes");
  }
  const int64_t now = SteadyNowMs();
  while (!st.recent_tokens.empty() && now - st.recent_tokens.front().first >= 60000) {
    st.recent_tokens.pop_front();
  }
  if (q.build_tokens_per_minute) {
    uint64_t used = 0;
    for (const auto& [t, n] : st.recent_tokens) used += n;
    if (used + tokens > q.build_tokens_per_minute) {
      l.unlock();
      return Reject(tenant, "build_tokens_per_minute",
                    "quota build_tokens_per_minute=" + std::to_string(q.build_tokens_per_minute) +
                        " exceeded (" + std::to_string(used) + " tokens in the last minute, " +
                        std::to_string(tokens) + " requested); retry later");
    }
  }
  st.recent_tokens.emplace_back(now, tokens);
  ++st.builds;
  QuotaGuard g;
  g.owner_ = this;
  g.kind_ = QuotaGuard::Kind::kBuild;
  g.tenant_ = tenant;
  return g;
}

Status TenantQuotas::AdmitCommit(const std::string& tenant, uint64_t bytes, QuotaGuard* build) {
  const auth::TenantQuota q = access_->tenants()->QuotaFor(tenant);
  if (!q.max_contexts && !q.max_stored_bytes) return Status::OK();
  // Usage() reads the store without our mutex; commits admitted but not yet
  // visible there are in pending_*.
  TenantUsage u = Usage(tenant);
  std::unique_lock<std::mutex> l(mu_);
  State& st = state_[tenant];
  const uint64_t contexts = u.contexts + st.pending_contexts + 1;
  const uint64_t total = u.stored_bytes + st.pending_bytes + bytes;
  if (q.max_contexts && contexts > q.max_contexts) {
    l.unlock();
    return Reject(tenant, "max_contexts",
                  "quota max_contexts=" + std::to_string(q.max_contexts) +
                      " would be exceeded by this context; nothing was stored");
  }
  if (q.max_stored_bytes && total > q.max_stored_bytes) {
    l.unlock();
    return Reject(tenant, "max_stored_bytes",
                  "quota max_stored_bytes=" + std::to_string(q.max_stored_bytes) +
                      " would be exceeded: this context needs " + std::to_string(bytes) +
                      " bytes, the tenant stores " + std::to_string(u.stored_bytes) +
                      "; nothing was stored");
  }
  st.pending_contexts += 1;
  st.pending_bytes += bytes;
  build->reserved_bytes_ += bytes;
  build->reserved_context_ = true;
  return Status::OK();
}

StatusOr<QuotaGuard> TenantQuotas::AdmitCounted(const std::string& tenant, QuotaGuard::Kind kind) {
  const auth::TenantQuota q = access_->tenants()->QuotaFor(tenant);
  const bool session = kind == QuotaGuard::Kind::kSession;
  const uint64_t limit = session ? q.max_sessions : q.max_streams;
  std::unique_lock<std::mutex> l(mu_);
  State& st = state_[tenant];
  uint64_t& count = session ? st.sessions : st.streams;
  if (limit && count >= limit) {
    l.unlock();
    const char* name = session ? "max_sessions" : "max_streams";
    return Reject(tenant, name,
                  std::string("quota ") + name + "=" + std::to_string(limit) + " open " +
                      (session ? "sessions" : "streaming calls") + " reached; close one first");
  }
  ++count;
  QuotaGuard g;
  g.owner_ = this;
  g.kind_ = kind;
  g.tenant_ = tenant;
  return g;
}

StatusOr<QuotaGuard> TenantQuotas::AdmitStream(const std::string& tenant) {
  return AdmitCounted(tenant, QuotaGuard::Kind::kStream);
}

Status TenantQuotas::AdmitMessage(const std::string& tenant) {
  const auth::TenantQuota q = access_->tenants()->QuotaFor(tenant);
  if (!q.max_messages_per_second) return Status::OK();
  const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  const double rate = static_cast<double>(q.max_messages_per_second);
  std::unique_lock<std::mutex> l(mu_);
  State& st = state_[tenant];
  if (st.tokens < 0) {
    st.tokens = rate;
  } else {
    st.tokens = std::min(rate, st.tokens + rate * (now_us - st.refilled_us) / 1e6);
  }
  st.refilled_us = now_us;
  if (st.tokens < 1) {
    l.unlock();
    return Reject(tenant, "max_messages_per_second",
                  "quota max_messages_per_second=" + std::to_string(q.max_messages_per_second) +
                      " exceeded; slow down and retry");
  }
  st.tokens -= 1;
  return Status::OK();
}

StatusOr<QuotaGuard> TenantQuotas::AdmitSession(const std::string& tenant) {
  Track(tenant);
  return AdmitCounted(tenant, QuotaGuard::Kind::kSession);
}

}  // namespace ctxcache::service
