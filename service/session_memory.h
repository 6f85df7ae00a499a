// What decode sessions of one ctxcached share, and the memory they are
// admitted against (issue #19, docs/reliability.md "Session memory"):
//   - MemoryBudget: the global byte budget for sessions
//     (--session-memory-mb). Open and Append reserve against it; a request
//     past it gets RESOURCE_EXHAUSTED with the used, asked and budget bytes.
//   - SharedIndexCache: the loaded index tables of each (context, method),
//     loaded once however many sessions open it, shared by all of them
//     (index::Selector::Clone shares the immutable tables), charged to the
//     budget once, and freed when the last session holding it closes.
//   - SharedPageCache: the decoded (fp32) stored pages, one LRU for every
//     session under one byte budget (--page-cache-mb).
//
// Thread-safety: all three are safe for concurrent use. A LoadedIndex is
// immutable once published; sessions Clone() its selectors.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "index/selector.h"
#include "session/page_fetcher.h"
#include "storage/context_reader.h"

namespace ctxcache::service {

class Gauge;

// Bytes used against a budget.
class MemoryBudget {
 public:
  // budget_bytes 0 = unlimited. used_gauge (may be null) follows used().
  MemoryBudget(uint64_t budget_bytes, Gauge* used_gauge);

  // Takes `bytes` when used() + bytes <= budget(); else ResourceExhausted
  // "<what> needs N bytes; session memory in use U of budget B
  // (--session-memory-mb)".
  Status Reserve(uint64_t bytes, std::string_view what);
  // Takes `bytes` whatever the budget (memory already allocated).
  void Charge(uint64_t bytes);
  void Release(uint64_t bytes);

  uint64_t used() const { return used_.load(); }
  uint64_t budget() const { return budget_; }

 private:
  void Publish();
  const uint64_t budget_;
  std::atomic<uint64_t> used_{0};
  Gauge* gauge_;
};

// The selectors of one (context, method), [layer * n_kv_heads + kv_head]:
// the prototypes each session clones. When destroyed (its last session
// closed) it releases its bytes from the budget and returns the freed
// memory to the OS (malloc_trim).
struct LoadedIndex {
  std::vector<std::unique_ptr<index::Selector>> selectors;
  uint64_t bytes = 0;  // sum of MemoryBytes(): the tables
  MemoryBudget* budget = nullptr;
  ~LoadedIndex();
};

// Reads and loads every (layer, kv head) artifact of `method` from the
// reader's context, in parallel on ThreadPool::Default(). FailedPrecondition
// when the context lacks the index; DataLoss (with the layer and head) for
// an artifact that does not load (the first failing one in layer, head
// order).
StatusOr<std::vector<std::unique_ptr<index::Selector>>> LoadContextIndex(
    const storage::ContextReader& reader, const std::string& method);

class SharedIndexCache {
 public:
  // budget: not owned, outlives the cache.
  explicit SharedIndexCache(MemoryBudget* budget) : budget_(budget) {}

  // The loaded `method` index of the reader's context: the one a live
  // session holds, else loaded now (once while concurrent Opens wait) and
  // reserved against the budget (ResourceExhausted when it does not fit).
  StatusOr<std::shared_ptr<const LoadedIndex>> Get(const storage::ContextReader& reader,
                                                   const std::string& method);
  // Bytes of the indexes loaded now.
  uint64_t loaded_bytes() const;
  size_t loaded_count() const;

 private:
  struct Entry {
    std::weak_ptr<const LoadedIndex> index;
    std::shared_ptr<std::mutex> load_mu;  // one load at a time per key
  };
  MemoryBudget* budget_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;  // guarded by mu_
};

// Decoded stored pages of every session, LRU under one byte budget.
class SharedPageCache {
 public:
  // budget_bytes 0 disables caching.
  explicit SharedPageCache(uint64_t budget_bytes);

  struct Key {
    std::string context;  // the context's identity (ContextKey)
    uint32_t layer = 0, kv_head = 0, block = 0;
  };
  // The cached page or null.
  session::PageRef Find(const Key& key);
  // Inserts (or refreshes) a page, evicting the least recently used ones
  // to stay within the budget. A page larger than the budget is not kept.
  void Insert(const Key& key, session::PageRef page);
  uint64_t bytes() const;
  uint64_t budget() const { return budget_; }

  // A context's identity: its id and commit time (a rebuilt context with
  // the same id never sees the old one's pages).
  static std::string ContextKey(const v1::ContextManifest& m);

 private:
  static constexpr int kShards = 16;
  struct Shard {
    mutable std::mutex mu;
    std::list<std::pair<std::string, session::PageRef>> lru;  // front = most recent
    std::unordered_map<std::string, decltype(lru)::iterator> map;
    uint64_t bytes = 0;
  };
  static std::string Flat(const Key& key);
  const uint64_t budget_;
  Shard shards_[kShards];
};

}  // namespace ctxcache::service
