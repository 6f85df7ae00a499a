// Small helpers shared by the Store's translation units (store.cc: open,
// background, the Store facade; store_recovery.cc: scans, GC, resume;
// store_build.cc: builds; store_admin.cc: lookups, leases, admin,
// eviction). Only storage/store*.cc include it.
#pragma once

#include <cstdint>
#include <string>

#include "common/byte_order.h"
#include "storage/store_internal.h"

namespace ctxcache::storage::store_detail {

inline constexpr uint32_t kMaxLayersOrHeads = 0xFFFE;  // 0xFFFF = kWholeContext

inline std::string Hex(const ContextId& id) { return id.ToHex(); }

}  // namespace ctxcache::storage::store_detail
