#include "index/quest.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/dtype.h"
#include "index/byte_io.h"
#include "index/params.h"

namespace ctxcache::index {
namespace {

Status CheckOptions(const QuestOptions& o) {
  if (o.page_size <= 0) {
    return InvalidArgumentError("quest: page_size must be > 0, got " + std::to_string(o.page_size));
  }
  if (!(o.rho > 0 && o.rho <= 1)) return InvalidArgumentError("quest: rho must be in (0, 1]");
  return Status::OK();
}

}  // namespace

StatusOr<QuestOptions> ParseQuestParams(const MethodParams& params) {
  ParamReader r("quest", params);
  QuestOptions o;
  ASSIGN_OR_RETURN(int64_t page, r.Int("page", o.page_size, 1, 1 << 20));
  o.page_size = static_cast<int>(page);
  ASSIGN_OR_RETURN(o.rho, r.Double("rho", o.rho, 1e-9, 1.0));
  RETURN_IF_ERROR(r.Finish());
  return o;
}

StatusOr<std::unique_ptr<QuestSelector>> QuestSelector::Build(const float* keys, int64_t n_tokens,
                                                              int head_dim,
                                                              const QuestOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  if (n_tokens < 0 || n_tokens >= INT32_MAX) {
    return InvalidArgumentError("quest: n_tokens must be in [0, 2^31)");
  }
  if (head_dim <= 0) return InvalidArgumentError("quest: head_dim must be > 0");
  if (n_tokens > 0 && keys == nullptr) return InvalidArgumentError("quest: keys must not be null");
  std::unique_ptr<QuestSelector> sel(new QuestSelector(head_dim, options));
  for (int64_t i = 0; i < n_tokens; ++i) {
    RETURN_IF_ERROR(sel->Append(keys + i * head_dim, nullptr, nullptr));
  }
  sel->Share();
  return sel;
}

float QuestSelector::PageScore(const float* q, int64_t page) const {
  const float* mn = PageMin(page);
  const float* mx = PageMax(page);
  float s = 0;
  for (int j = 0; j < head_dim_; ++j) s += std::max(q[j] * mn[j], q[j] * mx[j]);
  return s;
}

Status QuestSelector::Select(const SelectInput& in, Selection* out, WorkStats* stats) {
  if (out == nullptr) return InvalidArgumentError("quest: out must not be null");
  RETURN_IF_ERROR(ValidateSelectInput("quest", in, head_dim_, n_tokens_, /*need_keys=*/false));
  const int64_t n = n_tokens_;
  const int64_t P = n_pages();
  const int B = options_.page_size;
  int64_t budget = in.budget > 0 ? in.budget : static_cast<int64_t>(std::ceil(options_.rho * n));
  budget = std::min(budget, n);
  out->per_head.assign(in.n_queries, {});
  out->merged.clear();
  out->estimated_mass = -1.0;
  out->per_head_logits.clear();
  out->per_head_log_normalizer.clear();
  if (in.want_logits) out->per_head_logits.assign(in.n_queries, {});
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  std::vector<float> score(P);
  std::vector<int32_t> order(P);
  std::vector<int32_t> pages;
  for (int h = 0; h < in.n_queries; ++h) {
    const float* q = in.queries + static_cast<size_t>(h) * head_dim_;
    for (int64_t p = 0; p < P; ++p) score[p] = PageScore(q, p);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return score[a] > score[b]; });
    pages.clear();
    int64_t taken = 0;
    for (int32_t p : order) {
      const int64_t len = std::min<int64_t>(B, n - static_cast<int64_t>(p) * B);
      if (!pages.empty() && taken + len > budget) continue;
      pages.push_back(p);
      taken += len;
      if (taken >= budget) break;
    }
    std::sort(pages.begin(), pages.end());
    std::vector<int32_t>& ids = out->per_head[h];
    ids.reserve(taken);
    if (in.want_logits) out->per_head_logits[h].reserve(taken);
    for (int32_t p : pages) {
      const int64_t end = std::min<int64_t>(n, static_cast<int64_t>(p + 1) * B);
      for (int64_t i = static_cast<int64_t>(p) * B; i < end; ++i) {
        ids.push_back(static_cast<int32_t>(i));
        if (in.want_logits) out->per_head_logits[h].push_back(score[p] * inv_sqrt_d);
      }
    }
  }
  for (const auto& ids : out->per_head)
    out->merged.insert(out->merged.end(), ids.begin(), ids.end());
  std::sort(out->merged.begin(), out->merged.end());
  out->merged.erase(std::unique(out->merged.begin(), out->merged.end()), out->merged.end());
  if (stats != nullptr) {
    *stats = WorkStats{};
    stats->entries_touched = static_cast<uint64_t>(P) * in.n_queries;
    stats->bytes_touched = static_cast<uint64_t>(P) * 2 * head_dim_ * sizeof(float) * in.n_queries;
  }
  return Status::OK();
}

Status QuestSelector::Append(const float* key, const float*, const float*) {
  if (key == nullptr) return InvalidArgumentError("quest: key must not be null");
  if (n_tokens_ >= INT32_MAX - 1) return OutOfRangeError("quest: too many tokens");
  const int d = head_dim_;
  if (n_tokens_ % options_.page_size != 0 && page_min_.empty()) {
    // The partial last page is shared: this instance takes its own copy.
    --n_base_pages_;
    const float* mn = base_->min.data() + n_base_pages_ * d;
    const float* mx = base_->max.data() + n_base_pages_ * d;
    page_min_.assign(mn, mn + d);
    page_max_.assign(mx, mx + d);
  }
  if (n_tokens_ % options_.page_size == 0) {
    page_min_.insert(page_min_.end(), key, key + d);
    page_max_.insert(page_max_.end(), key, key + d);
  } else {
    float* mn = page_min_.data() + page_min_.size() - d;
    float* mx = page_max_.data() + page_max_.size() - d;
    for (int j = 0; j < d; ++j) {
      mn[j] = std::min(mn[j], key[j]);
      mx[j] = std::max(mx[j], key[j]);
    }
  }
  ++n_tokens_;
  return Status::OK();
}

Status QuestSelector::Serialize(std::string* out) const {
  out->clear();
  const size_t shared = static_cast<size_t>(n_base_pages_) * head_dim_;
  std::vector<float> mn(base_->min.begin(), base_->min.begin() + shared);
  std::vector<float> mx(base_->max.begin(), base_->max.begin() + shared);
  mn.insert(mn.end(), page_min_.begin(), page_min_.end());
  mx.insert(mx.end(), page_max_.begin(), page_max_.end());
  // Version 2 when the bf16 form loses nothing (every bound of bf16 keys).
  std::vector<uint16_t> mn16(mn.size()), mx16(mx.size());
  FloatToBf16(mn.data(), mn16.data(), mn.size());
  FloatToBf16(mx.data(), mx16.data(), mx.size());
  bool exact = true;
  for (size_t i = 0; i < mn.size() && exact; ++i) {
    exact = Bf16ToFloat(mn16[i]) == mn[i] && Bf16ToFloat(mx16[i]) == mx[i];
  }
  ByteWriter w(out);
  w.PutHeader("QST1", exact ? 2 : 1);
  w.Put<int64_t>(n_tokens_);
  w.Put<int32_t>(head_dim_);
  w.Put<int32_t>(options_.page_size);
  w.Put<double>(options_.rho);
  if (exact) {
    PutVector(&w, mn16);
    PutVector(&w, mx16);
  } else {
    PutVector(&w, mn);
    PutVector(&w, mx);
  }
  return Status::OK();
}

void QuestSelector::Share() {
  auto pages = std::make_shared<Pages>();
  const size_t shared = static_cast<size_t>(n_base_pages_) * head_dim_;
  pages->min.assign(base_->min.begin(), base_->min.begin() + shared);
  pages->max.assign(base_->max.begin(), base_->max.begin() + shared);
  pages->min.insert(pages->min.end(), page_min_.begin(), page_min_.end());
  pages->max.insert(pages->max.end(), page_max_.begin(), page_max_.end());
  n_base_pages_ = static_cast<int64_t>(pages->min.size()) / head_dim_;
  base_ = std::move(pages);
  page_min_ = {};
  page_max_ = {};
}

StatusOr<std::unique_ptr<QuestSelector>> QuestSelector::Load(std::string_view bytes) {
  ByteReader r(bytes);
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader("QST1", kFormatVersion, &version, "quest"));
  int64_t n = 0;
  int32_t d = 0;
  QuestOptions o;
  if (!r.Get(&n) || !r.Get(&d) || !r.Get(&o.page_size) || !r.Get(&o.rho)) {
    return DataLossError("quest: truncated artifact header");
  }
  RETURN_IF_ERROR(CheckOptions(o));
  if (n < 0 || n >= INT32_MAX || d <= 0 || d > 4096) {
    return DataLossError("quest: corrupt artifact header");
  }
  std::unique_ptr<QuestSelector> sel(new QuestSelector(d, o));
  const size_t floats = static_cast<size_t>((n + o.page_size - 1) / o.page_size) * d;
  const size_t item = version == 2 ? sizeof(uint16_t) : sizeof(float);
  if (floats > r.remaining() / item) return DataLossError("quest: truncated artifact");
  sel->page_min_.resize(floats);
  sel->page_max_.resize(floats);
  if (version == 2) {
    std::vector<uint16_t> mn(floats), mx(floats);
    if (!GetVector(&r, &mn) || !GetVector(&r, &mx) || r.remaining() != 0) {
      return DataLossError("quest: truncated or oversized artifact");
    }
    Bf16ToFloat(mn.data(), sel->page_min_.data(), floats);
    Bf16ToFloat(mx.data(), sel->page_max_.data(), floats);
  } else if (!GetVector(&r, &sel->page_min_) || !GetVector(&r, &sel->page_max_) ||
             r.remaining() != 0) {
    return DataLossError("quest: truncated or oversized artifact");
  }
  sel->n_tokens_ = n;
  sel->Share();
  return sel;
}

std::unique_ptr<Selector> QuestSelector::Clone() const {
  return std::unique_ptr<Selector>(new QuestSelector(*this));
}

uint64_t QuestSelector::MemoryBytes() const {
  return sizeof(*this) + (page_min_.capacity() + page_max_.capacity() + base_->min.size() +
                           base_->max.size()) *
                              sizeof(float);
}

uint64_t QuestSelector::SessionBytes() const {
  return sizeof(*this) + (page_min_.capacity() + page_max_.capacity()) * sizeof(float);
}

StatusOr<std::unique_ptr<Selector>> BuildQuestSelector(const HeadPrefill& prefill,
                                                       const MethodParams& params) {
  ASSIGN_OR_RETURN(QuestOptions o, ParseQuestParams(params));
  RETURN_IF_ERROR(ValidatePrefill("quest", prefill, /*need_queries=*/false, /*need_values=*/false));
  ASSIGN_OR_RETURN(auto sel,
                   QuestSelector::Build(prefill.keys, prefill.n_tokens, prefill.head_dim, o));
  return std::unique_ptr<Selector>(std::move(sel));
}

StatusOr<std::unique_ptr<Selector>> LoadQuestSelector(std::string_view bytes) {
  ASSIGN_OR_RETURN(auto sel, QuestSelector::Load(bytes));
  return std::unique_ptr<Selector>(std::move(sel));
}

}  // namespace ctxcache::index
