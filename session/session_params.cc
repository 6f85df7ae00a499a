#include "session/session_params.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "index/csa.h"

namespace ctxcache::session {

StatusOr<SessionParams> SessionParams::Parse(const std::string& method,
                                             const std::map<std::string, std::string>& params,
                                             int page_size) {
  SessionParams s;
  s.table_options.page_size = page_size;
  bool has_whole_pages = false;
  for (const auto& [k, v] : params) {
    if (k == "page_rank") {
      if (v == "auto") {
        s.page_rank = index::PageRank::kAuto;
      } else if (v == "votes") {
        s.page_rank = index::PageRank::kVotes;
      } else if (v == "mass") {
        s.page_rank = index::PageRank::kMass;
      } else if (v == "max") {
        s.page_rank = index::PageRank::kMax;
      } else {
        return InvalidArgumentError("session param page_rank='" + v +
                                    "': expected auto, votes, mass or max");
      }
      continue;
    }
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !std::isfinite(x)) {
      return InvalidArgumentError("session param " + k + "='" + v + "' is not a number");
    }
    if (k == "rho") {
      if (!(x > 0 && x <= 1)) return InvalidArgumentError("session param rho must be in (0, 1]");
      s.rho = x;
    } else if (k == "budget") {
      if (x < 1) return InvalidArgumentError("session param budget must be >= 1 token");
      s.budget = static_cast<int64_t>(x);
    } else if (k == "min_budget") {
      if (x < 0) return InvalidArgumentError("session param min_budget must be >= 0 tokens");
      s.min_budget = static_cast<int64_t>(x);
    } else if (k == "page_fraction") {
      if (!(x > 0 && x <= 1)) {
        return InvalidArgumentError("session param page_fraction must be in (0, 1]");
      }
      s.page_fraction = x;
    } else if (k == "whole_pages") {
      if (x != 0 && x != 1) return InvalidArgumentError("session param whole_pages must be 0 or 1");
      s.whole_pages = x == 1;
      has_whole_pages = true;
    } else if (k == "subgroup") {
      if (x < 1) return InvalidArgumentError("session param subgroup must be >= 1");
      s.table_options.subgroup_size = static_cast<int>(x);
    } else if (k == "recent_blocks") {
      if (x < 0) return InvalidArgumentError("session param recent_blocks must be >= 0");
      s.table_options.recent_blocks = static_cast<int>(x);
    } else if (k == "estimate_mass") {
      if (x != 0 && x != 1) {
        return InvalidArgumentError("session param estimate_mass must be 0 or 1");
      }
      s.estimate_mass = x == 1;
    } else if (k == "P") {
      if (method != "tactic") {
        return InvalidArgumentError("session param P (the cumulative-attention target of an "
                                    "adaptive budget) applies to method tactic only; this "
                                    "session's method is " +
                                    method);
      }
      if (!(x > 0 && x <= 1)) return InvalidArgumentError("session param P must be in (0, 1]");
      s.adaptive = true;
      s.selector_overrides[k] = v;
    } else if (k == "rerank") {
      if (method != "csa") {
        return InvalidArgumentError(
            "session param rerank applies to method csa only; this "
            "session's method is " +
            method);
      }
      if (!index::IsValidCsaRerank(x)) {
        return InvalidArgumentError("session param rerank must be 0 or in [1, 64]");
      }
      s.selector_overrides[k] = v;
    } else {
      return InvalidArgumentError("unknown session param '" + k +
                                  "'; expected rho, budget, min_budget, page_fraction, "
                                  "page_rank, whole_pages, subgroup, recent_blocks, "
                                  "estimate_mass, rerank (csa) or P (tactic)");
    }
  }
  if (s.WantsLogits() && method != "csa" && method != "oracle" && method != "quest") {
    return InvalidArgumentError("session param page_rank mass or max needs a method that "
                                "scores its selections (csa, oracle or quest); this "
                                "session's method is " + method);
  }
  // Default page budget: the token budget's fraction of the pages (rho), so a
  // 5% session fetches ~5% of the KV. Token-level selections unioned over a
  // group touch most 16-token pages otherwise (docs/benchmarks.md). `full`
  // means dense, and an explicit `budget` (tokens) keeps token-level paging.
  if (s.adaptive && params.count("budget") > 0) {
    return InvalidArgumentError("session params P (an adaptive budget) and budget (a fixed "
                                "one) exclude each other");
  }
  // An adaptive session's budget is the selector's: no page cap unless asked.
  if (params.find("page_fraction") == params.end() && s.budget == 0 && method != "full" &&
      !s.adaptive) {
    s.page_fraction = s.rho;
  }
  if (s.page_fraction >= 1.0) s.page_fraction = 0;
  if (!has_whole_pages) s.whole_pages = s.page_fraction > 0;
  return s;
}

int64_t SessionParams::TokenBudget(int64_t n) const {
  if (adaptive) return 0;
  if (budget > 0) return std::max<int64_t>(1, std::min(budget, n));
  const int64_t by_rho = static_cast<int64_t>(std::ceil(rho * static_cast<double>(n)));
  return std::max<int64_t>(1, std::min(std::max(by_rho, min_budget), std::max<int64_t>(n, 1)));
}

Status SessionParams::PageStep(int64_t n_tokens, std::vector<std::vector<int32_t>>* per_q_head,
                               std::vector<index::PageTable>* tables,
                               const std::vector<std::vector<float>>* logits) const {
  const int b = table_options.page_size;
  if (page_fraction > 0) {
    ASSIGN_OR_RETURN(*per_q_head,
                     index::CapSelectedPages(
                         *per_q_head, b, n_tokens,
                         index::PageBudget(page_fraction, n_tokens, b, budget > 0 ? 0 : min_budget),
                         table_options.recent_blocks, logits, page_rank));
  }
  ASSIGN_OR_RETURN(*tables, index::BuildPageTables(*per_q_head, n_tokens, table_options));
  if (whole_pages) {
    ASSIGN_OR_RETURN(*per_q_head, index::ExpandToTablePages(
                                      *tables, static_cast<int>(per_q_head->size()), b, n_tokens));
  }
  return Status::OK();
}

}  // namespace ctxcache::session
