#include "common/clock.h"

#include <chrono>

namespace ctxcache {

int64_t WallNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Clock* Clock::System() {
  class SystemClock : public Clock {
   public:
    int64_t NowMillis() const override { return WallNowMs(); }
  };
  static SystemClock* clock = new SystemClock();
  return clock;
}

}  // namespace ctxcache
