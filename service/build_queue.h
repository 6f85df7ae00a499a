// BuildQueue: admission control for builds. At most `max_running` builds run
// at once and at most `max_waiting` wait; beyond that Acquire fails with
// RESOURCE_EXHAUSTED and a retry hint.
//
// Thread-safety: safe for concurrent use.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"

namespace ctxcache::service {

class BuildQueue {
 public:
  BuildQueue(uint32_t max_running, uint32_t max_waiting)
      : max_running_(max_running), max_waiting_(max_waiting) {}

  // Blocks until a slot is free. `on_wait(position)` is called while queued
  // (position 1 = next), at most every 500 ms; `cancelled()` is polled and
  // makes Acquire return CANCELLED.
  Status Acquire(const std::function<void(uint32_t)>& on_wait,
                 const std::function<bool()>& cancelled) {
    std::unique_lock<std::mutex> lock(mu_);
    if (running_ < max_running_ && waiting_ == 0) {
      running_++;
      return Status::OK();
    }
    if (waiting_ >= max_waiting_) {
      return ResourceExhaustedError(
          "build queue is full (" + std::to_string(running_) + " running, " +
          std::to_string(waiting_) + " waiting, limit --build-queue-size=" +
          std::to_string(max_waiting_) + "); retry in a few seconds with backoff");
    }
    const uint64_t ticket = next_ticket_++;
    waiting_++;
    while (true) {
      if (running_ < max_running_ && ticket == serving_) break;
      if (cancelled && cancelled()) {
        waiting_--;
        // Keep FIFO order intact: skip this ticket.
        skipped_.push_back(ticket);
        AdvanceServing();
        cv_.notify_all();
        return CancelledError("build cancelled while queued");
      }
      if (on_wait) {
        uint32_t pos = static_cast<uint32_t>(ticket - serving_ + 1);
        lock.unlock();
        on_wait(pos);
        lock.lock();
      }
      cv_.wait_for(lock, std::chrono::milliseconds(500));
    }
    waiting_--;
    running_++;
    serving_++;
    AdvanceServing();
    cv_.notify_all();
    return Status::OK();
  }

  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    running_--;
    cv_.notify_all();
  }

  uint32_t waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_;
  }
  uint32_t running() const {
    std::lock_guard<std::mutex> lock(mu_);
    return running_;
  }

 private:
  void AdvanceServing() {
    bool moved = true;
    while (moved) {
      moved = false;
      for (auto it = skipped_.begin(); it != skipped_.end(); ++it) {
        if (*it == serving_) {
          skipped_.erase(it);
          serving_++;
          moved = true;
          break;
        }
      }
    }
  }

  const uint32_t max_running_, max_waiting_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint32_t running_ = 0;           // guarded by mu_
  uint32_t waiting_ = 0;           // guarded by mu_
  uint64_t next_ticket_ = 0;       // guarded by mu_
  uint64_t serving_ = 0;           // guarded by mu_
  std::vector<uint64_t> skipped_;  // guarded by mu_
};

}  // namespace ctxcache::service
