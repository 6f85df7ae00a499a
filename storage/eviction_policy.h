// Eviction policy: which READY contexts to delete, given a capacity budget
// with high/low watermarks, LRU order, TTLs, pins, leases and parent/child
// references. Pure function; Store::RunEvictionPass applies its decisions.
//
// Rules (in this order):
//  1. A pinned context is never selected.
//  2. A context that still has children (contexts that reference its pages)
//     is never selected; once all its children are selected in the same
//     pass, it becomes eligible.
//  3. Every eligible context whose TTL has passed (expires_at_ms != 0 and
//     now_ms >= expires_at_ms) is selected (reason kExpired).
//  4. If capacity_bytes > 0 and the bytes in use exceed
//     high_watermark * capacity_bytes, eligible contexts are selected until
//     the bytes in use are at most low_watermark * capacity_bytes (reason
//     kCapacity), fairly across tenants: each pick is the least recently
//     accessed eligible context of a tenant whose bytes exceed its share
//     (tenant_share_bytes, else default_tenant_share_bytes, else an equal
//     split of capacity_bytes among the tenants present); only when no such
//     tenant has an eligible context does the pick fall back to the least
//     recently accessed eligible context overall. So a tenant within its
//     share is not evicted to make room for one over it.
//  5. A selected context that holds a lease is returned with deferred=true:
//     the store marks it and deletes it when its last lease drops. Its
//     bytes count as freed for rule 4.
//
// Thread-safety: pure function.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "storage/keys.h"

namespace ctxcache::storage {

struct EvictionPolicyOptions {
  // Budget for the bytes stored by READY contexts. 0 = unlimited. Default: 0.
  uint64_t capacity_bytes = 0;
  // Start evicting above this fraction of capacity. Default: 0.95.
  double high_watermark = 0.95;
  // Evict down to this fraction of capacity. Default: 0.85.
  double low_watermark = 0.85;
  // Bytes each tenant may keep before its contexts go first under capacity
  // pressure (rule 4); typically its max_stored_bytes quota. Default: empty.
  std::map<std::string, uint64_t> tenant_share_bytes;
  // The share of tenants not in tenant_share_bytes; 0 = an equal split of
  // capacity_bytes among the tenants present. Default: 0.
  uint64_t default_tenant_share_bytes = 0;
};

struct EvictionCandidate {
  ContextId id;
  std::optional<ContextId> parent;
  std::string tenant;
  uint64_t bytes = 0;
  int64_t last_access_ms = 0;
  int64_t expires_at_ms = 0;  // 0 = never
  bool pinned = false;
  bool leased = false;
  int children = 0;
};

enum class EvictionReason { kExpired, kCapacity };

struct EvictionDecision {
  ContextId id;
  EvictionReason reason = EvictionReason::kCapacity;
  bool deferred = false;  // leased: mark now, delete when the last lease drops
};

// `candidates` are all READY, not yet marked contexts; the bytes in use are
// the sum of their `bytes`. Decisions come in the order they were taken.
std::vector<EvictionDecision> SelectEvictionVictims(const EvictionPolicyOptions& options,
                                                    std::vector<EvictionCandidate> candidates,
                                                    int64_t now_ms);

}  // namespace ctxcache::storage
