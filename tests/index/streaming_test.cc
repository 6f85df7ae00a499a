#include "index/streaming.h"

#include <gtest/gtest.h>

namespace ctxcache::index {
namespace {

TEST(StreamingTest, SinksPlusRecentWindow) {
  auto sel = StreamingSelector::Create(100, 4, StreamingOptions{});
  ASSERT_TRUE(sel.ok());
  std::vector<float> q(8, 1.0f);
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 2;
  in.budget = 10;
  Selection out;
  WorkStats st;
  ASSERT_TRUE((*sel)->Select(in, &out, &st).ok());
  const std::vector<int32_t> want = {0, 1, 2, 3, 94, 95, 96, 97, 98, 99};
  ASSERT_EQ(out.per_head.size(), 2u);
  EXPECT_EQ(out.per_head[0], want);
  EXPECT_EQ(out.per_head[1], want);
  EXPECT_EQ(out.merged, want);
  EXPECT_EQ(st.bytes_touched, 0u);
  // Appended tokens move the window.
  ASSERT_TRUE((*sel)->Append(nullptr, nullptr, nullptr).ok());
  ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.merged.back(), 100);
  EXPECT_EQ(out.merged[4], 95);
  // Default budget: 5% of 101 -> 6 tokens; budget larger than N -> all.
  in.budget = 0;
  ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.merged, (std::vector<int32_t>{0, 1, 2, 3, 99, 100}));
  in.budget = 1000;
  ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.merged.size(), 101u);
  // Budget smaller than the sinks.
  in.budget = 2;
  ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.merged, (std::vector<int32_t>{0, 1}));
}

TEST(StreamingTest, RoundTripAndBadParameters) {
  HeadPrefill p;
  std::vector<float> keys(50 * 4, 0.5f);
  p.n_tokens = 50;
  p.head_dim = 4;
  p.keys = keys.data();
  auto sel = BuildStreamingSelector(p, {{"sink", "2"}, {"rho", "0.2"}});
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  std::string bytes;
  ASSERT_TRUE((*sel)->Serialize(&bytes).ok());
  auto loaded = LoadStreamingSelector(bytes);
  ASSERT_TRUE(loaded.ok());
  std::vector<float> q(4, 1.0f);
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 1;
  Selection a, b;
  ASSERT_TRUE((*sel)->Select(in, &a, nullptr).ok());
  ASSERT_TRUE((*loaded)->Select(in, &b, nullptr).ok());
  EXPECT_EQ(a.merged, b.merged);
  EXPECT_EQ(a.merged.size(), 10u);
  EXPECT_EQ(LoadStreamingSelector(bytes.substr(0, 10)).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(LoadStreamingSelector(bytes + "x").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(BuildStreamingSelector(p, {{"sink", "-1"}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildStreamingSelector(p, {{"rho", "0"}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildStreamingSelector(p, {{"window", "3"}}).status().code(),
            StatusCode::kInvalidArgument);
  p.n_tokens = 0;
  EXPECT_EQ(BuildStreamingSelector(p, {}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::index
