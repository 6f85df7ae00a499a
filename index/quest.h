// Quest baseline (DESIGN §5.5): per page of `page_size` consecutive tokens,
// the element-wise min and max of the keys. For a query q the page score
//   U(page) = Σ_j max(q_j·min_j, q_j·max_j)
// is an upper bound of q·k for every key k in the page. Select() ranks the
// pages by U and takes whole pages in that order while the selected tokens
// stay within the budget (at least one page). Reads no keys at select time.
//
// Params: "page" (int >= 1, default 16), "rho" (budget fraction in (0, 1],
// default 0.05, used when SelectInput::budget is 0). Unknown keys ->
// InvalidArgument.
//
// Thread-safety: as Selector (selector.h); Select() does not mutate.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/large_buffer.h"
#include "index/selector.h"

namespace ctxcache::index {

struct QuestOptions {
  // Tokens per page. Default: 16.
  int page_size = 16;
  // Default budget as a fraction of N when SelectInput::budget == 0. Default: 0.05.
  double rho = 0.05;
};

class QuestSelector final : public Selector {
 public:
  // The newest format this build reads. Serialize writes version 2 (bounds
  // as bf16, half the bytes) when every bound is a bf16 value, as it is for
  // keys stored in bf16, and version 1 (float bounds) otherwise; Load reads
  // both (docs/storage-format.md, "Quest").
  static constexpr uint32_t kFormatVersion = 2;

  // keys: n_tokens * head_dim, row-major. InvalidArgument on bad sizes/options.
  static StatusOr<std::unique_ptr<QuestSelector>> Build(const float* keys, int64_t n_tokens,
                                                        int head_dim, const QuestOptions& options);
  static StatusOr<std::unique_ptr<QuestSelector>> Load(std::string_view bytes);

  std::string_view method() const override { return "quest"; }
  int64_t n_tokens() const override { return n_tokens_; }
  int head_dim() const override { return head_dim_; }
  Status Select(const SelectInput& in, Selection* out, WorkStats* stats) override;
  Status Append(const float* key, const float* value, const float* queries) override;
  Status Serialize(std::string* out) const override;
  std::unique_ptr<Selector> Clone() const override;
  uint64_t MemoryBytes() const override;
  uint64_t SessionBytes() const override;

  int64_t n_pages() const {
    return n_base_pages_ + static_cast<int64_t>(page_min_.size()) / head_dim_;
  }
  // U(page) for query q (head_dim floats).
  float PageScore(const float* q, int64_t page) const;
  const QuestOptions& options() const { return options_; }

 private:
  QuestSelector(int head_dim, const QuestOptions& options)
      : head_dim_(head_dim), options_(options) {}

  int64_t n_tokens_ = 0;
  int head_dim_;
  QuestOptions options_;
  // Pages [0, n_base_pages_) come from the tables shared by clones; the
  // pages after them (appended, or the partial last page once a token joins
  // it) are this instance's own.
  struct Pages {
    LargeVector<float> min, max;  // n * d each (common/large_buffer.h: freed to the OS)
  };
  void Share();  // moves the own pages into fresh shared tables
  const float* PageMin(int64_t page) const {
    return page < n_base_pages_ ? base_->min.data() + page * head_dim_
                                : page_min_.data() + (page - n_base_pages_) * head_dim_;
  }
  const float* PageMax(int64_t page) const {
    return page < n_base_pages_ ? base_->max.data() + page * head_dim_
                                : page_max_.data() + (page - n_base_pages_) * head_dim_;
  }
  std::shared_ptr<const Pages> base_ = std::make_shared<const Pages>();
  int64_t n_base_pages_ = 0;
  std::vector<float> page_min_;  // own pages * d
  std::vector<float> page_max_;  // own pages * d
};

StatusOr<QuestOptions> ParseQuestParams(const MethodParams& params);

// Registry entry points (index/selector.cc).
StatusOr<std::unique_ptr<Selector>> BuildQuestSelector(const HeadPrefill& prefill,
                                                       const MethodParams& params);
StatusOr<std::unique_ptr<Selector>> LoadQuestSelector(std::string_view bytes);

}  // namespace ctxcache::index
