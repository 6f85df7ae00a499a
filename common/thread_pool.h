// A fixed-size thread pool with a blocking ParallelFor.
//
// Thread-safety: Submit and ParallelFor are safe to call concurrently from any
// thread, including from inside a task (ParallelFor then runs inline to avoid
// deadlock). The destructor waits for queued tasks to finish.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ctxcache {

class ThreadPool {
 public:
  // n_threads == 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(size_t n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size(); }

  // Queues a task. Tasks must not throw.
  void Submit(std::function<void()> task);

  // Runs fn(begin, end) over [0, n) split into at most `size()` contiguous
  // ranges of at least `min_chunk` items, and waits for all of them. The
  // calling thread takes part.
  void ParallelFor(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk = 1);

  // A process-wide pool sized to the hardware, created on first use.
  static ThreadPool* Default();

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace ctxcache
