#include "common/thread_pool.h"

#include <algorithm>

namespace ctxcache {

namespace {
thread_local bool tls_in_pool = false;
}

ThreadPool::ThreadPool(size_t n_threads) {
  if (n_threads == 0) n_threads = std::max<size_t>(1, std::thread::hardware_concurrency());
  workers_.reserve(n_threads);
  for (size_t i = 0; i < n_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::WorkerLoop() {
  tls_in_pool = true;
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t, size_t)>& fn,
                             size_t min_chunk) {
  if (n == 0) return;
  min_chunk = std::max<size_t>(1, min_chunk);
  size_t parts = std::min(workers_.size() + 1, (n + min_chunk - 1) / min_chunk);
  if (parts <= 1 || tls_in_pool) {
    fn(0, n);
    return;
  }
  size_t chunk = (n + parts - 1) / parts;
  // `remaining` is guarded by done_mu; a worker touches the shared state only
  // while holding done_mu, so the waiter can safely return once it sees 0.
  size_t remaining = parts - 1;
  std::mutex done_mu;
  std::condition_variable done_cv;
  for (size_t p = 1; p < parts; ++p) {
    size_t begin = p * chunk;
    size_t end = std::min(n, begin + chunk);
    Submit([&, begin, end] {
      if (begin < end) fn(begin, end);
      std::lock_guard<std::mutex> lock(done_mu);
      if (--remaining == 0) done_cv.notify_one();
    });
  }
  fn(0, std::min(n, chunk));
  std::unique_lock<std::mutex> lock(done_mu);
  done_cv.wait(lock, [&] { return remaining == 0; });
}

ThreadPool* ThreadPool::Default() {
  static auto* pool = new ThreadPool(0);
  return pool;
}

}  // namespace ctxcache
