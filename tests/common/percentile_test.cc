#include "common/percentile.h"

#include <gtest/gtest.h>

#include <vector>

namespace ctxcache {
namespace {

TEST(PercentileTest, EmptyIsZero) { EXPECT_EQ(Percentile({}, 0.5), 0.0); }

TEST(PercentileTest, NearestRankRoundsHalfUp) {
  // Unsorted on purpose: Percentile sorts its copy.
  const std::vector<double> v = {4, 1, 3, 2};
  EXPECT_EQ(Percentile(v, 0.0), 1.0);
  EXPECT_EQ(Percentile(v, 0.5), 3.0);  // index round(1.5) = 2: the upper middle
  EXPECT_EQ(Percentile(v, 0.99), 4.0);
  EXPECT_EQ(Percentile(v, 1.0), 4.0);
  EXPECT_EQ(v[0], 4.0);  // the caller's vector is untouched
}

TEST(PercentileTest, P99Of100) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);
  EXPECT_EQ(Percentile(v, 0.5), 51.0);   // index round(49.5) = 50
  EXPECT_EQ(Percentile(v, 0.99), 99.0);  // index round(98.01) = 98
}

}  // namespace
}  // namespace ctxcache
