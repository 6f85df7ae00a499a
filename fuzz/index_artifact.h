// The fuzz body shared by the fuzz_index_<method> targets: an index artifact
// (Selector::Serialize output) reaches clients in client-select mode
// (FetchIndex), so index::LoadSelector must reject any hostile bytes with a
// Status. An artifact that loads must then also behave: it re-serializes,
// clones, and (for small tables) answers a Select and takes an Append.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "index/selector.h"

namespace ctxcache::fuzz {

inline int FuzzIndexArtifact(std::string_view method, const uint8_t* data, size_t size) {
  StatusOr<std::unique_ptr<index::Selector>> loaded =
      index::LoadSelector(method, AsView(data, size));
  if (!loaded.ok()) return 0;
  index::Selector& sel = **loaded;
  std::string bytes;
  if (!sel.Serialize(&bytes).ok()) std::abort();  // a loaded artifact serializes
  (void)sel.MemoryBytes();
  std::unique_ptr<index::Selector> clone = sel.Clone();
  const int64_t n = sel.n_tokens();
  const int d = sel.head_dim();
  // Select and Append touch every table entry: only for small tables, so a
  // large (valid) header does not turn into a slow input.
  if (n <= 0 || d <= 0 || n > (int64_t{1} << 14) || n * d > (int64_t{1} << 14)) return 0;
  std::vector<float> keys(static_cast<size_t>(n + 1) * d);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<float>((i * 7919) % 17) - 8.0f;
  index::ArrayKeySource source(keys.data(), n, d);
  std::vector<float> queries(static_cast<size_t>(2) * d, 0.5f);
  index::SelectInput in;
  in.queries = queries.data();
  in.n_queries = 2;
  in.budget = 8;
  in.keys = &source;
  index::Selection selection;
  index::WorkStats stats;
  (void)clone->Select(in, &selection, &stats);
  for (const auto& ids : selection.per_head) {
    for (int32_t id : ids) {
      if (id < 0 || id >= n) std::abort();  // selections name covered tokens only
    }
  }
  (void)clone->Append(keys.data() + static_cast<size_t>(n) * d, keys.data(), nullptr);
  return 0;
}

}  // namespace ctxcache::fuzz
