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

EvictionPolicyOptions Opts(uint64_t capacity, double high, double low) {
  EvictionPolicyOptions o;
  o.capacity_bytes = capacity;
  o.high_watermark = high;
  o.low_watermark = low;
  return o;
}

std::vector<ContextId> Ids(const std::vector<EvictionDecision>& d) {
  std::vector<ContextId> out;
  for (auto& x : d) out.push_back(x.id);
  return out;
}

TEST(EvictionPolicyTest, NothingBelowHighWatermark) {
  EvictionPolicyOptions o = Opts(1000, 0.9, 0.5);
  auto d = SelectEvictionVictims(o, {C(1, 400, 1), C(2, 400, 2)}, 100);  // 80%
  EXPECT_TRUE(d.empty());
}

TEST(EvictionPolicyTest, LruDownToLowWatermark) {
  EvictionPolicyOptions o = Opts(1000, 0.9, 0.5);
  auto d = SelectEvictionVictims(o, {C(1, 300, 30), C(2, 300, 10), C(3, 300, 20), C(4, 100, 5)},
                                 100);  // 100% used
  // Oldest first: 4 (5), 2 (10), 3 (20) -> used 300 <= 500.
  EXPECT_EQ(Ids(d), (std::vector<ContextId>{Id(4), Id(2), Id(3)}));
  for (auto& x : d) EXPECT_EQ(x.reason, EvictionReason::kCapacity);
}

TEST(EvictionPolicyTest, PinnedNeverEvicted) {
  EvictionPolicyOptions o = Opts(1000, 0.5, 0.1);
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
  EvictionPolicyOptions o = Opts(1000, 0.9, 0.05);
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
  EvictionPolicyOptions o = Opts(1000, 0.9, 0.5);
  auto a = C(1, 800, 1);
  a.leased = true;
  auto d = SelectEvictionVictims(o, {a, C(2, 200, 9)}, 100);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].id, Id(1));
  EXPECT_TRUE(d[0].deferred);
}

}  // namespace
}  // namespace ctxcache::storage

namespace ctxcache::storage {
namespace {

EvictionCandidate T(uint8_t n, const char* tenant, uint64_t bytes, int64_t last_access) {
  EvictionCandidate c = C(n, bytes, last_access);
  c.tenant = tenant;
  return c;
}

// A tenant within its share is not evicted to make room for one over it,
// even when its contexts are older.
TEST(EvictionPolicyTest, TenantWithinItsShareIsNotEvictedForOneOverIt) {
  EvictionPolicyOptions o = Opts(1000, 0.9, 0.7);
  o.tenant_share_bytes = {{"small", 300}, {"big", 500}};
  // small: 200 bytes, oldest; big: 800 bytes (over its 500), newer.
  auto d = SelectEvictionVictims(
      o, {T(1, "small", 100, 1), T(2, "small", 100, 2), T(3, "big", 400, 10), T(4, "big", 400, 11)},
      100);
  // 1000 used -> target 700: one of big's (its LRU) suffices.
  EXPECT_EQ(Ids(d), (std::vector<ContextId>{Id(3)}));
  // Without shares, plain LRU would have taken small's first.
  EvictionPolicyOptions plain = Opts(1000, 0.9, 0.7);
  plain.default_tenant_share_bytes = 1000;
  auto lru = SelectEvictionVictims(
      plain,
      {T(1, "small", 100, 1), T(2, "small", 100, 2), T(3, "big", 400, 10), T(4, "big", 400, 11)},
      100);
  EXPECT_EQ(Ids(lru), (std::vector<ContextId>{Id(1), Id(2), Id(3)}));
}

TEST(EvictionPolicyTest, UnlistedTenantsGetAnEqualSplitAndLruIsTheFallback) {
  EvictionPolicyOptions o = Opts(1000, 0.9, 0.3);
  // Two tenants: equal split = 500 each. a (600) is over, b (400) is not.
  auto d = SelectEvictionVictims(
      o, {T(1, "b", 200, 1), T(2, "b", 200, 2), T(3, "a", 300, 5), T(4, "a", 300, 6)}, 100);
  // a's oldest first (a drops to 300, within its share), then plain LRU
  // until 300: b's 1 and 2 (a left at 300 <= 300? used = 1000-300-200-200 = 300).
  EXPECT_EQ(Ids(d), (std::vector<ContextId>{Id(3), Id(1), Id(2)}));
}

}  // namespace
}  // namespace ctxcache::storage
