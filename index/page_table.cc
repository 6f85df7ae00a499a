#include "index/page_table.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace ctxcache::index {

int64_t PageTokens(int32_t page, int page_size, int64_t n_tokens) {
  const int64_t begin = static_cast<int64_t>(page) * page_size;
  const int64_t end = std::min<int64_t>(begin + page_size, n_tokens);
  return std::max<int64_t>(0, end - begin);
}

double PageEfficiency(const std::vector<PageTable>& tables) {
  int64_t selected = 0;
  int64_t fetched = 0;
  for (const PageTable& t : tables) {
    selected += t.selected_tokens;
    fetched += t.fetched_tokens;
  }
  return fetched > 0 ? static_cast<double>(selected) / fetched : 1.0;
}

StatusOr<std::vector<PageTable>> BuildPageTables(
    const std::vector<std::vector<int32_t>>& per_q_head, int group_size, int subgroup_size,
    int page_size, int64_t n_tokens, int recent_blocks) {
  if (group_size <= 0) {
    return InvalidArgumentError("page_table: group_size must be > 0, got " +
                                std::to_string(group_size));
  }
  if (static_cast<int64_t>(per_q_head.size()) != group_size) {
    return InvalidArgumentError(
        "page_table: per_q_head must have group_size=" + std::to_string(group_size) +
        " entries, got " + std::to_string(per_q_head.size()));
  }
  if (subgroup_size <= 0) {
    return InvalidArgumentError("page_table: subgroup_size must be > 0, got " +
                                std::to_string(subgroup_size));
  }
  if (page_size <= 0) {
    return InvalidArgumentError("page_table: page_size must be > 0, got " +
                                std::to_string(page_size));
  }
  if (recent_blocks < 0) {
    return InvalidArgumentError("page_table: recent_blocks must be >= 0, got " +
                                std::to_string(recent_blocks));
  }
  if (n_tokens < 0) {
    return InvalidArgumentError("page_table: n_tokens must be >= 0, got " +
                                std::to_string(n_tokens));
  }
  const int64_t n_pages = (n_tokens + page_size - 1) / page_size;
  if (n_pages > INT32_MAX) return InvalidArgumentError("page_table: n_tokens too large");
  const int sg = std::min(subgroup_size, group_size);
  const int n_subgroups = (group_size + sg - 1) / sg;

  std::vector<PageTable> tables(n_subgroups);
  std::vector<int32_t> tokens;
  for (int s = 0; s < n_subgroups; ++s) {
    PageTable& t = tables[s];
    t.subgroup = s;
    tokens.clear();
    for (int h = s * sg; h < std::min(group_size, (s + 1) * sg); ++h) {
      t.q_heads.push_back(h);
      for (int32_t id : per_q_head[h]) {
        if (id < 0 || id >= n_tokens) {
          return InvalidArgumentError("page_table: per_q_head[" + std::to_string(h) +
                                      "] holds token id " + std::to_string(id) +
                                      ", expected in [0, " + std::to_string(n_tokens) + ")");
        }
        tokens.push_back(id);
      }
    }
    std::sort(tokens.begin(), tokens.end());
    tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
    t.selected_tokens = static_cast<int64_t>(tokens.size());
    // Tokens are sorted, so their pages come out sorted too.
    for (int32_t id : tokens) {
      const int32_t page = id / page_size;
      if (t.pages.empty() || t.pages.back() != page) t.pages.push_back(page);
    }
    if (n_pages > 0) {
      const int64_t current = n_pages - 1;
      const int64_t first_forced = std::max<int64_t>(0, current - recent_blocks);
      const size_t before = t.pages.size();
      for (int64_t p = first_forced; p <= current; ++p) t.pages.push_back(static_cast<int32_t>(p));
      std::inplace_merge(t.pages.begin(), t.pages.begin() + static_cast<std::ptrdiff_t>(before),
                         t.pages.end());
      t.pages.erase(std::unique(t.pages.begin(), t.pages.end()), t.pages.end());
    }
    for (int32_t p : t.pages) t.fetched_tokens += PageTokens(p, page_size, n_tokens);
  }
  return tables;
}

int64_t PageBudget(double fraction, int64_t n_tokens, int page_size, int64_t min_tokens) {
  const int64_t b = std::max(1, page_size);
  const int64_t pages = (n_tokens + b - 1) / b;
  const int64_t floor_pages = (std::max<int64_t>(0, min_tokens) + b - 1) / b;
  const int64_t budget =
      std::max({int64_t{1}, static_cast<int64_t>(std::ceil(fraction * pages)), floor_pages});
  return std::max<int64_t>(1, std::min(budget, pages));
}

StatusOr<std::vector<std::vector<int32_t>>> CapSelectedPages(
    const std::vector<std::vector<int32_t>>& per_q_head, int page_size, int64_t n_tokens,
    int64_t max_pages, int recent_blocks, const std::vector<std::vector<float>>* logits,
    PageRank rank) {
  if (max_pages < 1) return InvalidArgumentError("page cap: max_pages must be >= 1");
  if (page_size < 1) return InvalidArgumentError("page cap: page_size must be >= 1");
  const int64_t n_pages = (n_tokens + page_size - 1) / page_size;
  std::vector<int64_t> count(static_cast<size_t>(n_pages), 0);
  for (const auto& sel : per_q_head) {
    for (int32_t id : sel) {
      if (id >= 0 && id < n_tokens) count[id / page_size]++;
    }
  }
  bool has_logits = logits != nullptr && logits->size() == per_q_head.size();
  for (size_t h = 0; has_logits && h < per_q_head.size(); ++h) {
    has_logits = (*logits)[h].size() == per_q_head[h].size();
  }
  if (rank == PageRank::kAuto || !has_logits) {
    rank = has_logits ? PageRank::kMass : PageRank::kVotes;
  }
  // The score a page is ranked by: votes, summed softmax mass or best logit.
  std::vector<double> score(static_cast<size_t>(n_pages), 0.0);
  if (rank == PageRank::kVotes) {
    for (int64_t p = 0; p < n_pages; ++p) score[p] = static_cast<double>(count[p]);
  } else if (rank == PageRank::kMax) {
    std::fill(score.begin(), score.end(), -std::numeric_limits<double>::infinity());
    for (size_t h = 0; h < per_q_head.size(); ++h) {
      const auto& lg = (*logits)[h];
      for (size_t i = 0; i < lg.size(); ++i) {
        const int32_t id = per_q_head[h][i];
        if (id >= 0 && id < n_tokens) {
          score[id / page_size] = std::max(score[id / page_size], static_cast<double>(lg[i]));
        }
      }
    }
  } else {
    for (size_t h = 0; h < per_q_head.size(); ++h) {
      const auto& lg = (*logits)[h];
      float mx = -std::numeric_limits<float>::infinity();
      for (float x : lg) mx = std::max(mx, x);
      double z = 0;
      for (float x : lg) z += std::exp(static_cast<double>(x - mx));
      if (!(z > 0)) continue;
      for (size_t i = 0; i < lg.size(); ++i) {
        const int32_t id = per_q_head[h][i];
        if (id >= 0 && id < n_tokens)
          score[id / page_size] += std::exp(static_cast<double>(lg[i] - mx)) / z;
      }
    }
  }
  std::vector<char> keep(static_cast<size_t>(n_pages), 0);
  if (n_pages > 0) keep[0] = 1;
  for (int64_t p = std::max<int64_t>(0, n_pages - 1 - recent_blocks); p < n_pages; ++p) keep[p] = 1;
  std::vector<int64_t> order;
  for (int64_t p = 0; p < n_pages; ++p) {
    if (!keep[p] && count[p] > 0) order.push_back(p);
  }
  // Ties: the later page, except by max, which breaks them as Quest ranks a
  // head's pages (the lower page).
  const bool lower_first = rank == PageRank::kMax;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (score[a] != score[b]) return score[a] > score[b];
    return lower_first ? a < b : a > b;
  });
  for (size_t i = 0; i < order.size() && static_cast<int64_t>(i) < max_pages; ++i) {
    keep[order[i]] = 1;
  }
  std::vector<std::vector<int32_t>> out(per_q_head.size());
  for (size_t h = 0; h < per_q_head.size(); ++h) {
    for (int32_t id : per_q_head[h]) {
      if (id >= 0 && id < n_tokens && keep[id / page_size]) out[h].push_back(id);
    }
  }
  return out;
}

StatusOr<std::vector<std::vector<int32_t>>> ExpandToTablePages(const std::vector<PageTable>& tables,
                                                               int group_size, int page_size,
                                                               int64_t n_tokens) {
  if (page_size < 1) return InvalidArgumentError("page_table: page_size must be >= 1");
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(std::max(group_size, 0)));
  std::vector<int32_t> tokens;
  for (const PageTable& t : tables) {
    tokens.clear();
    for (int32_t p : t.pages) {
      const int64_t end = std::min<int64_t>(n_tokens, (int64_t{p} + 1) * page_size);
      for (int64_t id = int64_t{p} * page_size; id < end; ++id) {
        tokens.push_back(static_cast<int32_t>(id));
      }
    }
    for (int32_t h : t.q_heads) {
      if (h < 0 || h >= group_size) {
        return InvalidArgumentError("page_table: table names q head " + std::to_string(h) +
                                    ", expected in [0, " + std::to_string(group_size) + ")");
      }
      out[static_cast<size_t>(h)] = tokens;
    }
  }
  return out;
}

}  // namespace ctxcache::index
