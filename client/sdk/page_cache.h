// Client-side pages: checking and decoding a wire page, the LRU page cache of
// a client-mode session, and gathering a SelectedKV head from pages.
//
// Thread-safety: PageCache is safe for concurrent use (one mutex): the
// session's prefetch thread fills it while Step reads it. The free
// functions are reentrant.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>

#include "common/status.h"
#include "ctxcache/client.h"
#include "ctxcache/v1/ctxcache_service.pb.h"
#include "session/page_fetcher.h"

namespace ctxcache::client::internal {

// Checks a wire page's crc32c and size, then decodes it to fp32.
// DataLoss naming the page otherwise.
StatusOr<session::PageRef> DecodePage(const v1::Page& p, uint32_t head_dim);

// Gathers the K/V of head->ids from pages (block -> decoded page).
void FillHead(const session::PageMap& pages, uint32_t block_tokens, uint32_t head_dim,
              SelectedKV::Head* head);

// LRU cache of decoded stored pages, keyed by (layer, kv head, block), within
// a byte budget. Pages a prefetch brought are marked until a Step first uses
// them (PageCacheStats::prefetch_hits).
class PageCache {
 public:
  explicit PageCache(size_t budget_bytes) : budget_(budget_bytes) {}

  // A Step's look-up: counts a hit or a miss (and a prefetch hit on the
  // first use of a prefetched page). `count` false (prefetch look-ups):
  // counts nothing and keeps the prefetch mark. Both refresh the LRU.
  session::PageRef Get(uint64_t key, bool count = true);
  // Inserts (no-op when present or larger than the budget), evicting from
  // the LRU end to stay within the budget. `prefetched`: brought by a
  // prefetch; `wire_bytes`: its payload bytes on the wire.
  void Put(uint64_t key, session::PageRef page, bool prefetched = false,
           uint64_t wire_bytes = 0);

  PageCacheStats stats() const;
  // Updates the counters under the cache's lock (prefetch bookkeeping).
  template <typename Fn>
  void UpdateStats(Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    fn(&stats_);
  }

  static uint64_t Key(uint32_t layer, uint32_t head, uint32_t block) {
    return (uint64_t{layer} << 48) | (uint64_t{head} << 32) | block;
  }

 private:
  struct Entry {
    session::PageRef page;
    std::list<uint64_t>::iterator lru;
    bool prefetched = false;
    uint64_t wire_bytes = 0;
  };
  const size_t budget_;
  mutable std::mutex mu_;
  std::list<uint64_t> lru_;                   // guarded by mu_
  std::unordered_map<uint64_t, Entry> map_;   // guarded by mu_
  PageCacheStats stats_;                      // guarded by mu_
};

}  // namespace ctxcache::client::internal
