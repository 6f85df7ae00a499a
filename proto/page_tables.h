// Checks of page tables (ctxcache.v1.PageTable) against a context's shape.
// Header-only, one definition for the client (before a request is sent) and
// the server (FetchKV with tables).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "ctxcache/v1/ctxcache_service.pb.h"

namespace ctxcache {

// At least one table; each table's layer < n_layers, kv_head < n_kv_heads,
// and blocks strictly increasing and < n_blocks. INVALID_ARGUMENT naming
// the field (tables[i].blocks[j]) and the expected value otherwise.
inline Status CheckPageTables(uint32_t n_layers, uint32_t n_kv_heads, uint64_t n_blocks,
                              const google::protobuf::RepeatedPtrField<v1::PageTable>& tables) {
  if (tables.empty()) return InvalidArgumentError("tables: empty, expected >= 1");
  for (int i = 0; i < tables.size(); ++i) {
    const v1::PageTable& t = tables[i];
    // Built only for an error message: no allocation per good table.
    auto at = [i] { return "tables[" + std::to_string(i) + "]"; };
    if (t.layer() >= n_layers) {
      return InvalidArgumentError(at() + ".layer: " + std::to_string(t.layer()) +
                                  ", expected < n_layers " + std::to_string(n_layers));
    }
    if (t.kv_head() >= n_kv_heads) {
      return InvalidArgumentError(at() + ".kv_head: " + std::to_string(t.kv_head()) +
                                  ", expected < n_kv_heads " + std::to_string(n_kv_heads));
    }
    for (int j = 0; j < t.blocks_size(); ++j) {
      if (t.blocks(j) >= n_blocks || (j > 0 && t.blocks(j) <= t.blocks(j - 1))) {
        return InvalidArgumentError(at() + ".blocks[" + std::to_string(j) + "]: " +
                                    std::to_string(t.blocks(j)) +
                                    ", expected strictly increasing blocks < " +
                                    std::to_string(n_blocks));
      }
    }
  }
  return Status::OK();
}

}  // namespace ctxcache
