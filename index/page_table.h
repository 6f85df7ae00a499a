// Block-union page tables (CompactAttention §3.2, DESIGN §5.4).
//
// Turns per-q-head token selections of one (layer, kv head) into one sorted
// KV page list per execution subgroup of q heads. Page p holds tokens
// [p*B, min((p+1)*B, N)). A subgroup is `subgroup_size` consecutive q heads of
// the GQA group (the whole group when it is smaller; the last subgroup may be
// smaller when G is not a multiple). The table of a subgroup is the union of
// the pages of its heads' selected tokens plus the forced pages: the current
// page (the one holding token N-1) and the `recent_blocks` pages before it.
//
// Properties (checked by tests/index/page_table_test.cc):
//  - coverage-preserving: every selected token of every head of a subgroup
//    lies in a page of that subgroup's table;
//  - minimal: every page in a table holds a selected token of one of the
//    subgroup's heads, or is a forced (current/recent) page.
//
// Page fetches go through these tables; page efficiency = selected tokens /
// fetched tokens, where selected tokens counts the union of the subgroup's
// selections (forced pages add fetched tokens, not selected ones).
//
// Thread-safety: pure functions over values; reentrant.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace ctxcache::index {

struct PageTableOptions {
  // Tokens per page (B). Default: 16.
  int page_size = 16;
  // Max q heads per execution subgroup. Default: 4 (CompactAttention).
  int subgroup_size = 4;
  // Pages before the current one that are always fetched. Default: 1.
  int recent_blocks = 1;
};

struct PageTable {
  int subgroup = 0;              // index of the subgroup in its GQA group
  std::vector<int32_t> q_heads;  // q heads (0..G-1) of the subgroup, ascending
  std::vector<int32_t> pages;    // page ids, sorted ascending, unique
  int64_t selected_tokens = 0;   // |union of the heads' selections|
  int64_t fetched_tokens = 0;    // tokens in `pages` (last page may be partial)

  double efficiency() const {
    return fetched_tokens > 0 ? static_cast<double>(selected_tokens) / fetched_tokens : 1.0;
  }
};

// Builds the tables. `per_q_head` has G = group_size entries; each holds
// token ids in [0, n_tokens) (any order, duplicates allowed).
// InvalidArgument on G mismatch, non-positive sizes, negative recent_blocks,
// n_tokens < 0 or out-of-range ids.
StatusOr<std::vector<PageTable>> BuildPageTables(
    const std::vector<std::vector<int32_t>>& per_q_head, int group_size, int subgroup_size,
    int page_size, int64_t n_tokens, int recent_blocks);

inline StatusOr<std::vector<PageTable>> BuildPageTables(
    const std::vector<std::vector<int32_t>>& per_q_head, int64_t n_tokens,
    const PageTableOptions& options) {
  return BuildPageTables(per_q_head, static_cast<int>(per_q_head.size()), options.subgroup_size,
                         options.page_size, n_tokens, options.recent_blocks);
}

// Tokens in page `page` of a context of n_tokens (B = page_size).
int64_t PageTokens(int32_t page, int page_size, int64_t n_tokens);

// Sum of selected over sum of fetched tokens across `tables`.
double PageEfficiency(const std::vector<PageTable>& tables);

// How CapSelectedPages ranks the pages of a group's selections.
enum class PageRank {
  // kMass when per_q_head_logits covers every selected token of every head,
  // else kVotes.
  kAuto,
  // How many selected tokens of all q heads fall in the page (ties: the later
  // page).
  kVotes,
  // The estimated softmax mass in the page: softmax over each head's
  // selection of its logit estimates, summed over heads (ties: the later
  // page). Keeps one page holding a dominant key over a page of many marginal
  // ones (docs/benchmarks.md).
  kMass,
  // The largest logit estimate any head gives a token of the page (ties: the
  // lower page, as Quest ranks one head's pages). With Quest's page bounds: a
  // kv head's pages by the best bound of its q heads, among the pages some
  // head selected.
  kMax,
};

// Page-budgeted selection: keeps at most `max_pages` pages for the whole
// group (plus page 0, for the sinks, and the last recent_blocks + 1 pages),
// ranked by `rank`, and drops the selected tokens of every other page. Any
// rank falls back to kVotes on a step whose per_q_head_logits do not cover
// every selected token of every head (csa reusing a selection gives none).
// This bounds the bytes fetched per step at the cost of recall: token-level
// selections at 5% spread over most pages of a 16-token layout.
// InvalidArgument for max_pages < 1 or page_size < 1.
StatusOr<std::vector<std::vector<int32_t>>> CapSelectedPages(
    const std::vector<std::vector<int32_t>>& per_q_head, int page_size, int64_t n_tokens,
    int64_t max_pages, int recent_blocks,
    const std::vector<std::vector<float>>* per_q_head_logits = nullptr,
    PageRank rank = PageRank::kAuto);

// The page budget for a fraction of the pages: max(1, ceil(fraction * pages),
// ceil(min_tokens / page_size)), at most the pages.
int64_t PageBudget(double fraction, int64_t n_tokens, int page_size, int64_t min_tokens = 0);

// Whole-page attention: returns, per q head (group_size of them), every token
// in [0, n_tokens) of every page in its subgroup's table, sorted. The pages
// are fetched anyway, so attending all of their tokens costs no bytes and
// brings attention closer to dense: softmax over a superset of the true keys
// misses less mass. Used by page-budgeted sessions (docs/api.md, whole_pages).
// InvalidArgument if a table names a q head outside [0, group_size) or
// page_size < 1.
StatusOr<std::vector<std::vector<int32_t>>> ExpandToTablePages(const std::vector<PageTable>& tables,
                                                               int group_size, int page_size,
                                                               int64_t n_tokens);

}  // namespace ctxcache::index
