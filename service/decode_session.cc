#include "service/decode_session.h"

#include <algorithm>
#include <chrono>

#include "common/dtype.h"
#include "index/methods.h"

namespace ctxcache::service {

Status ReaderPageFetcher::Fetch(int layer, int kv_head, std::span<const uint32_t> blocks,
                                session::PageMap* out) {
  missing_.clear();
  for (uint32_t b : blocks) {
    if (out->count(b)) continue;
    if (shared_ != nullptr) {
      session::PageRef page = shared_->Find({context_key_, static_cast<uint32_t>(layer),
                                              static_cast<uint32_t>(kv_head), b});
      if (page != nullptr) {
        (*out)[b] = std::move(page);
      } else {
        missing_.push_back(b);
      }
      continue;
    }
    auto hit = cache_.find(Key(layer, kv_head, b));
    if (hit != cache_.end()) {
      (*out)[b] = hit->second;
    } else {
      missing_.push_back(b);
    }
  }
  if (missing_.empty()) return Status::OK();
  std::sort(missing_.begin(), missing_.end());
  missing_.erase(std::unique(missing_.begin(), missing_.end()), missing_.end());
  RETURN_IF_ERROR(reader_->ReadPages(static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                                     missing_, &batch_));
  bytes_read_ += batch_.stored_bytes;
  const size_t d = batch_.head_dim;
  for (size_t i = 0; i < batch_.size(); ++i) {
    auto page = std::make_shared<session::DecodedPage>();
    page->n_tokens = batch_.n_tokens[i];
    page->k.resize(size_t{batch_.n_tokens[i]} * d);
    page->v.resize(page->k.size());
    ConvertToFloat(batch_.dtype, batch_.K(i), page->k.data(), page->k.size());
    ConvertToFloat(batch_.dtype, batch_.V(i), page->v.data(), page->v.size());
    if (shared_ != nullptr) {
      shared_->Insert({context_key_, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                       batch_.blocks[i]},
                      page);
      (*out)[batch_.blocks[i]] = std::move(page);
      continue;
    }
    if (cache_bytes_ + page->bytes() > cache_budget_) {
      cache_.clear();
      cache_bytes_ = 0;
    }
    if (page->bytes() <= cache_budget_) {
      cache_bytes_ += page->bytes();
      cache_[Key(layer, kv_head, batch_.blocks[i])] = page;
    }
    (*out)[batch_.blocks[i]] = std::move(page);
  }
  return Status::OK();
}

DecodeSession::~DecodeSession() {
  core_.reset();
  if (budget_ != nullptr) budget_->Release(charged_);
}

StatusOr<std::unique_ptr<DecodeSession>> DecodeSession::Open(
    std::unique_ptr<storage::ContextReader> reader, const std::string& method,
    const std::map<std::string, std::string>& params, bool want_pages,
    const DecodeSessionOptions& options) {
  RETURN_IF_ERROR(index::FindMethodInfo(method).status());
  std::unique_ptr<DecodeSession> s(new DecodeSession());
  const v1::ContextManifest& m = reader->manifest();
  s->method_ = method;
  s->want_pages_ = want_pages;
  const auto shape = session::SessionShape::From(m.model(), m.block_tokens(),
                                                 static_cast<int64_t>(m.n_tokens()));
  RETURN_IF_ERROR(shape.Validate().WithContext("context manifest"));
  // The session's own limit, within the server's.
  std::map<std::string, std::string> selection_params = params;
  s->max_appended_ = options.max_appended_tokens;
  if (auto it = selection_params.find("max_appended_tokens"); it != selection_params.end()) {
    uint64_t v = 0;
    const std::string& text = it->second;
    const bool digits = !text.empty() && text.size() <= 12 &&
                        text.find_first_not_of("0123456789") == std::string::npos;
    if (digits) v = std::stoull(text);
    if (!digits || v == 0 ||
        (options.max_appended_tokens != 0 && v > options.max_appended_tokens)) {
      return InvalidArgumentError(
          "params.max_appended_tokens must be an integer in [1, " +
          (options.max_appended_tokens != 0 ? std::to_string(options.max_appended_tokens)
                                            : std::string("2^40")) +
          "] (the server's --max-appended-tokens)");
    }
    s->max_appended_ = v;
    selection_params.erase(it);
  }
  ASSIGN_OR_RETURN(auto session_params,
                   session::SessionParams::Parse(method, selection_params, shape.page_size));
  std::vector<std::unique_ptr<index::Selector>> selectors;
  if (options.indexes != nullptr) {
    ASSIGN_OR_RETURN(s->index_, options.indexes->Get(*reader, method));
    selectors.reserve(s->index_->selectors.size());
    for (const auto& proto : s->index_->selectors) selectors.push_back(proto->Clone());
  } else {
    ASSIGN_OR_RETURN(selectors, LoadContextIndex(*reader, method));
  }
  s->reader_ = std::move(reader);
  s->fetcher_ = options.pages != nullptr
                    ? std::make_unique<ReaderPageFetcher>(s->reader_.get(), *options.pages)
                    : std::make_unique<ReaderPageFetcher>(s->reader_.get());
  ASSIGN_OR_RETURN(s->core_, session::SparseSession::Create(shape, session_params,
                                                            std::move(selectors),
                                                            s->fetcher_.get()));
  // A first estimate of one appended token: its K and V in every layer.
  s->kv_bytes_ = 2 * sizeof(float) * static_cast<uint64_t>(shape.n_layers) *
                 static_cast<uint64_t>(shape.n_kv_heads) * static_cast<uint64_t>(shape.head_dim);
  s->token_bytes_ = s->kv_bytes_;
  if (options.budget != nullptr) {
    const uint64_t own = s->memory_bytes();
    RETURN_IF_ERROR(options.budget->Reserve(own, "opening a " + method + " session"));
    s->budget_ = options.budget;
    s->charged_ = own;
  }
  return s;
}

Status DecodeSession::Step(uint32_t layer, const float* queries, SessionStep* out) {
  const session::SessionShape& sh = core_->shape();
  if (layer >= static_cast<uint32_t>(sh.n_layers)) {
    return InvalidArgumentError("step.layer " + std::to_string(layer) + " out of range [0, " +
                                std::to_string(sh.n_layers) + ")");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int l = static_cast<int>(layer);
  const size_t group_floats = static_cast<size_t>(sh.group_size()) * sh.head_dim;
  out->layer = layer;
  out->work = index::WorkStats();
  out->heads.resize(static_cast<size_t>(sh.n_kv_heads));
  for (int h = 0; h < sh.n_kv_heads; ++h) {
    RETURN_IF_ERROR(core_->PlanHead(l, h, queries + h * group_floats, &out->heads[h], &out->work));
  }
  out->select_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  out->stored.resize(want_pages_ ? static_cast<size_t>(sh.n_kv_heads) : 0);
  out->assembled.assign(want_pages_ ? static_cast<size_t>(sh.n_kv_heads) : 0, {});
  if (!want_pages_) return Status::OK();
  for (int h = 0; h < sh.n_kv_heads; ++h) {
    const session::HeadStep& step = out->heads[h];
    // Whole stored pages go out as stored: one batched read, no decode.
    const auto whole = step.whole_stored_pages();
    if (!whole.empty()) {
      RETURN_IF_ERROR(reader_->ReadPages(layer, static_cast<uint32_t>(h), whole, &out->stored[h]));
      bytes_served_ += out->stored[h].stored_bytes;
    } else {
      out->stored[h] = storage::PageBatch();
    }
    // Pages reaching into the appended tokens: stored rows plus appended K/V.
    session::PageMap stored_rows;
    for (uint32_t block : step.mixed_pages()) {
      const session::DecodedPage* part = nullptr;
      if (int64_t{block} * sh.page_size < sh.n_stored) {
        RETURN_IF_ERROR(fetcher_->Fetch(l, h, std::span<const uint32_t>(&block, 1), &stored_rows));
        part = stored_rows.at(block).get();
      }
      ASSIGN_OR_RETURN(session::PageRef page, core_->AssemblePage(l, h, block, part));
      out->assembled[h].emplace_back(block, std::move(page));
    }
  }
  return Status::OK();
}

Status DecodeSession::Append(const float* k, const float* v, const float* q) {
  if (max_appended_ != 0 && n_appended_ >= max_appended_) {
    return FailedPreconditionError("the session has appended " + std::to_string(n_appended_) +
                                   " tokens, its limit max_appended_tokens=" +
                                   std::to_string(max_appended_) +
                                   " (--max-appended-tokens, or the session param); open a new "
                                   "session or extend the context");
  }
  if (budget_ != nullptr) {
    // Admit the token at the size of the last one, then charge what it took.
    RETURN_IF_ERROR(budget_->Reserve(token_bytes_, "appending a token"));
    budget_->Release(token_bytes_);
  }
  RETURN_IF_ERROR(core_->Append(k, v, q));
  ++n_appended_;
  Recharge();
  return Status::OK();
}

void DecodeSession::Recharge() {
  const uint64_t now = memory_bytes();
  if (budget_ == nullptr) return;
  if (now > charged_) {
    token_bytes_ = std::max<uint64_t>(kv_bytes_, now - charged_);
    budget_->Charge(now - charged_);
  } else {
    budget_->Release(charged_ - now);
  }
  charged_ = now;
}

}  // namespace ctxcache::service
