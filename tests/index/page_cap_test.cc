#include <gtest/gtest.h>

#include <random>
#include <set>

#include "index/page_table.h"

namespace ctxcache::index {
namespace {

TEST(CapSelectedPagesTest, KeepsTheDensestPagesPlusSinkAndRecent) {
  // 10 pages of 4 tokens. Page 5 has 3 selected tokens, page 2 has 2, page 7 has 1.
  std::vector<std::vector<int32_t>> sel = {{8, 9, 20, 21, 22, 28}, {20, 29}};
  auto out = CapSelectedPages(sel, 4, 40, 2, /*recent_blocks=*/1);
  ASSERT_TRUE(out.ok());
  // Kept: page 0, pages 8-9 (recent), page 5 (4 selections), page 7 (2: tokens 28, 29)
  // beats page 2 (2 selections) on the tie by being later.
  EXPECT_EQ((*out)[0], (std::vector<int32_t>{20, 21, 22, 28}));
  EXPECT_EQ((*out)[1], (std::vector<int32_t>{20, 29}));
}

TEST(CapSelectedPagesTest, LogitsRankPagesByEstimatedMass) {
  // 10 pages of 4 tokens. Page 5 holds 3 selected tokens with low logits,
  // page 2 one token with a dominant logit: by mass page 2 wins the one slot,
  // by count page 5 would.
  std::vector<std::vector<int32_t>> sel = {{9, 20, 21, 22}};
  std::vector<std::vector<float>> logits = {{8.0f, 0.0f, 0.1f, 0.2f}};
  auto by_mass = CapSelectedPages(sel, 4, 40, 1, /*recent_blocks=*/0, &logits);
  ASSERT_TRUE(by_mass.ok());
  EXPECT_EQ((*by_mass)[0], (std::vector<int32_t>{9}));
  auto by_count = CapSelectedPages(sel, 4, 40, 1, 0);
  ASSERT_TRUE(by_count.ok());
  EXPECT_EQ((*by_count)[0], (std::vector<int32_t>{20, 21, 22}));
  // Logits that do not cover every head's selection fall back to counts.
  std::vector<std::vector<float>> partial = {{8.0f}};
  auto fallback = CapSelectedPages(sel, 4, 40, 1, 0, &partial);
  ASSERT_TRUE(fallback.ok());
  EXPECT_EQ((*fallback)[0], (std::vector<int32_t>{20, 21, 22}));
}

TEST(CapSelectedPagesTest, MaxRanksByTheBestHeadsLogit) {
  // 10 pages of 4 tokens, one slot. Head 0 puts three tokens of moderate
  // logit in page 5 (most votes, most summed mass); head 1 gives page 2 the
  // single best logit. By max page 2 wins, by votes and by mass page 5.
  std::vector<std::vector<int32_t>> sel = {{20, 21, 22}, {9, 20}};
  std::vector<std::vector<float>> logits = {{2.0f, 2.0f, 2.0f}, {3.0f, 2.9f}};
  auto by_max = CapSelectedPages(sel, 4, 40, 1, 0, &logits, PageRank::kMax);
  ASSERT_TRUE(by_max.ok());
  EXPECT_EQ((*by_max)[0], (std::vector<int32_t>{}));
  EXPECT_EQ((*by_max)[1], (std::vector<int32_t>{9}));
  auto by_mass = CapSelectedPages(sel, 4, 40, 1, 0, &logits, PageRank::kMass);
  ASSERT_TRUE(by_mass.ok());
  EXPECT_EQ((*by_mass)[1], (std::vector<int32_t>{20}));
  auto by_votes = CapSelectedPages(sel, 4, 40, 1, 0, &logits, PageRank::kVotes);
  ASSERT_TRUE(by_votes.ok());
  EXPECT_EQ((*by_votes)[0], (std::vector<int32_t>{20, 21, 22}));
  // No logits: max falls back to votes.
  auto fallback = CapSelectedPages(sel, 4, 40, 1, 0, nullptr, PageRank::kMax);
  ASSERT_TRUE(fallback.ok());
  EXPECT_EQ((*fallback)[0], (std::vector<int32_t>{20, 21, 22}));
}

TEST(CapSelectedPagesTest, PropertyBoundedPagesAndSubsetOfInput) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t n = 1 + rng() % 2000;
    const int page = 16;
    const int64_t max_pages = 1 + rng() % 20;
    std::vector<std::vector<int32_t>> sel(4);
    for (auto& s : sel) {
      std::set<int32_t> ids;
      for (int i = 0; i < 100; ++i) ids.insert(static_cast<int32_t>(rng() % n));
      s.assign(ids.begin(), ids.end());
    }
    auto out = CapSelectedPages(sel, page, n, max_pages, 1);
    ASSERT_TRUE(out.ok());
    std::set<int32_t> pages;
    for (size_t h = 0; h < sel.size(); ++h) {
      std::set<int32_t> in(sel[h].begin(), sel[h].end());
      for (int32_t id : (*out)[h]) {
        EXPECT_TRUE(in.count(id));
        pages.insert(id / page);
      }
    }
    const int64_t n_pages = (n + page - 1) / page;
    std::set<int32_t> forced = {0};
    for (int64_t p = std::max<int64_t>(0, n_pages - 2); p < n_pages; ++p) forced.insert(p);
    int64_t extra = 0;
    for (int32_t p : pages) extra += forced.count(p) ? 0 : 1;
    EXPECT_LE(extra, max_pages);
  }
}

TEST(CapSelectedPagesTest, BadParameters) {
  EXPECT_EQ(CapSelectedPages({{1}}, 16, 10, 0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CapSelectedPages({{1}}, 0, 10, 1, 1).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::index
