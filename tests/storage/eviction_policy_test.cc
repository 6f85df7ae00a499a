#include "storage/eviction_policy.h"

#include <gtest/gtest.h>

#include <vector>

namespace ctxcache::storage {
namespace {

ContextId Id(uint8_t n) {
  ContextId id;
  id.bytes[0] = n;
  return id;
}

EvictionCandidate C(uint8_t n, uint64_t bytes, int64_t last_access) {
  EvictionCandidate c;
  c.id = Id(n);
  c.bytes = bytes;
  c.last_access_ms = last_access;
  return c;
}

std::vector<ContextId> Ids(const std::vector<EvictionDecision>& d) {
  std::vector<ContextId> out;
  for (auto& x : d) out.push_back(x.id);
  return out;
}

TEST(EvictionPolicyTest, NothingBelowHighWatermark) {
  EvictionPolicyOptions o{1000, 0.9, 0.5};
  auto d = SelectEvictionVictims(o, {C(1, 400, 1), C(2, 400, 2)}, 100);  // 80%
  EXPECT_TRUE(d.empty());
}

TEST(EvictionPolicyTest, LruDownToLowWatermark) {
  EvictionPolicyOptions o{1000, 0.9, 0.5};
  auto d = SelectEvictionVictims(o, {C(1, 300, 30), C(2, 300, 10), C(3, 300, 20), C(4, 100, 5)},
                                 100);  // 100% used
  // Oldest first: 4 (5), 2 (10), 3 (20) -> used 300 <= 500.
  EXPECT_EQ(Ids(d), (std::vector<ContextId>{Id(4), Id(2), Id(3)}));
  for (auto& x : d) EXPECT_EQ(x.reason, EvictionReason::kCapacity);
}

TEST(EvictionPolicyTest, PinnedNeverEvicted) {
  EvictionPolicyOptions o{1000, 0.5, 0.1};
  auto a = C(1, 600, 1);
  a.pinned = true;
  a.expires_at_ms = 5;
  auto d = SelectEvictionVictims(o, {a, C(2, 300, 2)}, 100);
  EXPECT_EQ(Ids(d), std::vector<ContextId>{Id(2)});
}

TEST(EvictionPolicyTest, TtlWithoutCapacityPressure) {
  EvictionPolicyOptions o;  // unlimited
  auto a = C(1, 10, 1);
  a.expires_at_ms = 50;
  auto b = C(2, 10, 1);
  b.expires_at_ms = 500;
  auto d = SelectEvictionVictims(o, {a, b}, 100);
  ASSERT_EQ(Ids(d), std::vector<ContextId>{Id(1)});
  EXPECT_EQ(d[0].reason, EvictionReason::kExpired);
}

TEST(EvictionPolicyTest, ParentOnlyAfterItsChildren) {
  EvictionPolicyOptions o{1000, 0.9, 0.05};
  auto parent = C(1, 500, 1);  // oldest
  parent.children = 1;
  auto child = C(2, 300, 50);
  child.parent = Id(1);
  auto other = C(3, 200, 10);
  auto d = SelectEvictionVictims(o, {parent, child, other}, 100);
  // other (10) first; then child (parent ineligible); then parent.
  EXPECT_EQ(Ids(d), (std::vector<ContextId>{Id(3), Id(2), Id(1)}));
}

TEST(EvictionPolicyTest, LeasedVictimIsDeferred) {
  EvictionPolicyOptions o{1000, 0.9, 0.5};
  auto a = C(1, 800, 1);
  a.leased = true;
  auto d = SelectEvictionVictims(o, {a, C(2, 200, 9)}, 100);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].id, Id(1));
  EXPECT_TRUE(d[0].deferred);
}

}  // namespace
}  // namespace ctxcache::storage
