#include "common/clock.h"

#include <gtest/gtest.h>

#include <chrono>

namespace ctxcache {
namespace {

TEST(ClockTest, WallIsTheUnixEpochClock) {
  const int64_t before = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const int64_t now = WallNowMs();
  EXPECT_GE(now, before);
  EXPECT_LT(now - before, 60'000);
  EXPECT_GE(Clock::System()->NowMillis(), now);
  EXPECT_EQ(Clock::System(), Clock::System());
}

TEST(ClockTest, SteadyNeverGoesBack) {
  int64_t last = SteadyNowMs();
  for (int i = 0; i < 1000; ++i) {
    const int64_t now = SteadyNowMs();
    EXPECT_GE(now, last);
    last = now;
  }
}

TEST(ClockTest, ManualClockMovesOnlyWhenTold) {
  ManualClock clock(1000);
  EXPECT_EQ(clock.NowMillis(), 1000);
  clock.Advance(250);
  EXPECT_EQ(clock.NowMillis(), 1250);
  clock.Set(10);
  EXPECT_EQ(clock.NowMillis(), 10);
}

}  // namespace
}  // namespace ctxcache
