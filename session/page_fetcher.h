// PageFetcher: where a decode session's stored KV pages come from. A page is
// the K and V of B consecutive tokens of one (layer, kv head), decoded to
// fp32. Three implementations: storage's ContextReader (the server,
// service/session_fetchers.h), FetchPages plus the SDK's page cache (client
// mode, client/sdk/), and the model's KvCache (embedded decode and tests,
// model/decode.h).
//
// Thread-safety: implementations say; the session core calls one fetcher
// from one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace ctxcache::session {

// Decoded K/V of the tokens of one page: [n_tokens][d] each, fp32.
struct DecodedPage {
  uint32_t n_tokens = 0;
  std::vector<float> k, v;
  // Heap bytes held (for cache budgets).
  size_t bytes() const { return (k.size() + v.size()) * sizeof(float) + 64; }
};

using PageRef = std::shared_ptr<const DecodedPage>;
// Block id -> page, for one (layer, kv head).
using PageMap = std::unordered_map<uint32_t, PageRef>;

class PageFetcher {
 public:
  virtual ~PageFetcher() = default;
  // Adds to *out the stored rows of every block in `blocks` of (layer,
  // kv_head) that *out does not hold yet. Every block must start inside the
  // stored context; a block that straddles its end yields only its stored
  // rows (n_tokens < B). blocks: any order, duplicates allowed. Errors:
  // NotFound / DataLoss / InvalidArgument from the source, *out unchanged
  // for the blocks not added.
  virtual Status Fetch(int layer, int kv_head, std::span<const uint32_t> blocks,
                       PageMap* out) = 0;
};

}  // namespace ctxcache::session
