#include "index/quest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/dtype.h"

namespace ctxcache::index {
namespace {

std::vector<float> RandomMatrix(int64_t rows, int d, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> m(rows * d);
  for (float& x : m) x = nd(rng);
  return m;
}

float Dot(const float* a, const float* b, int d) {
  float s = 0;
  for (int j = 0; j < d; ++j) s += a[j] * b[j];
  return s;
}

TEST(QuestTest, PageScoreIsAnUpperBound) {
  const int d = 32;
  const int64_t n = 1000;  // last page partial
  auto keys = RandomMatrix(n, d, 1, 2.0f);
  for (int page : {1, 7, 16}) {
    QuestOptions o;
    o.page_size = page;
    auto sel = QuestSelector::Build(keys.data(), n, d, o);
    ASSERT_TRUE(sel.ok());
    auto queries = RandomMatrix(50, d, 2 + page, 1.5f);
    int64_t tight = 0;
    for (int qi = 0; qi < 50; ++qi) {
      const float* q = queries.data() + qi * d;
      for (int64_t p = 0; p < (*sel)->n_pages(); ++p) {
        const float bound = (*sel)->PageScore(q, p);
        float best = -1e30f;
        for (int64_t i = p * page; i < std::min<int64_t>(n, (p + 1) * page); ++i) {
          const float s = Dot(q, keys.data() + i * d, d);
          ASSERT_LE(s, bound + 1e-4f * (1 + std::abs(bound))) << "page " << p << " token " << i;
          best = std::max(best, s);
        }
        if (page == 1 && std::abs(best - bound) < 1e-3f) ++tight;
      }
    }
    // With one token per page the bound is exact.
    if (page == 1) {
      EXPECT_EQ(tight, 50 * n);
    }
  }
}

TEST(QuestTest, SelectsTopPagesWithinBudget) {
  const int d = 16;
  const int64_t n = 640;  // 40 pages
  auto keys = RandomMatrix(n, d, 3, 0.1f);
  std::vector<float> q(d, 0.0f);
  q[0] = 1.0f;
  // Plant large-q·k keys in pages 3 and 30.
  keys[(3 * 16 + 5) * d + 0] = 50.0f;
  keys[(30 * 16 + 9) * d + 0] = 40.0f;
  auto sel = QuestSelector::Build(keys.data(), n, d, QuestOptions{});
  ASSERT_TRUE(sel.ok());
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 1;
  in.budget = 40;  // room for two full pages only
  Selection out;
  WorkStats st;
  ASSERT_TRUE((*sel)->Select(in, &out, &st).ok());
  ASSERT_EQ(out.per_head[0].size(), 32u);
  EXPECT_EQ(out.per_head[0].front(), 3 * 16);
  EXPECT_EQ(out.per_head[0].back(), 30 * 16 + 15);
  EXPECT_EQ(out.merged, out.per_head[0]);
  EXPECT_EQ(st.entries_touched, 40u);
  EXPECT_EQ(st.keys_scored, 0u);
  EXPECT_TRUE(out.per_head_logits.empty());  // only on request
  // Default budget: rho = 5% of 640 = 32 tokens = 2 pages.
  in.budget = 0;
  ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
  EXPECT_EQ(out.per_head[0].size(), 32u);
}

TEST(QuestTest, LogitsOnRequestAreThePageBoundScaled) {
  const int d = 16;
  const int64_t n = 333;  // last page partial
  auto keys = RandomMatrix(n, d, 11, 1.0f);
  auto queries = RandomMatrix(2, d, 12, 1.0f);
  auto sel = QuestSelector::Build(keys.data(), n, d, QuestOptions{});
  ASSERT_TRUE(sel.ok());
  SelectInput in;
  in.queries = queries.data();
  in.n_queries = 2;
  in.budget = 100;
  in.want_logits = true;
  Selection out;
  ASSERT_TRUE((*sel)->Select(in, &out, nullptr).ok());
  ASSERT_EQ(out.per_head_logits.size(), 2u);
  for (int h = 0; h < 2; ++h) {
    ASSERT_EQ(out.per_head_logits[h].size(), out.per_head[h].size());
    for (size_t i = 0; i < out.per_head[h].size(); ++i) {
      const int64_t page = out.per_head[h][i] / 16;
      EXPECT_FLOAT_EQ(out.per_head_logits[h][i],
                      (*sel)->PageScore(queries.data() + h * d, page) / std::sqrt(16.0f));
    }
  }
}

TEST(QuestTest, AppendMatchesRebuildAndRoundTrips) {
  const int d = 8;
  const int64_t n = 100;
  auto keys = RandomMatrix(n + 37, d, 4);
  auto built = QuestSelector::Build(keys.data(), n, d, QuestOptions{});
  ASSERT_TRUE(built.ok());
  for (int64_t i = n; i < n + 37; ++i) {
    ASSERT_TRUE((*built)->Append(keys.data() + i * d, nullptr, nullptr).ok());
  }
  auto full = QuestSelector::Build(keys.data(), n + 37, d, QuestOptions{});
  ASSERT_TRUE(full.ok());
  std::string a, b;
  ASSERT_TRUE((*built)->Serialize(&a).ok());
  ASSERT_TRUE((*full)->Serialize(&b).ok());
  EXPECT_EQ(a, b);
  auto loaded = LoadQuestSelector(a);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->n_tokens(), n + 37);
  std::string c;
  ASSERT_TRUE((*loaded)->Serialize(&c).ok());
  EXPECT_EQ(a, c);
  auto q = RandomMatrix(2, d, 9);
  SelectInput in;
  in.queries = q.data();
  in.n_queries = 2;
  in.budget = 20;
  Selection s1, s2;
  ASSERT_TRUE((*full)->Select(in, &s1, nullptr).ok());
  ASSERT_TRUE((*loaded)->Select(in, &s2, nullptr).ok());
  EXPECT_EQ(s1.per_head, s2.per_head);
  // Corrupt artifacts.
  EXPECT_EQ(LoadQuestSelector(a.substr(0, a.size() - 1)).status().code(), StatusCode::kDataLoss);
  std::string bad_version = a;
  bad_version[4] = 9;
  EXPECT_EQ(LoadQuestSelector(bad_version).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadQuestSelector("XXXX").status().code(), StatusCode::kInvalidArgument);
}

// Build computes each page's bounds in one pass: the same artifact as
// appending every key to an empty selector, at page multiples and between.
TEST(QuestTest, BuildEqualsAppendingEveryKey) {
  const int d = 8;
  auto keys = RandomMatrix(100, d, 5);
  for (int64_t n : {0, 1, 15, 16, 17, 32, 100}) {
    auto built = QuestSelector::Build(keys.data(), n, d, QuestOptions{});
    ASSERT_TRUE(built.ok());
    auto grown = QuestSelector::Build(keys.data(), 0, d, QuestOptions{});
    ASSERT_TRUE(grown.ok());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE((*grown)->Append(keys.data() + i * d, nullptr, nullptr).ok());
    }
    std::string a, b;
    ASSERT_TRUE((*built)->Serialize(&a).ok());
    ASSERT_TRUE((*grown)->Serialize(&b).ok());
    EXPECT_EQ(a, b) << "n " << n;
    EXPECT_EQ((*built)->n_pages(), (n + 15) / 16);
  }
}

// Keys that are bf16 values (as stored KV is) give version 2, bounds as bf16:
// the same selections as version 1 from the same keys, in half the payload.
// Keys that are not stay version 1. Both load; a truncated version 2 is
// DATA_LOSS.
TEST(QuestTest, Bf16KeysSerializeAsVersion2WithTheSameBounds) {
  const int d = 16;
  const int64_t n = 200;  // last page partial
  auto keys = RandomMatrix(n, d, 11);
  auto rounded = keys;
  for (float& x : rounded) x = Bf16ToFloat(FloatToBf16(x));
  auto f32 = QuestSelector::Build(keys.data(), n, d, QuestOptions{});
  auto b16 = QuestSelector::Build(rounded.data(), n, d, QuestOptions{});
  ASSERT_TRUE(f32.ok() && b16.ok());
  std::string v1, v2;
  ASSERT_TRUE((*f32)->Serialize(&v1).ok());
  ASSERT_TRUE((*b16)->Serialize(&v2).ok());
  const size_t pages = (n + 15) / 16;
  EXPECT_EQ(v1[4], 1);
  EXPECT_EQ(v2[4], 2);
  EXPECT_EQ(v1.size(), 32 + 8 * pages * d);
  EXPECT_EQ(v2.size(), 32 + 4 * pages * d);
  auto loaded = QuestSelector::Load(v2);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  for (int64_t p = 0; p < static_cast<int64_t>(pages); ++p) {
    for (int j = 0; j < d; ++j) {
      std::vector<float> q(d, 0.0f);
      q[j] = 1.0f;  // the page's max in dim j
      EXPECT_EQ((*loaded)->PageScore(q.data(), p), (*b16)->PageScore(q.data(), p));
      q[j] = -1.0f;  // minus its min
      EXPECT_EQ((*loaded)->PageScore(q.data(), p), (*b16)->PageScore(q.data(), p));
    }
  }
  std::string again;
  ASSERT_TRUE((*loaded)->Serialize(&again).ok());
  EXPECT_EQ(again, v2);
  EXPECT_TRUE(QuestSelector::Load(v1).ok());
  EXPECT_EQ(QuestSelector::Load(v2.substr(0, v2.size() - 2)).status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(QuestSelector::Load(v2 + "xx").status().code(), StatusCode::kDataLoss);
}

TEST(QuestTest, BadParameters) {
  auto keys = RandomMatrix(32, 4, 5);
  HeadPrefill p;
  p.n_tokens = 32;
  p.head_dim = 4;
  p.keys = keys.data();
  EXPECT_TRUE(BuildQuestSelector(p, {{"page", "8"}, {"rho", "0.1"}}).ok());
  EXPECT_EQ(BuildQuestSelector(p, {{"page", "0"}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildQuestSelector(p, {{"rho", "2"}}).status().code(), StatusCode::kInvalidArgument);
  auto unknown = BuildQuestSelector(p, {{"pages", "8"}});
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("pages"), std::string_view::npos);
  p.keys = nullptr;
  EXPECT_EQ(BuildQuestSelector(p, {}).status().code(), StatusCode::kInvalidArgument);
  auto sel = QuestSelector::Build(keys.data(), 32, 4, QuestOptions{});
  ASSERT_TRUE(sel.ok());
  Selection out;
  SelectInput in;  // no queries
  EXPECT_EQ((*sel)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);
  std::vector<float> q(4, 1.0f);
  in.queries = q.data();
  in.n_queries = 1;
  in.budget = -1;
  EXPECT_EQ((*sel)->Select(in, &out, nullptr).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::index
