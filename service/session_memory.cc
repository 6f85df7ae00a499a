#include "service/session_memory.h"

#include <malloc.h>

#include <functional>

#include "common/thread_pool.h"
#include "index/methods.h"
#include "service/metrics.h"
#include "session/sparse_session.h"

namespace ctxcache::service {

MemoryBudget::MemoryBudget(uint64_t budget_bytes, Gauge* used_gauge)
    : budget_(budget_bytes), gauge_(used_gauge) {}

void MemoryBudget::Publish() {
  if (gauge_ != nullptr) gauge_->Set(static_cast<double>(used_.load()));
}

Status MemoryBudget::Reserve(uint64_t bytes, std::string_view what) {
  uint64_t used = used_.load();
  while (true) {
    if (budget_ != 0 && (bytes > budget_ || used > budget_ - bytes)) {
      return ResourceExhaustedError(std::string(what) + " needs " + std::to_string(bytes) +
                                    " bytes; session memory in use " + std::to_string(used) +
                                    " of budget " + std::to_string(budget_) +
                                    " bytes (--session-memory-mb); retry after sessions close");
    }
    if (used_.compare_exchange_weak(used, used + bytes)) break;
  }
  Publish();
  return Status::OK();
}

void MemoryBudget::Charge(uint64_t bytes) {
  used_ += bytes;
  Publish();
}

void MemoryBudget::Release(uint64_t bytes) {
  used_ -= bytes;
  Publish();
}

LoadedIndex::~LoadedIndex() {
  selectors.clear();
  if (budget != nullptr) budget->Release(bytes);
  // The tables are the largest buffers a server frees; glibc would keep
  // them in its arenas (RSS at the peak) until the decode reaper's next
  // trim, which can run before the last session of a context is gone.
  malloc_trim(0);
}

StatusOr<std::vector<std::unique_ptr<index::Selector>>> LoadContextIndex(
    const storage::ContextReader& reader, const std::string& method) {
  ASSIGN_OR_RETURN(const index::MethodInfo* info, index::FindMethodInfo(method));
  const v1::ContextManifest& m = reader.manifest();
  const uint32_t n_heads = m.model().n_kv_heads();
  const size_t n = size_t{m.model().n_layers()} * n_heads;
  std::vector<std::unique_ptr<index::Selector>> selectors(n);
  std::vector<Status> failed(n);
  // One (layer, kv head) per task: reading and parsing the artifacts (the
  // compact csa lists) is nearly all of a first session open, and the
  // reader's const methods are safe concurrently.
  auto load = [&](size_t i) -> Status {
    const uint32_t layer = static_cast<uint32_t>(i / n_heads);
    const uint32_t h = static_cast<uint32_t>(i % n_heads);
    auto bytes = reader.ReadArtifact(layer, h, info->artifact_kind);
    if (!bytes.ok()) {
      if (bytes.status().code() == StatusCode::kNotFound) {
        return FailedPreconditionError("context was built without the '" + method +
                                       "' index; rebuild it with that index method");
      }
      return bytes.status();
    }
    auto sel = index::LoadSelector(method, *bytes);
    if (!sel.ok()) {
      const std::string where =
          "loading the " + method + " index of layer " + std::to_string(layer) + " kv head " +
          std::to_string(h);
      // Stored bytes that passed their checksum but do not parse are stored
      // data in error, not the caller's.
      if (sel.status().code() == StatusCode::kInvalidArgument) {
        return DataLossError(where + ": " + std::string(sel.status().message()));
      }
      return sel.status().WithContext(where);
    }
    RETURN_IF_ERROR(session::SparseSession::CheckStoredSelector(
        **sel, static_cast<int>(layer), static_cast<int>(h),
        static_cast<int64_t>(m.n_tokens()), static_cast<int>(m.model().head_dim())));
    selectors[i] = std::move(sel).value();
    return Status::OK();
  };
  ThreadPool::Default()->ParallelFor(n, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) failed[i] = load(i);
  });
  for (const Status& s : failed) {
    if (!s.ok()) return s;  // the first (layer, kv head) that failed
  }
  return selectors;
}

StatusOr<std::shared_ptr<const LoadedIndex>> SharedIndexCache::Get(
    const storage::ContextReader& reader, const std::string& method) {
  ASSIGN_OR_RETURN(const index::MethodInfo* info, index::FindMethodInfo(method));
  // Identity: the context (id, commit time) and its artifacts of the method.
  std::string key = SharedPageCache::ContextKey(reader.manifest()) + "/" + method;
  for (const auto& a : reader.manifest().artifacts()) {
    if (a.kind() == info->artifact_kind) key += a.SerializeAsString();
  }
  std::shared_ptr<std::mutex> load_mu;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entries_[key];
    if (auto live = e.index.lock()) return std::shared_ptr<const LoadedIndex>(std::move(live));
    if (!e.load_mu) e.load_mu = std::make_shared<std::mutex>();
    load_mu = e.load_mu;
  }
  std::lock_guard<std::mutex> loading(*load_mu);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      if (auto live = it->second.index.lock()) {
        return std::shared_ptr<const LoadedIndex>(std::move(live));
      }
    }
  }
  ASSIGN_OR_RETURN(auto selectors, LoadContextIndex(reader, method));
  auto loaded = std::make_shared<LoadedIndex>();
  for (const auto& s : selectors) loaded->bytes += s->MemoryBytes();
  loaded->selectors = std::move(selectors);
  RETURN_IF_ERROR(budget_->Reserve(loaded->bytes, "loading the " + method + " index"));
  loaded->budget = budget_;
  std::lock_guard<std::mutex> lock(mu_);
  // Forget entries whose index is gone (keeps the map bounded by live ones).
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first != key && it->second.index.expired() && it->second.load_mu.use_count() == 1) {
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  entries_[key].index = loaded;
  return std::shared_ptr<const LoadedIndex>(std::move(loaded));
}

uint64_t SharedIndexCache::loaded_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = 0;
  for (const auto& [k, e] : entries_) {
    if (auto live = e.index.lock()) total += live->bytes;
  }
  return total;
}

size_t SharedIndexCache::loaded_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [k, e] : entries_) n += !e.index.expired();
  return n;
}

SharedPageCache::SharedPageCache(uint64_t budget_bytes) : budget_(budget_bytes) {}

std::string SharedPageCache::ContextKey(const v1::ContextManifest& m) {
  return m.context_id() + "@" + std::to_string(m.committed_at_ms());
}

std::string SharedPageCache::Flat(const Key& key) {
  std::string flat = key.context;
  const uint32_t tail[3] = {key.layer, key.kv_head, key.block};
  flat.append(reinterpret_cast<const char*>(tail), sizeof(tail));
  return flat;
}

session::PageRef SharedPageCache::Find(const Key& key) {
  if (budget_ == 0) return nullptr;
  const std::string flat = Flat(key);
  Shard& s = shards_[std::hash<std::string>()(flat) % kShards];
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.map.find(flat);
  if (it == s.map.end()) return nullptr;
  s.lru.splice(s.lru.begin(), s.lru, it->second);
  return it->second->second;
}

void SharedPageCache::Insert(const Key& key, session::PageRef page) {
  const uint64_t shard_budget = budget_ / kShards;
  if (page == nullptr || page->bytes() > shard_budget) return;
  std::string flat = Flat(key);
  Shard& s = shards_[std::hash<std::string>()(flat) % kShards];
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.map.find(flat);
  if (it != s.map.end()) {
    s.lru.splice(s.lru.begin(), s.lru, it->second);
    return;
  }
  s.bytes += page->bytes();
  s.lru.emplace_front(flat, std::move(page));
  s.map.emplace(std::move(flat), s.lru.begin());
  while (s.bytes > shard_budget && !s.lru.empty()) {
    s.bytes -= s.lru.back().second->bytes();
    s.map.erase(s.lru.back().first);
    s.lru.pop_back();
  }
}

uint64_t SharedPageCache::bytes() const {
  uint64_t total = 0;
  for (const Shard& s : shards_) {
    std::lock_guard<std::mutex> lock(s.mu);
    total += s.bytes;
  }
  return total;
}

}  // namespace ctxcache::service
