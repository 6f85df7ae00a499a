#include "service/shm_cache.h"

#include <fcntl.h>
#include <unistd.h>

namespace ctxcache::service {

ShmCache::~ShmCache() {
  for (Entry& e : lru_) close(e.fd);
}

std::string ShmCache::Key(const std::string& context_hex, int64_t created_at_ms,
                          const std::vector<uint32_t>& layers) {
  std::string key = context_hex + "@" + std::to_string(created_at_ms) + ":";
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0) key += ",";
    key += std::to_string(layers[i]);
  }
  return key;
}

int ShmCache::Lookup(const std::string& key) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return -1;
  lru_.splice(lru_.begin(), lru_, it->second);
  return fcntl(it->second->fd, F_DUPFD_CLOEXEC, 0);
}

bool ShmCache::Insert(const std::string& key, int fd, uint64_t size) {
  if (size > budget_) {
    close(fd);
    return false;
  }
  std::lock_guard<std::mutex> l(mu_);
  if (auto it = by_key_.find(key); it != by_key_.end()) EraseLocked(it->second);
  while (bytes_ + size > budget_ && !lru_.empty()) EraseLocked(std::prev(lru_.end()));
  lru_.push_front(Entry{key, fd, size});
  by_key_[key] = lru_.begin();
  bytes_ += size;
  return true;
}

uint64_t ShmCache::DropContext(const std::string& context_hex) {
  const std::string prefix = context_hex + "@";
  std::lock_guard<std::mutex> l(mu_);
  uint64_t freed = 0;
  for (auto it = by_key_.lower_bound(prefix);
       it != by_key_.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
    auto next = std::next(it);
    freed += it->second->size;
    EraseLocked(it->second);
    it = next;
  }
  return freed;
}

void ShmCache::EraseLocked(std::list<Entry>::iterator it) {
  close(it->fd);
  bytes_ -= it->size;
  by_key_.erase(it->key);
  lru_.erase(it);
}

uint64_t ShmCache::bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_;
}

size_t ShmCache::entries() const {
  std::lock_guard<std::mutex> l(mu_);
  return lru_.size();
}

}  // namespace ctxcache::service
