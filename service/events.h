// EventHub: fan-out of context lifecycle events to WatchContexts streams.
// Each subscriber has a bounded queue (at most 4,096 events and 4 MiB; the
// oldest are dropped beyond it, and counted) so a slow watcher never blocks
// builds nor pins memory.
//
// Thread-safety: safe for concurrent use.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>

#include "common/clock.h"
#include "ctxcache/v1/ctxcache_service.pb.h"

namespace ctxcache::service {

class EventHub {
 public:
  // Which events a subscriber receives (e.g. its tenant's); null = all.
  using Filter = std::function<bool(const v1::ContextInfo&)>;

  struct Subscriber {
    Filter filter;  // immutable after Subscribe
    std::mutex mu;
    std::condition_variable cv;
    std::deque<v1::ContextEvent> queue;  // guarded by mu
    size_t queued_bytes = 0;             // guarded by mu
    uint64_t dropped = 0;                // guarded by mu
    bool closed = false;                 // guarded by mu
  };

  std::shared_ptr<Subscriber> Subscribe(Filter filter = nullptr) {
    auto s = std::make_shared<Subscriber>();
    s->filter = std::move(filter);
    std::lock_guard<std::mutex> lock(mu_);
    subs_.push_back(s);
    return s;
  }

  void Unsubscribe(const std::shared_ptr<Subscriber>& s) {
    std::lock_guard<std::mutex> lock(mu_);
    subs_.remove(s);
  }

  void Publish(v1::ContextEvent::Type type, const v1::ContextInfo& info) {
    v1::ContextEvent ev;
    ev.set_type(type);
    *ev.mutable_context() = info;
    ev.set_at_ms(WallNowMs());
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : subs_) {
      if (s->filter && !s->filter(info)) continue;
      std::lock_guard<std::mutex> sl(s->mu);
      const size_t size = ev.ByteSizeLong();
      while (!s->queue.empty() &&
             (s->queue.size() >= kMaxQueue || s->queued_bytes + size > kMaxQueueBytes)) {
        s->queued_bytes -= s->queue.front().ByteSizeLong();
        s->queue.pop_front();
        s->dropped++;
      }
      s->queued_bytes += size;
      s->queue.push_back(ev);
      s->cv.notify_one();
    }
  }

  // Wakes every subscriber (shutdown).
  void CloseAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : subs_) {
      std::lock_guard<std::mutex> sl(s->mu);
      s->closed = true;
      s->cv.notify_all();
    }
  }

 private:
  static constexpr size_t kMaxQueue = 4096;
  static constexpr size_t kMaxQueueBytes = 4 << 20;
  std::mutex mu_;
  std::list<std::shared_ptr<Subscriber>> subs_;  // guarded by mu_
};

}  // namespace ctxcache::service
