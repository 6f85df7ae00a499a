// ShmCache: MapKV segments kept after their fill, so that the next MapKV of
// the same context and layers on this host hands out the same memory
// instead of reading the store again (a host-memory tier of the service,
// shared by every worker process on the host).
//
// Only sealed segments are kept (ShmSegment::sealed(): no write, grow or
// shrink by anyone but the server's own fill mapping), so a worker that got
// a descriptor cannot change what the next worker reads. The cache hands
// out a duplicate descriptor per call; MapKV authorizes every call as before
// (key, tenant, the context READY), so a cached segment reaches only callers
// that may read its context.
//
// Keys carry the context's creation time, so a context deleted and built
// again under the same id never meets its old segment. DropContext frees a
// context's segments when it is evicted through the service; a context the
// store evicts by itself (TTL, capacity) keeps its segments until they fall
// out of the budget, and they are never served (MapKV's OpenReader refuses
// the context first).
//
// Budget: the sum of the kept segments' sizes stays <= budget_bytes; an
// insert evicts least recently used segments first, and a segment larger
// than the budget is not kept. Evicting a segment closes the cache's
// descriptor; workers that mapped it keep their mapping until they unmap.
//
// Thread-safety: safe for concurrent use.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ctxcache::service {

class ShmCache {
 public:
  explicit ShmCache(uint64_t budget_bytes) : budget_(budget_bytes) {}
  ~ShmCache();
  ShmCache(const ShmCache&) = delete;
  ShmCache& operator=(const ShmCache&) = delete;

  // The key of (context, creation time, layers in segment order).
  static std::string Key(const std::string& context_hex, int64_t created_at_ms,
                         const std::vector<uint32_t>& layers);

  // A new descriptor of the segment kept under `key` (the caller owns it;
  // the entry becomes the most recently used), or -1 when none is kept.
  int Lookup(const std::string& key);
  // Keeps `fd` (ownership passes to the cache) of `size` bytes under `key`,
  // replacing an entry of the same key. Returns false (and closes `fd`)
  // when the segment exceeds the whole budget.
  bool Insert(const std::string& key, int fd, uint64_t size);
  // Closes every segment of `context_hex`; returns the bytes freed.
  uint64_t DropContext(const std::string& context_hex);

  uint64_t bytes() const;
  size_t entries() const;
  uint64_t budget() const { return budget_; }

 private:
  struct Entry {
    std::string key;
    int fd;
    uint64_t size;
  };
  void EraseLocked(std::list<Entry>::iterator it);

  const uint64_t budget_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // guarded by mu_; front = most recently used
  std::map<std::string, std::list<Entry>::iterator> by_key_;  // guarded by mu_
  uint64_t bytes_ = 0;                                        // guarded by mu_
};

}  // namespace ctxcache::service
