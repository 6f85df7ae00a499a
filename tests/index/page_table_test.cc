#include "index/page_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

namespace ctxcache::index {
namespace {

// Brute-force checks of the two properties (CompactAttention §3.2).
void CheckTables(const std::vector<std::vector<int32_t>>& sel, const std::vector<PageTable>& t,
                 int sg, int B, int64_t n, int recent) {
  const int G = static_cast<int>(sel.size());
  const int64_t n_pages = (n + B - 1) / B;
  const int eff = std::min(sg, G);
  ASSERT_EQ(static_cast<int>(t.size()), (G + eff - 1) / eff);
  std::vector<int> seen_heads(G, 0);
  for (const PageTable& table : t) {
    ASSERT_LE(static_cast<int>(table.q_heads.size()), eff);
    ASSERT_TRUE(std::is_sorted(table.pages.begin(), table.pages.end()));
    ASSERT_EQ(std::adjacent_find(table.pages.begin(), table.pages.end()), table.pages.end());
    std::set<int32_t> needed;
    std::set<int32_t> tokens;
    for (int h : table.q_heads) {
      ++seen_heads[h];
      for (int32_t id : sel[h]) {
        needed.insert(id / B);
        tokens.insert(id);
      }
    }
    for (int64_t p = std::max<int64_t>(0, n_pages - 1 - recent); p < n_pages; ++p) {
      needed.insert(static_cast<int32_t>(p));
    }
    // Coverage: every selected token's page is present; minimal: nothing else.
    std::set<int32_t> got(table.pages.begin(), table.pages.end());
    EXPECT_EQ(got, needed);
    EXPECT_EQ(table.selected_tokens, static_cast<int64_t>(tokens.size()));
    int64_t fetched = 0;
    for (int32_t p : table.pages) fetched += std::min<int64_t>(B, n - int64_t{p} * B);
    EXPECT_EQ(table.fetched_tokens, fetched);
    EXPECT_LE(table.selected_tokens, table.fetched_tokens);
  }
  for (int h = 0; h < G; ++h) EXPECT_EQ(seen_heads[h], 1) << "head " << h;
}

TEST(PageTableTest, PropertyRandomSelections) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int G = 1 + static_cast<int>(rng() % 8);
    const int sg = 1 + static_cast<int>(rng() % 5);
    const int B = 1 + static_cast<int>(rng() % 32);
    const int64_t n = 1 + static_cast<int64_t>(rng() % 3000);
    const int recent = static_cast<int>(rng() % 3);
    std::vector<std::vector<int32_t>> sel(G);
    for (auto& s : sel) {
      const int k = static_cast<int>(rng() % 200);
      // Clustered ids (as real selections are) plus uniform ones, with duplicates.
      const int32_t centre = static_cast<int32_t>(rng() % n);
      for (int i = 0; i < k; ++i) {
        const int32_t id =
            (i % 2 == 0)
                ? static_cast<int32_t>(rng() % n)
                : std::clamp<int32_t>(centre + static_cast<int32_t>(rng() % 64) - 32, 0, n - 1);
        s.push_back(id);
      }
    }
    auto t = BuildPageTables(sel, G, sg, B, n, recent);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    CheckTables(sel, *t, sg, B, n, recent);
    if (HasFailure()) return;
  }
}

TEST(PageTableTest, SubgroupsAndForcedPages) {
  // G = 8, subgroups of 4: heads 0-3 and 4-7.
  std::vector<std::vector<int32_t>> sel(8);
  sel[0] = {0, 1, 2};  // page 0
  sel[5] = {40};       // page 2
  auto t = BuildPageTables(sel, 8, 4, 16, 100, /*recent_blocks=*/1);
  ASSERT_TRUE(t.ok());
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].q_heads, (std::vector<int32_t>{0, 1, 2, 3}));
  // 100 tokens = 7 pages (0..6); current page 6 and recent page 5 are forced.
  EXPECT_EQ((*t)[0].pages, (std::vector<int32_t>{0, 5, 6}));
  EXPECT_EQ((*t)[1].pages, (std::vector<int32_t>{2, 5, 6}));
  EXPECT_EQ((*t)[0].fetched_tokens, 16 + 16 + 4);
  EXPECT_EQ((*t)[0].selected_tokens, 3);
  EXPECT_DOUBLE_EQ((*t)[0].efficiency(), 3.0 / 36.0);
  EXPECT_DOUBLE_EQ(PageEfficiency(*t), 4.0 / 72.0);
  // A group smaller than the subgroup size is one subgroup.
  std::vector<std::vector<int32_t>> two = {{17}, {18, 33}};
  auto t2 = BuildPageTables(two, 2, 4, 16, 64, 0);
  ASSERT_TRUE(t2.ok());
  ASSERT_EQ(t2->size(), 1u);
  EXPECT_EQ((*t2)[0].pages, (std::vector<int32_t>{1, 2, 3}));
  // Dense selection of whole pages: efficiency 1.
  std::vector<std::vector<int32_t>> dense(1);
  for (int i = 0; i < 64; ++i) dense[0].push_back(i);
  auto t3 = BuildPageTables(dense, 1, 4, 16, 64, 1);
  ASSERT_TRUE(t3.ok());
  EXPECT_DOUBLE_EQ((*t3)[0].efficiency(), 1.0);
}

TEST(PageTableTest, BadParameters) {
  std::vector<std::vector<int32_t>> sel(2);
  EXPECT_EQ(BuildPageTables(sel, 3, 4, 16, 10, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildPageTables(sel, 2, 0, 16, 10, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildPageTables(sel, 2, 4, 0, 10, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildPageTables(sel, 2, 4, 16, 10, -1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildPageTables(sel, 2, 4, 16, -1, 1).status().code(), StatusCode::kInvalidArgument);
  sel[1] = {10};
  auto bad = BuildPageTables(sel, 2, 4, 16, 10, 1);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("per_q_head[1]"), std::string_view::npos);
  PageTableOptions o;
  sel[1] = {9};
  EXPECT_TRUE(BuildPageTables(sel, 10, o).ok());
}

}  // namespace
}  // namespace ctxcache::index
