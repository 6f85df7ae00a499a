// Prefetcher: runs a client-mode session's prefetch jobs in FIFO order on one
// background thread, started lazily, and tracks the jobs queued or running
// per layer so a Step of layer l can wait for the ones of its layer.
//
// Thread-safety: safe for concurrent use. The job function runs on the
// prefetch thread; the session guarantees (by waiting) that the state a job
// reads does not change under it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "client/sdk/page_cache.h"
#include "common/status.h"

namespace ctxcache::client::internal {

class Prefetcher {
 public:
  struct Job {
    uint32_t layer = 0;
    std::vector<float> queries;  // empty for query-independent methods
  };
  using RunFn = std::function<Status(const Job&)>;

  // stats: the page cache whose counters record prefetch_requests,
  // prefetch_failures and prefetch_wait_seconds (not owned).
  Prefetcher(uint32_t n_layers, RunFn run, PageCache* stats);
  ~Prefetcher();  // Stop()

  // Queues a job; false once stopped.
  bool Enqueue(Job job);
  // Whether a job of `layer` is queued or running.
  bool Pending(uint32_t layer) const;
  // Waits until no job of `layer` (all layers when layer < 0) is queued or
  // running; the wait counts in prefetch_wait_seconds.
  void Wait(int64_t layer);
  // Drops queued jobs, lets the running one finish, joins the thread.
  void Stop();
  bool stopped() const;

 private:
  void Loop();

  const RunFn run_;
  PageCache* stats_;
  mutable std::mutex mu_;
  std::condition_variable cv_;       // a job was queued, or stop
  std::condition_variable done_cv_;  // a job finished
  std::deque<Job> queue_;            // guarded by mu_
  std::vector<int> pending_;         // per layer: queued + running; guarded by mu_
  int total_ = 0;                    // guarded by mu_
  bool stop_ = false;                // guarded by mu_
  std::thread thread_;
};

}  // namespace ctxcache::client::internal
