#include "client/sdk/page_cache.h"

#include <algorithm>
#include <string>

#include "common/crc32c.h"
#include "common/dtype.h"
#include "proto/dtype_convert.h"

namespace ctxcache::client::internal {

StatusOr<session::PageRef> DecodePage(const v1::Page& p, uint32_t head_dim) {
  if (crc32c::Value(p.k(), p.v()) != p.crc32c()) {
    return DataLossError("page crc32c mismatch (layer " + std::to_string(p.layer()) + ", kv head " +
                         std::to_string(p.kv_head()) + ", block " + std::to_string(p.block()) +
                         "): the page was corrupted in transit");
  }
  auto dt = FromProtoDType(p.dtype());
  if (!dt.ok()) return DataLossError("page " + std::string(dt.status().message()));
  const size_t want = size_t{p.n_tokens()} * head_dim * DTypeSize(*dt);
  if (p.k().size() != want || p.v().size() != want) {
    return DataLossError("page of block " + std::to_string(p.block()) + " has the wrong size");
  }
  auto out = std::make_shared<session::DecodedPage>();
  out->n_tokens = p.n_tokens();
  out->k.resize(size_t{p.n_tokens()} * head_dim);
  out->v.resize(out->k.size());
  ConvertToFloat(*dt, p.k().data(), out->k.data(), out->k.size());
  ConvertToFloat(*dt, p.v().data(), out->v.data(), out->v.size());
  return session::PageRef(std::move(out));
}

void FillHead(const session::PageMap& pages, uint32_t block_tokens, uint32_t head_dim,
              SelectedKV::Head* head) {
  const uint32_t d = head_dim;
  head->k.resize(head->ids.size() * d);
  head->v.resize(head->ids.size() * d);
  for (size_t i = 0; i < head->ids.size(); ++i) {
    const uint32_t id = static_cast<uint32_t>(head->ids[i]);
    const auto& page = pages.at(id / block_tokens);
    const size_t row = size_t(id % block_tokens) * d;
    std::copy_n(page->k.data() + row, d, head->k.data() + i * d);
    std::copy_n(page->v.data() + row, d, head->v.data() + i * d);
  }
}

session::PageRef PageCache::Get(uint64_t key, bool count) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) {
    if (count) stats_.misses++;
    return nullptr;
  }
  Entry& e = it->second;
  if (count) {
    stats_.hits++;
    if (e.prefetched) {
      e.prefetched = false;
      stats_.prefetch_hits++;
      stats_.prefetch_hit_bytes += e.wire_bytes;
    }
  }
  lru_.splice(lru_.begin(), lru_, e.lru);
  return e.page;
}

void PageCache::Put(uint64_t key, session::PageRef page, bool prefetched, uint64_t wire_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (page->bytes() > budget_ || map_.count(key)) return;
  while (stats_.bytes + page->bytes() > budget_ && !lru_.empty()) {
    const uint64_t victim = lru_.back();
    lru_.pop_back();
    stats_.bytes -= map_[victim].page->bytes();
    map_.erase(victim);
    stats_.evictions++;
  }
  lru_.push_front(key);
  stats_.bytes += page->bytes();
  map_[key] = Entry{std::move(page), lru_.begin(), prefetched, wire_bytes};
}

PageCacheStats PageCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace ctxcache::client::internal
