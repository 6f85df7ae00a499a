// Small helpers shared by the Store's translation units (store.cc: open,
// background, the Store facade; store_recovery.cc: scans, GC, resume;
// store_build.cc: builds; store_admin.cc: lookups, leases, admin,
// eviction). Only storage/store*.cc include it.
#pragma once

#include <cstdint>
#include <string>

#include "storage/store_internal.h"

namespace ctxcache::storage::store_detail {

inline constexpr uint32_t kMaxLayersOrHeads = 0xFFFE;  // 0xFFFF = kWholeContext

inline std::string Hex(const ContextId& id) { return id.ToHex(); }

inline void PutLE32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}
inline uint32_t GetLE32(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return uint32_t{u[0]} | (uint32_t{u[1]} << 8) | (uint32_t{u[2]} << 16) | (uint32_t{u[3]} << 24);
}

}  // namespace ctxcache::storage::store_detail
