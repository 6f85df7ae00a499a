// Per-session selection parameters, parsed once for both sides of a decode
// session: the server (service/decode_session) and the SDK's client-side
// selection (client/sdk). Keeping one parser keeps the two modes identical.
//
// Params (string -> number unless noted, all optional; docs/api.md):
//   rho            token budget per q head as a fraction of the session's
//                  tokens, (0, 1]. Default: 0.05.
//   budget         token budget per q head, >= 1 (overrides rho). Default: unset.
//   min_budget     floor of the rho budget, in tokens, >= 0: the token budget
//                  is max(rho * n, min_budget) and the page cap at least
//                  min_budget / page_size pages (both at most the session's
//                  tokens). Short contexts keep enough pages for bound-based
//                  selections to find their keys. Default: 0 (no floor).
//   page_rank      (a word) how the page cap ranks a group's selected pages:
//                  "auto" (by estimated mass when the method scores its
//                  selections, else "votes"), "votes" (selected tokens per
//                  page), "mass" (estimated softmax mass) or "max" (the best
//                  score any q head gives the page; for quest its page bound).
//                  "mass" and "max" need a method that scores its
//                  selections (csa, oracle, quest). Default: "auto".
//   page_fraction  cap on the pages fetched per (layer, kv head), as a fraction
//                  of the pages, (0, 1]; 1 = no cap. Default: rho for sparse
//                  methods; no cap for `full` or when `budget` is given.
//   whole_pages    1: every q head attends every token of the pages fetched
//                  for its subgroup; 0: only its own selected tokens.
//                  Default: 1 when the page cap is on, else 0 (token-level
//                  paging keeps each method's exact selections).
//   subgroup       q heads per page table, >= 1. Default: 4.
//   recent_blocks  pages before the current one always fetched, >= 0. Default: 1.
//   estimate_mass  1: every step estimates the attention mass each q head's
//                  selection captures (session::HeadStep::estimated_mass; an
//                  O(n) pass over the method's logit estimates per q head).
//                  Default: 0.
//   rerank         csa only: this session's stage-2 factor (index/csa.h
//                  CsaOptions::rerank), 0 (the lists alone) or in [1, 64];
//                  > 0 needs a context built with the key sketch (rerank > 0
//                  at build). Trades recall for selection time per session
//                  without a rebuild. Default: the context's build value.
//
// Thread-safety: a value type; Parse is reentrant.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "index/page_table.h"

namespace ctxcache::session {

struct SessionParams {
  double rho = 0.05;
  int64_t budget = 0;      // 0 = use rho
  int64_t min_budget = 0;  // floor of the rho budget, tokens
  index::PageRank page_rank = index::PageRank::kAuto;
  double page_fraction = 0;  // 0 = no page cap
  bool whole_pages = false;
  bool estimate_mass = false;
  // Tactic's adaptive mode (session param `P`, tactic only): the selector
  // picks each q head's budget for its cumulative-attention target, so
  // TokenBudget is 0 and there is no default page cap. Default: false.
  bool adaptive = false;
  index::PageTableOptions table_options;
  // Method params the session's selectors take per session (rerank), as
  // given; applied by session::SparseSession::Create through
  // Selector::ApplySessionOverrides. Empty: the context's build values.
  std::map<std::string, std::string> selector_overrides;

  // InvalidArgument naming the param and the expected values.
  static StatusOr<SessionParams> Parse(const std::string& method,
                                       const std::map<std::string, std::string>& params,
                                       int page_size);

  // Tokens per q head for a session of n tokens (>= 1, <= n when n >= 1);
  // 0 when `adaptive` (SelectInput::budget 0: the selector's own budget).
  int64_t TokenBudget(int64_t n) const;

  // Whether the method should return per-token logit estimates
  // (SelectInput::want_logits): the page cap ranks by them.
  bool WantsLogits() const {
    return page_rank == index::PageRank::kMass || page_rank == index::PageRank::kMax;
  }

  // One (layer, kv head) step after the method's Select: applies the page
  // cap, builds the page tables and, with whole_pages, widens each q head's
  // selection to the tokens of its subgroup's pages. *per_q_head is updated
  // in place to what each q head attends.
  // per_q_head_logits (may be null): Selection::per_head_logits.
  Status PageStep(int64_t n_tokens, std::vector<std::vector<int32_t>>* per_q_head,
                  std::vector<index::PageTable>* tables,
                  const std::vector<std::vector<float>>* per_q_head_logits = nullptr) const;
};

}  // namespace ctxcache::session
