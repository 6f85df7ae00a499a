#include "session/session_params.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

namespace ctxcache::session {
namespace {

using index::BuildPageTables;
using index::ExpandToTablePages;
using index::PageBudget;
using index::PageRank;
using index::PageTable;

TEST(SessionParamsTest, DefaultsCapPagesAndAttendWholePagesForSparseMethods) {
  auto p = SessionParams::Parse("csa", {}, 16);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_DOUBLE_EQ(p->rho, 0.05);
  EXPECT_DOUBLE_EQ(p->page_fraction, 0.05);
  EXPECT_TRUE(p->whole_pages);
  EXPECT_EQ(p->table_options.page_size, 16);
  EXPECT_EQ(p->TokenBudget(1000), 50);
  EXPECT_EQ(p->TokenBudget(1), 1);

  auto rho = SessionParams::Parse("oracle", {{"rho", "0.1"}}, 16);
  ASSERT_TRUE(rho.ok());
  EXPECT_DOUBLE_EQ(rho->page_fraction, 0.1);
}

TEST(SessionParamsTest, RerankIsACsaSelectorOverride) {
  auto none = SessionParams::Parse("csa", {}, 16);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->selector_overrides.empty());
  auto p = SessionParams::Parse("csa", {{"rerank", "8"}, {"rho", "0.1"}}, 16);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->selector_overrides, (std::map<std::string, std::string>{{"rerank", "8"}}));
  EXPECT_TRUE(SessionParams::Parse("csa", {{"rerank", "0"}}, 16).ok());
  for (const char* bad : {"0.5", "65", "-1"}) {
    auto b = SessionParams::Parse("csa", {{"rerank", bad}}, 16);
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.status().message().find("rerank must be 0 or in [1, 64]"), std::string_view::npos);
  }
  auto quest = SessionParams::Parse("quest", {{"rerank", "4"}}, 16);
  EXPECT_EQ(quest.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(quest.status().message().find("csa only"), std::string_view::npos)
      << quest.status().ToString();
}

// `P` runs Tactic adaptively: no token budget (the selector picks one per q
// head for its target) and no default page cap; tactic only.
TEST(SessionParamsTest, TacticTargetMakesTheSessionAdaptive) {
  auto fixed = SessionParams::Parse("tactic", {{"rho", "0.05"}}, 16);
  ASSERT_TRUE(fixed.ok());
  EXPECT_FALSE(fixed->adaptive);
  EXPECT_EQ(fixed->TokenBudget(1000), 50);
  auto p = SessionParams::Parse("tactic", {{"P", "0.9"}}, 16);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->adaptive);
  EXPECT_EQ(p->TokenBudget(1000), 0);
  EXPECT_EQ(p->page_fraction, 0);
  EXPECT_FALSE(p->whole_pages);
  EXPECT_EQ(p->selector_overrides, (std::map<std::string, std::string>{{"P", "0.9"}}));
  auto capped = SessionParams::Parse("tactic", {{"P", "0.9"}, {"page_fraction", "0.1"}}, 16);
  ASSERT_TRUE(capped.ok());
  EXPECT_DOUBLE_EQ(capped->page_fraction, 0.1);
  EXPECT_TRUE(capped->whole_pages);
  EXPECT_EQ(capped->TokenBudget(1000), 0);
  for (const char* bad : {"0", "1.5"}) {
    EXPECT_EQ(SessionParams::Parse("tactic", {{"P", bad}}, 16).status().code(),
              StatusCode::kInvalidArgument)
        << bad;
  }
  auto both = SessionParams::Parse("tactic", {{"P", "0.9"}, {"budget", "100"}}, 16);
  EXPECT_EQ(both.status().code(), StatusCode::kInvalidArgument);
  auto quest = SessionParams::Parse("quest", {{"P", "0.9"}}, 16);
  EXPECT_EQ(quest.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(quest.status().message().find("tactic only"), std::string_view::npos)
      << quest.status().ToString();
}

TEST(SessionParamsTest, FullAndExplicitBudgetKeepTokenLevelPaging) {
  auto full = SessionParams::Parse("full", {}, 16);
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->page_fraction, 0);
  EXPECT_FALSE(full->whole_pages);

  auto budget = SessionParams::Parse("csa", {{"budget", "64"}}, 16);
  ASSERT_TRUE(budget.ok());
  EXPECT_EQ(budget->page_fraction, 0);
  EXPECT_FALSE(budget->whole_pages);
  EXPECT_EQ(budget->TokenBudget(1000), 64);
  EXPECT_EQ(budget->TokenBudget(10), 10);

  auto uncapped = SessionParams::Parse("csa", {{"page_fraction", "1"}}, 16);
  ASSERT_TRUE(uncapped.ok());
  EXPECT_EQ(uncapped->page_fraction, 0);
  EXPECT_FALSE(uncapped->whole_pages);

  auto forced = SessionParams::Parse("csa", {{"whole_pages", "0"}}, 16);
  ASSERT_TRUE(forced.ok());
  EXPECT_DOUBLE_EQ(forced->page_fraction, 0.05);
  EXPECT_FALSE(forced->whole_pages);
}

TEST(SessionParamsTest, BadValuesNameTheParam) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"rho", "0"},      {"rho", "1.5"},          {"rho", "x"},
      {"budget", "0"},   {"page_fraction", "0"},  {"whole_pages", "2"},
      {"subgroup", "0"}, {"recent_blocks", "-1"}, {"rho", ""},
      {"rho", "nan"},    {"estimate_mass", "2"},  {"min_budget", "-1"},
      {"page_rank", "best"}};
  for (const auto& [k, v] : bad) {
    auto p = SessionParams::Parse("csa", {{k, v}}, 16);
    ASSERT_FALSE(p.ok()) << k << "=" << v;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(k), std::string::npos) << p.status().message();
  }
  auto unknown = SessionParams::Parse("csa", {{"rhoo", "0.1"}}, 16);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("rhoo"), std::string::npos);
}

TEST(SessionParamsTest, MinBudgetFloorsTheTokenAndPageBudgets) {
  auto p = SessionParams::Parse("quest", {{"rho", "0.05"}, {"min_budget", "1024"}}, 16);
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->min_budget, 1024);
  EXPECT_EQ(p->TokenBudget(4096), 1024);    // 5% would be 205
  EXPECT_EQ(p->TokenBudget(100000), 5000);  // 5% is above the floor
  EXPECT_EQ(p->TokenBudget(500), 500);      // at most the session's tokens
  EXPECT_EQ(PageBudget(0.05, 4096, 16, 1024), 64);
  EXPECT_EQ(PageBudget(0.05, 4096, 16), 13);
  EXPECT_EQ(PageBudget(0.05, 500, 16, 1024), 32);  // all 32 pages
  auto none = SessionParams::Parse("quest", {}, 16);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->TokenBudget(4096), 205);
}

TEST(SessionParamsTest, PageRankIsAWordAndNeedsAScoringMethod) {
  for (const auto& [word, rank] : std::vector<std::pair<std::string, PageRank>>{
           {"auto", PageRank::kAuto},
           {"votes", PageRank::kVotes},
           {"mass", PageRank::kMass},
           {"max", PageRank::kMax}}) {
    auto p = SessionParams::Parse("quest", {{"page_rank", word}}, 16);
    ASSERT_TRUE(p.ok()) << word << ": " << p.status().message();
    EXPECT_EQ(p->page_rank, rank);
  }
  auto tactic = SessionParams::Parse("tactic", {{"page_rank", "max"}}, 16);
  ASSERT_FALSE(tactic.ok());
  EXPECT_EQ(tactic.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tactic.status().message().find("page_rank"), std::string::npos);
  EXPECT_TRUE(SessionParams::Parse("tactic", {{"page_rank", "votes"}}, 16).ok());
}

TEST(SessionParamsTest, WholePagesGivesEveryTokenOfTheFetchedPages) {
  // 100 tokens in pages of 16 (the last page holds 4). Head 0 selects tokens
  // in pages 0 and 2, head 1 in page 2: with a cap of 1 page, page 2 (3
  // selections) is kept besides page 0 and the recent pages 5, 6.
  std::vector<std::vector<int32_t>> sel = {{1, 33, 40}, {35}};
  auto p = SessionParams::Parse("csa", {{"page_fraction", "0.1"}}, 16);
  ASSERT_TRUE(p.ok());
  std::vector<PageTable> tables;
  ASSERT_TRUE(p->PageStep(100, &sel, &tables).ok());
  ASSERT_EQ(tables.size(), 1u);
  EXPECT_EQ(tables[0].pages, (std::vector<int32_t>{0, 2, 5, 6}));
  std::vector<int32_t> want;
  for (int32_t page : {0, 2, 5, 6}) {
    for (int32_t t = page * 16; t < std::min(100, (page + 1) * 16); ++t) want.push_back(t);
  }
  EXPECT_EQ(sel[0], want);
  EXPECT_EQ(sel[1], want);

  // whole_pages=0: each head keeps its own selections inside the kept pages.
  std::vector<std::vector<int32_t>> own = {{1, 33, 40}, {35}};
  auto q = SessionParams::Parse("csa", {{"page_fraction", "0.1"}, {"whole_pages", "0"}}, 16);
  ASSERT_TRUE(q.ok());
  ASSERT_TRUE(q->PageStep(100, &own, &tables).ok());
  EXPECT_EQ(own[0], (std::vector<int32_t>{1, 33, 40}));
  EXPECT_EQ(own[1], (std::vector<int32_t>{35}));
}

TEST(SessionParamsTest, ExpandFollowsSubgroups) {
  // Two subgroups of 2 heads: each head gets its own subgroup's pages only.
  std::vector<std::vector<int32_t>> sel = {{0}, {20}, {40}, {41}};
  auto tables = BuildPageTables(sel, 64, {.page_size = 16, .subgroup_size = 2, .recent_blocks = 0});
  ASSERT_TRUE(tables.ok());
  auto out = ExpandToTablePages(*tables, 4, 16, 64);
  ASSERT_TRUE(out.ok());
  std::set<int32_t> pages_a, pages_b;
  for (int32_t t : (*out)[0]) pages_a.insert(t / 16);
  for (int32_t t : (*out)[2]) pages_b.insert(t / 16);
  EXPECT_EQ(pages_a, (std::set<int32_t>{0, 1, 3}));
  EXPECT_EQ(pages_b, (std::set<int32_t>{2, 3}));
  EXPECT_EQ((*out)[0], (*out)[1]);
  EXPECT_EQ((*out)[2], (*out)[3]);
  EXPECT_EQ((*out)[0].size(), 48u);

  std::vector<PageTable> bad = *tables;
  bad[0].q_heads.push_back(7);
  EXPECT_EQ(ExpandToTablePages(bad, 4, 16, 64).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::session
