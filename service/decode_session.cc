#include "service/decode_session.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "common/crc32c.h"
#include "common/dtype.h"
#include "proto/dtype_convert.h"
#include "service/index_artifacts.h"

namespace ctxcache::service {

Status TensorToFloat(const v1::Tensor& t, const std::vector<int64_t>& shape, const char* what,
                     std::vector<float>* out) {
  std::string want = "[";
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    want += (i ? ", " : "") + std::to_string(shape[i]);
    n *= shape[i];
  }
  want += "]";
  bool shape_ok = t.shape_size() == static_cast<int>(shape.size());
  for (int i = 0; shape_ok && i < t.shape_size(); ++i) shape_ok = t.shape(i) == shape[i];
  if (!shape_ok) {
    std::string got = "[";
    for (int i = 0; i < t.shape_size(); ++i) got += (i ? ", " : "") + std::to_string(t.shape(i));
    return InvalidArgumentError(std::string(what) + ": shape " + got + ", expected " + want);
  }
  auto dtype = FromProtoDType(t.dtype());
  if (!dtype.ok()) return dtype.status().WithContext(what);
  const DType dt = *dtype;
  if (t.data().size() != static_cast<size_t>(n) * DTypeSize(dt)) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(t.data().size()) +
                                " data bytes, expected " + std::to_string(n * DTypeSize(dt)) +
                                " for shape " + want + " in " + std::string(DTypeName(dt)));
  }
  out->resize(static_cast<size_t>(n));
  ConvertToFloat(dt, t.data().data(), out->data(), static_cast<size_t>(n));
  if (HasNonFinite(out->data(), out->size())) {
    return InvalidArgumentError(std::string(what) + " contains NaN or Inf");
  }
  return Status::OK();
}

// Keys of one (layer, kv head) for exact-scoring selectors: stored pages
// (decoded once and cached for the session) plus the appended keys.
class DecodeSession::SessionKeySource final : public index::KeySource {
 public:
  SessionKeySource(DecodeSession* s, uint32_t layer, uint32_t head)
      : s_(s), layer_(layer), head_(head) {}
  int64_t n_tokens() const override { return s_->n_tokens(); }
  int head_dim() const override { return static_cast<int>(s_->d_); }

  Status GatherKeys(const int32_t* ids, int64_t n, float* out) const override {
    const uint32_t d = s_->d_, b = s_->block_;
    // Load missing stored blocks in one batched read.
    std::vector<uint32_t> missing;
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= s_->n_tokens()) {
        return InvalidArgumentError("key id " + std::to_string(ids[i]) + " out of range");
      }
      if (ids[i] >= s_->n_stored_) continue;
      uint32_t blk = static_cast<uint32_t>(ids[i]) / b;
      if (!blocks_.count(blk) && (missing.empty() || missing.back() != blk)) {
        missing.push_back(blk);
      }
    }
    if (!missing.empty()) {
      std::sort(missing.begin(), missing.end());
      missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
      storage::PageBatch batch;
      RETURN_IF_ERROR(s_->reader_->ReadPages(layer_, head_, missing, &batch));
      for (size_t i = 0; i < batch.size(); ++i) {
        std::vector<float>& keys = blocks_[batch.blocks[i]];
        keys.resize(size_t{batch.n_tokens[i]} * d);
        ConvertToFloat(batch.dtype, batch.K(i), keys.data(), keys.size());
      }
    }
    const auto& app = s_->app_k_[size_t{layer_} * s_->n_kv_ + head_];
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out + i * d;
      if (ids[i] < s_->n_stored_) {
        const auto& keys = blocks_.at(static_cast<uint32_t>(ids[i]) / b);
        std::memcpy(dst, keys.data() + size_t(ids[i] % b) * d, d * sizeof(float));
      } else {
        std::memcpy(dst, app.data() + size_t(ids[i] - s_->n_stored_) * d, d * sizeof(float));
      }
    }
    return Status::OK();
  }

 private:
  DecodeSession* s_;
  uint32_t layer_, head_;
  mutable std::unordered_map<uint32_t, std::vector<float>> blocks_;
};

DecodeSession::~DecodeSession() = default;

StatusOr<std::unique_ptr<DecodeSession>> DecodeSession::Open(
    std::unique_ptr<storage::ContextReader> reader, const std::string& method,
    const std::map<std::string, std::string>& params, bool want_pages,
    const SessionOptions& options) {
  auto kind = ArtifactKind(method);
  if (!kind) {
    return InvalidArgumentError("unknown method '" + method +
                                "'; expected csa, tactic, lfps, quest, streaming, oracle or full");
  }
  std::unique_ptr<DecodeSession> s(new DecodeSession());
  const v1::ContextManifest& m = reader->manifest();
  s->method_ = method;
  s->want_pages_ = want_pages;
  s->options_ = options;
  s->n_layers_ = m.model().n_layers();
  s->n_q_ = m.model().n_q_heads();
  s->n_kv_ = m.model().n_kv_heads();
  s->d_ = m.model().head_dim();
  s->block_ = m.block_tokens();
  s->n_stored_ = static_cast<int64_t>(m.n_tokens());
  ASSIGN_OR_RETURN(s->params_,
                   index::SessionParams::Parse(method, params, static_cast<int>(s->block_)));
  const size_t n_heads = size_t{s->n_layers_} * s->n_kv_;
  s->selectors_.resize(n_heads);
  s->app_k_.resize(n_heads);
  s->app_v_.resize(n_heads);
  for (uint32_t layer = 0; layer < s->n_layers_; ++layer) {
    for (uint32_t h = 0; h < s->n_kv_; ++h) {
      auto bytes = reader->ReadArtifact(layer, h, *kind);
      if (!bytes.ok()) {
        if (bytes.status().code() == StatusCode::kNotFound) {
          return FailedPreconditionError("context was built without the '" + method +
                                         "' index; rebuild it with that index method");
        }
        return bytes.status();
      }
      auto sel = index::LoadSelector(method, *bytes);
      if (!sel.ok()) {
        return sel.status().WithContext("loading the " + method + " index of layer " +
                                        std::to_string(layer) + " kv head " + std::to_string(h));
      }
      s->selectors_[size_t{layer} * s->n_kv_ + h] = std::move(sel).value();
      s->key_sources_.push_back(std::make_unique<SessionKeySource>(s.get(), layer, h));
    }
  }
  s->reader_ = std::move(reader);
  return s;
}

Status DecodeSession::ReadTokenKV(uint32_t layer, uint32_t kv_head, uint32_t block,
                                  v1::Page* page) {
  // A page that reaches into the appended part: stored rows, then appended.
  const int64_t begin = int64_t{block} * block_;
  const int64_t end = std::min<int64_t>(begin + block_, n_tokens());
  const size_t row = size_t{d_} * 2;  // bf16 bytes per row
  std::string k(static_cast<size_t>(end - begin) * row, '\0'), v(k.size(), '\0');
  if (begin < n_stored_) {
    storage::PageBatch batch;
    uint32_t b = block;
    RETURN_IF_ERROR(reader_->ReadPages(layer, kv_head, std::span<const uint32_t>(&b, 1), &batch));
    if (batch.dtype != DType::kBF16) {
      // Convert to bf16 so a page has one dtype.
      std::vector<float> tmp(size_t{batch.n_tokens[0]} * d_);
      ConvertToFloat(batch.dtype, batch.K(0), tmp.data(), tmp.size());
      FloatToBf16(tmp.data(), reinterpret_cast<uint16_t*>(k.data()), tmp.size());
      ConvertToFloat(batch.dtype, batch.V(0), tmp.data(), tmp.size());
      FloatToBf16(tmp.data(), reinterpret_cast<uint16_t*>(v.data()), tmp.size());
    } else {
      std::memcpy(k.data(), batch.K(0), size_t{batch.n_tokens[0]} * row);
      std::memcpy(v.data(), batch.V(0), size_t{batch.n_tokens[0]} * row);
    }
    bytes_served_ += batch.stored_bytes;
  }
  const auto& ak = app_k_[size_t{layer} * n_kv_ + kv_head];
  const auto& av = app_v_[size_t{layer} * n_kv_ + kv_head];
  for (int64_t t = std::max(begin, n_stored_); t < end; ++t) {
    FloatToBf16(ak.data() + (t - n_stored_) * d_,
                reinterpret_cast<uint16_t*>(k.data() + (t - begin) * row), d_);
    FloatToBf16(av.data() + (t - n_stored_) * d_,
                reinterpret_cast<uint16_t*>(v.data() + (t - begin) * row), d_);
  }
  page->set_layer(layer);
  page->set_kv_head(kv_head);
  page->set_block(block);
  page->set_n_tokens(static_cast<uint32_t>(end - begin));
  page->set_dtype(v1::DTYPE_BF16);
  page->set_crc32c(crc32c::Value(k, v));
  page->set_k(std::move(k));
  page->set_v(std::move(v));
  return Status::OK();
}

Status DecodeSession::Step(const v1::StepRequest& step, v1::StepResult* result,
                           std::vector<v1::PageBatch>* batches) {
  if (step.layer() >= n_layers_) {
    return InvalidArgumentError("step.layer " + std::to_string(step.layer()) +
                                " out of range [0, " + std::to_string(n_layers_) + ")");
  }
  RETURN_IF_ERROR(
      TensorToFloat(step.queries(), {int64_t{n_q_}, int64_t{d_}}, "step.queries", &qbuf_));
  auto t0 = std::chrono::steady_clock::now();
  const uint32_t layer = step.layer();
  const int g = static_cast<int>(n_q_ / n_kv_);
  const int64_t n = n_tokens();
  const int64_t budget = params_.TokenBudget(n);
  result->set_layer(layer);
  index::WorkStats total;
  std::vector<std::vector<uint32_t>> pages_per_head(n_kv_);
  for (uint32_t h = 0; h < n_kv_; ++h) {
    const size_t slot = size_t{layer} * n_kv_ + h;
    index::SelectInput in;
    in.queries = qbuf_.data() + size_t{h} * g * d_;
    in.n_queries = g;
    in.budget = budget;
    in.keys = key_sources_[slot].get();
    index::Selection sel;
    index::WorkStats ws;
    RETURN_IF_ERROR(selectors_[slot]->Select(in, &sel, &ws));
    total.Add(ws);
    std::vector<index::PageTable> tables;
    RETURN_IF_ERROR(params_.PageStep(n, &sel.per_head, &tables, &sel.per_head_logits));
    std::vector<uint32_t>& pages = pages_per_head[h];
    for (const auto& t : tables) {
      v1::PageTable* pt = result->add_page_tables();
      pt->set_layer(layer);
      pt->set_kv_head(h);
      pt->set_subgroup(static_cast<uint32_t>(t.subgroup));
      for (int32_t p : t.pages) {
        pt->add_blocks(static_cast<uint32_t>(p));
        pages.push_back(static_cast<uint32_t>(p));
      }
    }
    for (int j = 0; j < g; ++j) {
      v1::HeadSelection* hs = result->add_selections();
      hs->set_q_head(h * g + j);
      for (int32_t id : sel.per_head[j]) hs->add_token_ids(static_cast<uint32_t>(id));
    }
    std::sort(pages.begin(), pages.end());
    pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  }
  auto* st = result->mutable_stats();
  st->set_entries_touched(total.entries_touched);
  st->set_bytes_touched(total.bytes_touched);
  st->set_keys_scored(total.keys_scored);
  st->set_select_us(
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  if (!want_pages_) return Status::OK();

  // Pages: stored blocks in one batched read per kv head, the rest assembled.
  const uint32_t full_stored_blocks = static_cast<uint32_t>(n_stored_ / block_);
  v1::PageBatch current;
  size_t current_bytes = 0;
  auto push = [&](v1::Page&& page) {
    if (options_.corrupt_pages && !page.k().empty()) (*page.mutable_k())[0] ^= 0x01;
    size_t sz = page.k().size() + page.v().size() + 64;
    if (current.pages_size() > 0 && current_bytes + sz > options_.max_batch_bytes) {
      batches->push_back(std::move(current));
      current = v1::PageBatch();
      current_bytes = 0;
    }
    current_bytes += sz;
    *current.add_pages() = std::move(page);
  };
  storage::PageBatch batch;
  for (uint32_t h = 0; h < n_kv_; ++h) {
    const auto& pages = pages_per_head[h];
    auto split = std::lower_bound(pages.begin(), pages.end(), full_stored_blocks);
    std::vector<uint32_t> stored(pages.begin(), split);
    if (!stored.empty()) {
      RETURN_IF_ERROR(reader_->ReadPages(layer, h, stored, &batch));
      bytes_served_ += batch.stored_bytes;
      const size_t elem = DTypeSize(batch.dtype);
      for (size_t i = 0; i < batch.size(); ++i) {
        v1::Page page;
        page.set_layer(layer);
        page.set_kv_head(h);
        page.set_block(batch.blocks[i]);
        page.set_n_tokens(batch.n_tokens[i]);
        page.set_dtype(ToProtoDType(batch.dtype));
        const size_t bytes = size_t{batch.n_tokens[i]} * d_ * elem;
        page.set_k(reinterpret_cast<const char*>(batch.K(i)), bytes);
        page.set_v(reinterpret_cast<const char*>(batch.V(i)), bytes);
        page.set_crc32c(crc32c::Value(page.k(), page.v()));
        push(std::move(page));
      }
    }
    for (auto it = split; it != pages.end(); ++it) {
      v1::Page page;
      RETURN_IF_ERROR(ReadTokenKV(layer, h, *it, &page));
      push(std::move(page));
    }
  }
  current.set_last(true);
  batches->push_back(std::move(current));
  result->set_n_page_batches(static_cast<uint32_t>(batches->size()));
  return Status::OK();
}

Status DecodeSession::Append(const v1::AppendRequest& append) {
  std::vector<float> k, v, q;
  const int64_t L = n_layers_, KV = n_kv_, D = d_;
  RETURN_IF_ERROR(TensorToFloat(append.k(), {L, KV, D}, "append.k", &k));
  RETURN_IF_ERROR(TensorToFloat(append.v(), {L, KV, D}, "append.v", &v));
  const bool has_q = append.has_q() && !append.q().data().empty();
  if (has_q) RETURN_IF_ERROR(TensorToFloat(append.q(), {L, int64_t{n_q_}, D}, "append.q", &q));
  const int g = static_cast<int>(n_q_ / n_kv_);
  for (uint32_t layer = 0; layer < n_layers_; ++layer) {
    for (uint32_t h = 0; h < n_kv_; ++h) {
      const size_t slot = size_t{layer} * n_kv_ + h;
      const float* kp = k.data() + slot * d_;
      const float* vp = v.data() + slot * d_;
      const float* qp = has_q ? q.data() + (size_t{layer} * n_q_ + size_t{h} * g) * d_ : nullptr;
      RETURN_IF_ERROR(selectors_[slot]->Append(kp, vp, qp));
      app_k_[slot].insert(app_k_[slot].end(), kp, kp + d_);
      app_v_[slot].insert(app_v_[slot].end(), vp, vp + d_);
    }
  }
  n_appended_++;
  return Status::OK();
}

}  // namespace ctxcache::service
