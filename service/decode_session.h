// DecodeSession: the server side of one Decode stream, on the sparse
// decode-session core (session/sparse_session.h). It holds a lease on the
// context (via a ContextReader), one Selector per (layer, kv head) cloned
// from the context's loaded index (shared with the context's other sessions
// through a SharedIndexCache, or loaded for this session alone), and runs
// each layer-step through the core with a PageFetcher over the
// ContextReader. Takes and returns domain types; the wire conversion is in
// service/wire.h.
//
// Thread-safety: one Decode stream drives a session from one thread; not
// safe for concurrent use.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "index/selector.h"
#include "session/sparse_session.h"
#include "service/session_memory.h"
#include "storage/context_reader.h"

namespace ctxcache::service {

// session::PageFetcher over a ContextReader (not owned): stored pages
// decoded to fp32. Keeps the decoded pages it read (they are immutable):
// exact-scoring methods (oracle, tactic, lfps) gather keys of the same pages
// at every step. Either in a SharedPageCache of the server (every session,
// one budget, LRU), or in a private cache of cache_bytes that is dropped
// whole when full. Counts the stored (encoded) bytes it reads.
class ReaderPageFetcher final : public session::PageFetcher {
 public:
  // A private cache. Default: 64 MiB.
  explicit ReaderPageFetcher(storage::ContextReader* reader, size_t cache_bytes = 64u << 20)
      : reader_(reader), cache_budget_(cache_bytes) {}
  // The shared cache (outlives the fetcher).
  ReaderPageFetcher(storage::ContextReader* reader, SharedPageCache& shared)
      : reader_(reader),
        cache_budget_(0),
        shared_(&shared),
        context_key_(SharedPageCache::ContextKey(reader->manifest())) {}
  Status Fetch(int layer, int kv_head, std::span<const uint32_t> blocks,
               session::PageMap* out) override;
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  static uint64_t Key(int layer, int kv_head, uint32_t block) {
    return (uint64_t(uint32_t(layer)) << 48) | (uint64_t(uint32_t(kv_head)) << 32) | block;
  }
  storage::ContextReader* reader_;
  const size_t cache_budget_;
  SharedPageCache* shared_ = nullptr;
  const std::string context_key_;
  std::unordered_map<uint64_t, session::PageRef> cache_;
  size_t cache_bytes_ = 0;
  std::vector<uint32_t> missing_;
  storage::PageBatch batch_;
  uint64_t bytes_read_ = 0;
};

// One layer-step of a session.
struct SessionStep {
  uint32_t layer = 0;
  std::vector<session::HeadStep> heads;  // [kv_head]
  index::WorkStats work;
  double select_us = 0;
  // With want_pages, per kv head: the pages wholly inside the stored context
  // as stored (not decoded), and the pages reaching into the appended tokens
  // assembled in fp32, in page order.
  std::vector<storage::PageBatch> stored;                                     // [kv_head]
  std::vector<std::vector<std::pair<uint32_t, session::PageRef>>> assembled;  // [kv_head]
};

// What a session shares with the server's other sessions, and its limits.
struct DecodeSessionOptions {
  // The loaded indexes, shared per (context, method). Default: null (the
  // session loads its own).
  SharedIndexCache* indexes = nullptr;
  // Decoded-page cache. Default: null (a private 64 MiB cache).
  SharedPageCache* pages = nullptr;
  // The session memory budget: Open reserves the session's own bytes and
  // Append each token's. Default: null (not accounted).
  MemoryBudget* budget = nullptr;
  // Tokens a session may append; the session param "max_appended_tokens"
  // may lower it. 0 = unlimited. Default: 0.
  uint64_t max_appended_tokens = 0;
};

class DecodeSession {
 public:
  // Opens `method` on the context held by `reader`. params: see
  // session/session_params.h (rho, budget, page_fraction, whole_pages,
  // subgroup, recent_blocks), plus "max_appended_tokens" (>= 1, at most
  // options.max_appended_tokens when that is set). InvalidArgument for an
  // unknown method or bad params; FailedPrecondition when the context lacks
  // the method's index; ResourceExhausted when the index or the session does
  // not fit options.budget.
  static StatusOr<std::unique_ptr<DecodeSession>> Open(
      std::unique_ptr<storage::ContextReader> reader, const std::string& method,
      const std::map<std::string, std::string>& params, bool want_pages,
      const DecodeSessionOptions& options = {});
  ~DecodeSession();  // releases what it charged

  const v1::ContextManifest& manifest() const { return reader_->manifest(); }
  const std::string& method() const { return method_; }
  int64_t n_tokens() const { return core_->n_tokens(); }
  const session::SessionShape& shape() const { return core_->shape(); }

  // One layer-step: queries [n_q_heads][head_dim] fp32 (finite; the caller
  // validated them). InvalidArgument for a layer out of range.
  Status Step(uint32_t layer, const float* queries, SessionStep* out);

  // Streaming update with the new token's K, V [n_layers][n_kv][d] and Q
  // [n_layers][n_q][d] (may be null). FailedPrecondition naming
  // max_appended_tokens once the session has appended that many;
  // ResourceExhausted when the token does not fit the memory budget.
  Status Append(const float* k, const float* v, const float* q);

  // Bytes this session holds on its own (tables shared with other sessions
  // not counted); what it has charged to the budget.
  uint64_t memory_bytes() const { return core_->MemoryBytes() + sizeof(*this); }
  uint64_t max_appended_tokens() const { return max_appended_; }

  // Stored (encoded) bytes of pages read so far.
  uint64_t bytes_served() const { return bytes_served_ + fetcher_->bytes_read(); }

 private:
  DecodeSession() = default;
  void Recharge();

  std::unique_ptr<storage::ContextReader> reader_;
  std::shared_ptr<const LoadedIndex> index_;  // keeps the shared tables loaded
  std::unique_ptr<ReaderPageFetcher> fetcher_;
  MemoryBudget* budget_ = nullptr;
  uint64_t charged_ = 0;       // bytes charged to budget_
  uint64_t kv_bytes_ = 0;      // one token's K and V in every layer
  uint64_t token_bytes_ = 0;   // the next Append's estimate: the last one's cost (>= kv_bytes_)
  uint64_t max_appended_ = 0;  // 0 = unlimited
  uint64_t n_appended_ = 0;
  std::unique_ptr<session::SparseSession> core_;
  std::string method_;
  bool want_pages_ = false;
  uint64_t bytes_served_ = 0;
};

}  // namespace ctxcache::service
