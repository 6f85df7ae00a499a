#include "cluster/etcd_mirror.h"

#include <chrono>

namespace ctxcache::cluster {

StatusOr<std::unique_ptr<EtcdMirror>> EtcdMirror::Start(EtcdClient* etcd, Options options) {
  if (options.prefix.empty()) return InvalidArgumentError("EtcdMirror: empty prefix");
  std::unique_ptr<EtcdMirror> m(new EtcdMirror(etcd, std::move(options)));
  RETURN_IF_ERROR(m->List());
  m->thread_ = std::thread([p = m.get()] { p->Loop(); });
  return m;
}

EtcdMirror::~EtcdMirror() { Stop(); }

void EtcdMirror::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  canceller_.Cancel();
  if (thread_.joinable()) thread_.join();
  connected_ = false;
}

Status EtcdMirror::List() {
  int64_t rev = 0;
  ASSIGN_OR_RETURN(auto kvs, etcd_->GetPrefix(options_.prefix, &rev));
  Map m;
  for (auto& kv : kvs) m.emplace(kv.key, std::move(kv));
  {
    std::lock_guard lock(mu_);
    map_ = std::move(m);
    revision_ = rev;
    version_++;
  }
  cv_.notify_all();
  return Status::OK();
}

void EtcdMirror::Apply(const EtcdWatchBatch& batch) {
  if (batch.created) connected_ = true;
  if (batch.events.empty()) return;
  {
    std::lock_guard lock(mu_);
    for (const auto& ev : batch.events) {
      if (ev.deleted) {
        map_.erase(ev.kv.key);
      } else {
        map_[ev.kv.key] = ev.kv;
      }
    }
    revision_ = std::max(revision_, batch.revision);
    version_++;
  }
  cv_.notify_all();
}

void EtcdMirror::Loop() {
  bool listed = true;  // Start() listed
  for (;;) {
    {
      std::unique_lock lock(mu_);
      if (stop_) return;
    }
    if (!listed) listed = List().ok();
    if (listed) {
      int64_t from;
      {
        std::lock_guard lock(mu_);
        from = revision_ + 1;
      }
      // Returns when the stream breaks (or on Stop()); either way the next
      // watch starts from a fresh list, so no change is missed or replayed.
      etcd_->Watch(options_.prefix, from, &canceller_,
                   [this](const EtcdWatchBatch& b) { Apply(b); })
          .IgnoreError();
      connected_ = false;
      listed = false;
    }
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(options_.retry_ms), [this] { return stop_; });
  }
}

EtcdMirror::Map EtcdMirror::Snapshot(uint64_t* version) const {
  std::lock_guard lock(mu_);
  if (version) *version = version_.load();
  return map_;
}

uint64_t EtcdMirror::WaitChange(uint64_t seen, int64_t timeout_ms) const {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
               [&] { return stop_ || version_.load() != seen; });
  return version_.load();
}

int64_t EtcdMirror::revision() const {
  std::lock_guard lock(mu_);
  return revision_;
}

}  // namespace ctxcache::cluster
