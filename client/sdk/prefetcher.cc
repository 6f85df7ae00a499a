#include "client/sdk/prefetcher.h"

#include <chrono>

namespace ctxcache::client::internal {

Prefetcher::Prefetcher(uint32_t n_layers, RunFn run, PageCache* stats)
    : run_(std::move(run)), stats_(stats), pending_(n_layers, 0) {}

Prefetcher::~Prefetcher() { Stop(); }

bool Prefetcher::Enqueue(Job job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_ || job.layer >= pending_.size()) return false;
  pending_[job.layer]++;
  total_++;
  queue_.push_back(std::move(job));
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  cv_.notify_one();
  return true;
}

bool Prefetcher::Pending(uint32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layer < pending_.size() && pending_[layer] > 0;
}

bool Prefetcher::stopped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_;
}

void Prefetcher::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping
    Job job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    const Status s = run_(job);
    stats_->UpdateStats([&](PageCacheStats* st) {
      st->prefetch_requests++;
      if (!s.ok()) st->prefetch_failures++;
    });
    lock.lock();
    pending_[job.layer]--;
    total_--;
    done_cv_.notify_all();
  }
}

void Prefetcher::Wait(int64_t layer) {
  std::unique_lock<std::mutex> lock(mu_);
  auto idle = [&] {
    return layer < 0 ? total_ == 0
                     : static_cast<size_t>(layer) >= pending_.size() || pending_[layer] == 0;
  };
  if (idle()) return;
  const auto t0 = std::chrono::steady_clock::now();
  done_cv_.wait(lock, idle);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  lock.unlock();
  stats_->UpdateStats([&](PageCacheStats* st) { st->prefetch_wait_seconds += waited; });
}

void Prefetcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    // Queued jobs are dropped; the running one finishes (its FetchPages has
    // the client's deadline).
    for (const auto& job : queue_) {
      pending_[job.layer]--;
      total_--;
    }
    queue_.clear();
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace ctxcache::client::internal
