#include "session/sparse_session.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "index/metrics.h"

namespace ctxcache::session {

Status SessionShape::Validate() const {
  auto positive = [](const char* name, int64_t v) -> Status {
    if (v > 0) return Status::OK();
    return InvalidArgumentError(std::string("session shape: ") + name + " is " +
                                std::to_string(v) + ", expected > 0");
  };
  RETURN_IF_ERROR(positive("n_layers", n_layers));
  RETURN_IF_ERROR(positive("n_q_heads", n_q_heads));
  RETURN_IF_ERROR(positive("n_kv_heads", n_kv_heads));
  RETURN_IF_ERROR(positive("head_dim", head_dim));
  RETURN_IF_ERROR(positive("page_size", page_size));
  if (n_stored < 0) {
    return InvalidArgumentError("session shape: n_stored is " + std::to_string(n_stored) +
                                ", expected >= 0");
  }
  if (n_q_heads % n_kv_heads != 0) {
    return InvalidArgumentError("session shape: n_q_heads " + std::to_string(n_q_heads) +
                                " is not a multiple of n_kv_heads " + std::to_string(n_kv_heads));
  }
  return Status::OK();
}

// Keys of (layer, kv head): stored rows through a fetcher, appended rows
// from the session.
class SparseSession::KeySourceImpl final : public index::KeySource {
 public:
  KeySourceImpl(const SparseSession* s, int layer, int kv_head, PageFetcher* fetcher)
      : s_(s), layer_(layer), kv_head_(kv_head), fetcher_(fetcher) {}
  int64_t n_tokens() const override { return s_->n_tokens(layer_); }
  int head_dim() const override { return s_->shape_.head_dim; }

  Status GatherKeys(const int32_t* ids, int64_t n, float* out) const override {
    const int d = s_->shape_.head_dim, b = s_->shape_.page_size;
    const int64_t n_stored = s_->shape_.n_stored, n_tok = n_tokens();
    blocks_.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= n_tok) {
        return InvalidArgumentError("key id " + std::to_string(ids[i]) + " outside [0, " +
                                    std::to_string(n_tok) + ")");
      }
      if (ids[i] < n_stored) blocks_.push_back(static_cast<uint32_t>(ids[i] / b));
    }
    PageMap pages;
    if (!blocks_.empty()) {
      std::sort(blocks_.begin(), blocks_.end());
      blocks_.erase(std::unique(blocks_.begin(), blocks_.end()), blocks_.end());
      RETURN_IF_ERROR(fetcher_->Fetch(layer_, kv_head_, blocks_, &pages));
    }
    const std::vector<float>& app = s_->appended_k(layer_, kv_head_);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out + i * d;
      if (ids[i] < n_stored) {
        auto it = pages.find(static_cast<uint32_t>(ids[i] / b));
        if (it == pages.end() || static_cast<int64_t>(it->second->n_tokens) <= ids[i] % b) {
          return DataLossError("page fetcher returned no key for token " + std::to_string(ids[i]));
        }
        std::memcpy(dst, it->second->k.data() + static_cast<size_t>(ids[i] % b) * d,
                    d * sizeof(float));
      } else {
        std::memcpy(dst, app.data() + static_cast<size_t>(ids[i] - n_stored) * d,
                    d * sizeof(float));
      }
    }
    return Status::OK();
  }

 private:
  const SparseSession* s_;
  int layer_, kv_head_;
  PageFetcher* fetcher_;
  mutable std::vector<uint32_t> blocks_;  // scratch
};

SparseSession::SparseSession(const SessionShape& shape, const SessionParams& params,
                             PageFetcher* fetcher)
    : shape_(shape), params_(params), fetcher_(fetcher) {}

SparseSession::~SparseSession() = default;

Status SparseSession::CheckSelectors(const SessionShape& shape,
                                     const std::vector<index::Selector*>& selectors) {
  RETURN_IF_ERROR(shape.Validate());
  const size_t want = static_cast<size_t>(shape.n_layers) * shape.n_kv_heads;
  if (selectors.size() != want) {
    return InvalidArgumentError("session: " + std::to_string(selectors.size()) +
                                " selectors, expected n_layers * n_kv_heads = " +
                                std::to_string(want));
  }
  for (size_t i = 0; i < selectors.size(); ++i) {
    const index::Selector* s = selectors[i];
    const std::string where = "session: selector of layer " +
                              std::to_string(i / shape.n_kv_heads) + " kv head " +
                              std::to_string(i % shape.n_kv_heads);
    if (s == nullptr) return InvalidArgumentError(where + " is null");
    if (s->method() != selectors[0]->method()) {
      return InvalidArgumentError(where + " is '" + std::string(s->method()) + "', expected '" +
                                  std::string(selectors[0]->method()) + "'");
    }
    if (s->n_tokens() != shape.n_stored || s->head_dim() != shape.head_dim) {
      return InvalidArgumentError(where + " covers " + std::to_string(s->n_tokens()) +
                                  " tokens of dim " + std::to_string(s->head_dim()) +
                                  ", expected " + std::to_string(shape.n_stored) + " of dim " +
                                  std::to_string(shape.head_dim));
    }
  }
  return Status::OK();
}

Status SparseSession::CheckStoredSelector(const index::Selector& selector, int layer,
                                          int kv_head, int64_t n_tokens, int head_dim) {
  if (selector.n_tokens() == n_tokens && selector.head_dim() == head_dim) return Status::OK();
  return DataLossError("the stored " + std::string(selector.method()) + " index of layer " +
                       std::to_string(layer) + " kv head " + std::to_string(kv_head) +
                       " covers " + std::to_string(selector.n_tokens()) + " tokens of dim " +
                       std::to_string(selector.head_dim()) + ", the context's manifest " +
                       std::to_string(n_tokens) + " of dim " + std::to_string(head_dim) +
                       ": the stored context is inconsistent (ctxcache fsck)");
}

StatusOr<std::unique_ptr<SparseSession>> SparseSession::Create(
    const SessionShape& shape, const SessionParams& params,
    std::vector<std::unique_ptr<index::Selector>> selectors, PageFetcher* fetcher) {
  std::vector<index::Selector*> raw;
  raw.reserve(selectors.size());
  for (const auto& s : selectors) raw.push_back(s.get());
  // The selectors are this session's own, so its overrides (csa's rerank)
  // apply to them; CreateBorrowed leaves the caller's selectors untouched.
  SessionParams borrowed = params;
  borrowed.selector_overrides.clear();
  ASSIGN_OR_RETURN(auto session, CreateBorrowed(shape, borrowed, std::move(raw), fetcher));
  for (auto& s : selectors) RETURN_IF_ERROR(s->ApplySessionOverrides(params.selector_overrides));
  session->params_.selector_overrides = params.selector_overrides;
  session->owned_ = std::move(selectors);
  return session;
}

StatusOr<std::unique_ptr<SparseSession>> SparseSession::CreateBorrowed(
    const SessionShape& shape, const SessionParams& params,
    std::vector<index::Selector*> selectors, PageFetcher* fetcher) {
  if (fetcher == nullptr) return InvalidArgumentError("session: page fetcher is null");
  if (!params.selector_overrides.empty()) {
    return InvalidArgumentError("session param " + params.selector_overrides.begin()->first +
                                " changes the selectors, which a session over borrowed "
                                "selectors does not own; expected it absent");
  }
  RETURN_IF_ERROR(CheckSelectors(shape, selectors));
  if (params.table_options.page_size != shape.page_size) {
    return InvalidArgumentError("session: params page size " +
                                std::to_string(params.table_options.page_size) +
                                " differs from the context's " + std::to_string(shape.page_size));
  }
  std::unique_ptr<SparseSession> s(new SparseSession(shape, params, fetcher));
  s->selectors_ = std::move(selectors);
  const size_t n = s->selectors_.size();
  s->app_k_.resize(n);
  s->app_v_.resize(n);
  s->n_appended_.assign(static_cast<size_t>(shape.n_layers), 0);
  for (int l = 0; l < shape.n_layers; ++l) {
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      s->keys_.push_back(s->MakeKeySource(l, h, fetcher));
    }
  }
  return s;
}

uint64_t SparseSession::MemoryBytes() const {
  uint64_t bytes = sizeof(*this) + selectors_.capacity() * sizeof(void*) +
                   owned_.capacity() * sizeof(void*) + n_appended_.capacity() * sizeof(int64_t) +
                   keys_.size() * (sizeof(KeySourceImpl) + sizeof(void*));
  for (const auto& s : owned_) bytes += s->SessionBytes();
  for (size_t i = 0; i < app_k_.size(); ++i) {
    bytes += 2 * sizeof(std::vector<float>) +
             (app_k_[i].capacity() + app_v_[i].capacity()) * sizeof(float);
  }
  return bytes;
}

std::string_view SparseSession::method() const { return selectors_[0]->method(); }

Status SparseSession::CheckHead(int layer, int kv_head) const {
  if (layer < 0 || layer >= shape_.n_layers) {
    return InvalidArgumentError("layer " + std::to_string(layer) + " out of range [0, " +
                                std::to_string(shape_.n_layers) + ")");
  }
  if (kv_head < 0 || kv_head >= shape_.n_kv_heads) {
    return InvalidArgumentError("kv head " + std::to_string(kv_head) + " out of range [0, " +
                                std::to_string(shape_.n_kv_heads) + ")");
  }
  return Status::OK();
}

std::unique_ptr<index::KeySource> SparseSession::MakeKeySource(int layer, int kv_head,
                                                               PageFetcher* fetcher) const {
  return std::make_unique<KeySourceImpl>(this, layer, kv_head, fetcher);
}

Status SparseSession::PlanHead(int layer, int kv_head, const float* group_queries,
                               HeadStep* out, index::WorkStats* work) {
  RETURN_IF_ERROR(CheckHead(layer, kv_head));
  const size_t slot = Slot(layer, kv_head);
  return PlanHeadWith(layer, selectors_[slot], keys_[slot].get(), group_queries, out, work);
}

Status SparseSession::PlanHeadWith(int layer, index::Selector* selector,
                                   const index::KeySource* keys, const float* group_queries,
                                   HeadStep* out, index::WorkStats* work) const {
  if (layer < 0 || layer >= shape_.n_layers) return CheckHead(layer, 0);
  const int64_t n = n_tokens(layer);
  index::SelectInput in;
  in.queries = group_queries;
  in.n_queries = shape_.group_size();
  in.budget = params_.TokenBudget(n);
  in.keys = keys;
  in.want_log_normalizer = params_.estimate_mass;
  in.want_logits = params_.WantsLogits();
  index::Selection sel;
  index::WorkStats ws;
  RETURN_IF_ERROR(selector->Select(in, &sel, &ws));
  if (work != nullptr) work->Add(ws);
  // The selector's estimated ids (PageStep rewrites per_head in place).
  const bool estimates = !sel.per_head_log_normalizer.empty() &&
                         sel.per_head_log_normalizer.size() == sel.per_head.size() &&
                         sel.per_head_logits.size() == sel.per_head.size();
  std::vector<std::vector<int32_t>> estimated_ids;
  if (estimates) estimated_ids = sel.per_head;
  out->tables.clear();
  RETURN_IF_ERROR(params_.PageStep(n, &sel.per_head, &out->tables, &sel.per_head_logits));
  out->per_q_head = std::move(sel.per_head);
  out->estimated_mass.clear();
  if (estimates) {
    for (size_t h = 0; h < out->per_q_head.size(); ++h) {
      out->estimated_mass.push_back(static_cast<float>(
          index::EstimateCapturedMass(estimated_ids[h], sel.per_head_logits[h],
                                      sel.per_head_log_normalizer[h], n, out->per_q_head[h])));
    }
  } else if (params_.estimate_mass &&
             std::all_of(out->per_q_head.begin(), out->per_q_head.end(),
                         [n](const auto& ids) { return static_cast<int64_t>(ids.size()) == n; })) {
    out->estimated_mass.assign(out->per_q_head.size(), 1.0f);
  }
  out->pages.clear();
  for (const auto& t : out->tables) {
    for (int32_t p : t.pages) out->pages.push_back(static_cast<uint32_t>(p));
  }
  std::sort(out->pages.begin(), out->pages.end());
  out->pages.erase(std::unique(out->pages.begin(), out->pages.end()), out->pages.end());
  const int64_t b = shape_.page_size;
  const uint32_t whole = static_cast<uint32_t>(shape_.n_stored / b);
  const uint32_t with = static_cast<uint32_t>((shape_.n_stored + b - 1) / b);
  out->n_whole_stored = static_cast<size_t>(
      std::lower_bound(out->pages.begin(), out->pages.end(), whole) - out->pages.begin());
  out->n_with_stored = static_cast<size_t>(
      std::lower_bound(out->pages.begin(), out->pages.end(), with) - out->pages.begin());
  return Status::OK();
}

Status SparseSession::LoadPages(int layer, int kv_head, const HeadStep& step, PageMap* out,
                                PageFetcher* fetcher) const {
  RETURN_IF_ERROR(CheckHead(layer, kv_head));
  if (fetcher == nullptr) fetcher = fetcher_;
  if (step.n_with_stored > 0) {
    RETURN_IF_ERROR(fetcher->Fetch(layer, kv_head, step.pages_with_stored(), out));
  }
  for (uint32_t block : step.mixed_pages()) {
    auto it = out->find(block);
    const DecodedPage* stored = nullptr;
    if (int64_t{block} * shape_.page_size < shape_.n_stored) {
      if (it == out->end()) {
        return DataLossError("page fetcher returned no rows for block " + std::to_string(block));
      }
      stored = it->second.get();
    }
    ASSIGN_OR_RETURN(PageRef page, AssemblePage(layer, kv_head, block, stored));
    (*out)[block] = std::move(page);
  }
  for (uint32_t block : step.whole_stored_pages()) {
    if (!out->count(block)) {
      return DataLossError("page fetcher returned no page for block " + std::to_string(block));
    }
  }
  return Status::OK();
}

StatusOr<PageRef> SparseSession::AssemblePage(int layer, int kv_head, uint32_t block,
                                              const DecodedPage* stored_part) const {
  RETURN_IF_ERROR(CheckHead(layer, kv_head));
  const int d = shape_.head_dim;
  const int64_t n_stored = shape_.n_stored;
  const int64_t begin = int64_t{block} * shape_.page_size;
  const int64_t end = std::min<int64_t>(begin + shape_.page_size, n_tokens(layer));
  if (begin >= end) {
    return InvalidArgumentError("block " + std::to_string(block) + " lies outside the " +
                                std::to_string(n_tokens(layer)) + "-token sequence");
  }
  const int64_t want_stored = std::clamp<int64_t>(n_stored - begin, 0, end - begin);
  const int64_t got_stored = stored_part ? stored_part->n_tokens : 0;
  if (got_stored != want_stored) {
    return InvalidArgumentError("block " + std::to_string(block) + ": " +
                                std::to_string(got_stored) + " stored rows, expected " +
                                std::to_string(want_stored));
  }
  auto page = std::make_shared<DecodedPage>();
  page->n_tokens = static_cast<uint32_t>(end - begin);
  page->k.resize(static_cast<size_t>(end - begin) * d);
  page->v.resize(page->k.size());
  if (got_stored > 0) {
    std::copy_n(stored_part->k.data(), got_stored * d, page->k.data());
    std::copy_n(stored_part->v.data(), got_stored * d, page->v.data());
  }
  const auto& ak = appended_k(layer, kv_head);
  const auto& av = appended_v(layer, kv_head);
  for (int64_t t = std::max(begin, n_stored); t < end; ++t) {
    std::copy_n(ak.data() + (t - n_stored) * d, d, page->k.data() + (t - begin) * d);
    std::copy_n(av.data() + (t - n_stored) * d, d, page->v.data() + (t - begin) * d);
  }
  return PageRef(std::move(page));
}

Status SparseSession::AppendLayer(int layer, const float* k, const float* v, const float* q) {
  RETURN_IF_ERROR(CheckHead(layer, 0));
  if (k == nullptr || v == nullptr) return InvalidArgumentError("append: k or v is null");
  const int d = shape_.head_dim, g = shape_.group_size();
  for (int h = 0; h < shape_.n_kv_heads; ++h) {
    const size_t slot = Slot(layer, h);
    const float* kp = k + static_cast<size_t>(h) * d;
    const float* vp = v + static_cast<size_t>(h) * d;
    const float* qp = q ? q + static_cast<size_t>(h) * g * d : nullptr;
    RETURN_IF_ERROR(selectors_[slot]->Append(kp, vp, qp));
    app_k_[slot].insert(app_k_[slot].end(), kp, kp + d);
    app_v_[slot].insert(app_v_[slot].end(), vp, vp + d);
  }
  n_appended_[layer]++;
  return Status::OK();
}

Status SparseSession::Append(const float* k, const float* v, const float* q) {
  const size_t kv = static_cast<size_t>(shape_.n_kv_heads) * shape_.head_dim;
  const size_t qd = static_cast<size_t>(shape_.n_q_heads) * shape_.head_dim;
  for (int l = 0; l < shape_.n_layers; ++l) {
    RETURN_IF_ERROR(AppendLayer(l, k + l * kv, v + l * kv, q ? q + l * qd : nullptr));
  }
  return Status::OK();
}

}  // namespace ctxcache::session
