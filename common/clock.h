// The process's clocks, in milliseconds, and the clock interface that lets
// TTL and LRU tests move time without sleeping.
//
//   WallNowMs()    since the Unix epoch (std::chrono::system_clock): for times
//                  stored or compared across processes (expiry, tombstones,
//                  event stamps). May jump when the host's time is set.
//   SteadyNowMs()  monotonic (std::chrono::steady_clock), from an unspecified
//                  epoch: for intervals within one process (idle timeouts,
//                  rate windows, reload checks). Never compare it across
//                  processes.
//   Clock          the wall clock behind an interface; Clock::System() is
//                  WallNowMs, ManualClock moves only when told to.
//
// Thread-safety: every function and class here is safe for concurrent use.
#pragma once

#include <atomic>
#include <cstdint>

namespace ctxcache {

int64_t WallNowMs();
int64_t SteadyNowMs();

class Clock {
 public:
  virtual ~Clock() = default;
  // Milliseconds since the Unix epoch.
  virtual int64_t NowMillis() const = 0;
  // The process-wide wall clock, WallNowMs (never null, never freed).
  static Clock* System();
};

// A clock that only moves when told to.
class ManualClock : public Clock {
 public:
  explicit ManualClock(int64_t start_ms = 1'700'000'000'000) : now_ms_(start_ms) {}
  int64_t NowMillis() const override { return now_ms_.load(std::memory_order_relaxed); }
  void Advance(int64_t ms) { now_ms_.fetch_add(ms, std::memory_order_relaxed); }
  void Set(int64_t ms) { now_ms_.store(ms, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> now_ms_;
};

}  // namespace ctxcache
