#include "storage/eviction_policy.h"

#include <algorithm>
#include <map>

namespace ctxcache::storage {

std::vector<EvictionDecision> SelectEvictionVictims(const EvictionPolicyOptions& options,
                                                    std::vector<EvictionCandidate> candidates,
                                                    int64_t now_ms) {
  std::vector<EvictionDecision> out;
  // LRU order (ties by id for determinism).
  std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
    if (a.last_access_ms != b.last_access_ms) return a.last_access_ms < b.last_access_ms;
    return a.id < b.id;
  });
  std::map<ContextId, size_t> pos;
  uint64_t used = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    pos[candidates[i].id] = i;
    used += candidates[i].bytes;
  }
  std::vector<bool> taken(candidates.size(), false);
  std::map<std::string, uint64_t> tenant_used;
  for (const auto& c : candidates) tenant_used[c.tenant] += c.bytes;

  auto take = [&](size_t i, EvictionReason reason) {
    taken[i] = true;
    used -= candidates[i].bytes;
    tenant_used[candidates[i].tenant] -= candidates[i].bytes;
    out.push_back({candidates[i].id, reason, candidates[i].leased});
    if (candidates[i].parent) {
      auto it = pos.find(*candidates[i].parent);
      if (it != pos.end()) --candidates[it->second].children;
    }
  };
  auto eligible = [&](size_t i) {
    return !taken[i] && !candidates[i].pinned && candidates[i].children <= 0;
  };

  // Rule 3: expired contexts. Repeat until stable so that an expired parent
  // whose children all expired goes in the same pass.
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < candidates.size(); ++i) {
      const auto& c = candidates[i];
      if (eligible(i) && c.expires_at_ms != 0 && now_ms >= c.expires_at_ms) {
        take(i, EvictionReason::kExpired);
        changed = true;
      }
    }
  }

  // Rule 4: capacity, LRU. Rescan from the oldest after each pick: taking a
  // child can make its (older) parent eligible.
  if (options.capacity_bytes > 0) {
    const double cap = static_cast<double>(options.capacity_bytes);
    if (static_cast<double>(used) > options.high_watermark * cap) {
      const double target = options.low_watermark * cap;
      const uint64_t equal_share =
          options.default_tenant_share_bytes
              ? options.default_tenant_share_bytes
              : options.capacity_bytes / std::max<size_t>(1, tenant_used.size());
      auto over_share = [&](const std::string& tenant) {
        auto it = options.tenant_share_bytes.find(tenant);
        const uint64_t share = it == options.tenant_share_bytes.end() ? equal_share : it->second;
        return tenant_used[tenant] > share;
      };
      while (static_cast<double>(used) > target) {
        std::optional<size_t> pick;
        for (size_t i = 0; i < candidates.size() && !pick; ++i) {
          if (eligible(i) && over_share(candidates[i].tenant)) pick = i;
        }
        for (size_t i = 0; i < candidates.size() && !pick; ++i) {
          if (eligible(i)) pick = i;
        }
        if (!pick) break;  // everything left is pinned or referenced
        take(*pick, EvictionReason::kCapacity);
      }
    }
  }
  return out;
}

}  // namespace ctxcache::storage
