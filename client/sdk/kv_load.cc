#include "client/sdk/kv_load.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "client/sdk/channel.h"
#include "client/sdk/layout.h"
#include "client/sdk/retry.h"
#include "common/crc32c.h"
#include "proto/dtype_convert.h"
#include "proto/page_tables.h"

namespace ctxcache::client::internal {

namespace {

// 0 for an unknown dtype (CheckKVLoad refuses it first).
size_t ElementSize(v1::DType d) {
  auto dtype = FromProtoDType(d);
  return dtype.ok() ? DTypeSize(*dtype) : 0;
}

// Bytes one layout region must hold: the end of its last element.
unsigned __int128 Extent(const KVLayout& l, size_t n_slots, uint32_t n_heads, uint64_t n_tokens,
                         size_t row) {
  return StridedExtent({{n_slots, l.layer_stride}, {n_heads, l.head_stride},
                        {n_tokens, l.token_stride}},
                       row);
}

// Strides with 0 replaced by the dense layout's.
KVLayout Dense(KVLayout l, const v1::ContextInfo& info) {
  const int64_t row = static_cast<int64_t>(info.model().head_dim() * ElementSize(l.dtype));
  if (l.token_stride == 0) l.token_stride = row;
  if (l.head_stride == 0) l.head_stride = l.token_stride * static_cast<int64_t>(info.n_tokens());
  if (l.layer_stride == 0) l.layer_stride = l.head_stride * info.model().n_kv_heads();
  return l;
}

// A failed FetchKV call's status (UNAVAILABLE naming the server, so that a
// retry loop recognizes it).
Status FetchKVError(const ClientOptions& client, const grpc::Status& g) {
  if (g.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return UnavailableError("FetchKV: cannot reach ctxcached at " + client.server + " (" +
                            g.error_message() + ")");
  }
  return FromGrpc(g, "FetchKV");
}

}  // namespace

Status PlaceFrame(const v1::ContextInfo& info, const KVLayout& dense, int64_t slot,
                  const v1::KVFrame& f) {
  const uint32_t block_tokens = info.block_tokens() ? info.block_tokens() : 16;
  const uint64_t n_blocks = (info.n_tokens() + block_tokens - 1) / block_tokens;
  const size_t row = info.model().head_dim() * ElementSize(dense.dtype);
  const bool listed = !f.blocks().empty();
  // Built only for an error message: no allocation per good frame.
  auto where = [&f] {
    return "FetchKV frame (layer " + std::to_string(f.layer()) + ", kv head " +
           std::to_string(f.kv_head()) + ", blocks " + std::to_string(f.first_block()) + "+" +
           std::to_string(f.n_blocks()) + ")";
  };
  if (f.layer() >= info.model().n_layers() || f.kv_head() >= info.model().n_kv_heads() ||
      (!listed && uint64_t{f.first_block()} + f.n_blocks() > n_blocks) ||
      (listed && f.blocks_size() != static_cast<int>(f.n_blocks())) ||
      f.page_crc32c_size() != static_cast<int>(f.n_blocks()) || f.dtype() != dense.dtype) {
    return DataLossError(where() + ": does not match the context (" +
                         std::to_string(info.model().n_kv_heads()) + " kv heads, " +
                         std::to_string(n_blocks) + " blocks, dtype " +
                         v1::DType_Name(dense.dtype) + ")");
  }
  const char* src = f.payload().data();
  const char* end = src + f.payload().size();
  const int64_t base = slot * dense.layer_stride + int64_t{f.kv_head()} * dense.head_stride;
  char* k_head = static_cast<char*>(dense.k) + base;
  char* v_head = static_cast<char*>(dense.v) + base;
  auto copy_rows = [&](char* dst, const char* from, uint64_t tokens) {
    if (dense.token_stride == static_cast<int64_t>(row)) {
      std::memcpy(dst, from, tokens * row);
      return;
    }
    for (uint64_t t = 0; t < tokens; ++t) {
      std::memcpy(dst + static_cast<int64_t>(t) * dense.token_stride, from + t * row, row);
    }
  };
  for (uint32_t i = 0; i < f.n_blocks(); ++i) {
    const uint64_t block = listed ? f.blocks(static_cast<int>(i)) : uint64_t{f.first_block()} + i;
    if (block >= n_blocks || (listed && i > 0 && block <= f.blocks(static_cast<int>(i) - 1))) {
      return DataLossError(where() + ": block " + std::to_string(block) +
                           " is out of range or out of order");
    }
    const uint64_t t0 = block * block_tokens;
    const uint64_t tokens = std::min<uint64_t>(block_tokens, info.n_tokens() - t0);
    const size_t half = tokens * row;
    if (end - src < static_cast<ptrdiff_t>(2 * half)) {
      return DataLossError(where() + ": payload of " + std::to_string(f.payload().size()) +
                           " bytes is short");
    }
    if (crc32c::Value(std::string_view(src, 2 * half)) != f.page_crc32c(static_cast<int>(i))) {
      return DataLossError("FetchKV: page crc32c mismatch (context " + info.context_id() +
                           ", layer " + std::to_string(f.layer()) + ", kv head " +
                           std::to_string(f.kv_head()) + ", block " + std::to_string(block) +
                           "): the page was corrupted in transit");
    }
    copy_rows(k_head + static_cast<int64_t>(t0) * dense.token_stride, src, tokens);
    copy_rows(v_head + static_cast<int64_t>(t0) * dense.token_stride, src + half, tokens);
    src += 2 * half;
  }
  if (src != end) {
    return DataLossError(where() + ": payload of " + std::to_string(f.payload().size()) +
                         " bytes is long");
  }
  return Status::OK();
}

namespace {

class KVLoadImpl final : public KVLoad {
 public:
  KVLoadImpl(const ClientOptions& client, const v1::ContextInfo& info, std::vector<uint32_t> layers,
             const KVLoadOptions& options, const KVLayout& layout, KVStubFor stubs)
      : client_(client),
        info_(info),
        layers_(std::move(layers)),
        layout_(Dense(layout, info)),
        frame_bytes_(options.frame_bytes),
        stubs_(std::move(stubs)),
        row_(info.model().head_dim() * ElementSize(layout.dtype)),
        block_tokens_(info.block_tokens() ? info.block_tokens() : 16),
        n_blocks_(static_cast<uint32_t>((info.n_tokens() + block_tokens_ - 1) / block_tokens_)),
        layer_bytes_(2 * uint64_t{info.model().n_kv_heads()} * info.n_tokens() * row_),
        slot_(info.model().n_layers(), -1),
        state_(info.model().n_layers(), State::kNotAsked),
        started_(std::chrono::steady_clock::now()) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      slot_[layers_[i]] = static_cast<int>(i);
      state_[layers_[i]] = State::kQueued;
      queue_.push_back(layers_[i]);
    }
    const int n = std::clamp(options.streams, 1, static_cast<int>(layers_.size()));
    contexts_.resize(n, nullptr);
    for (int i = 0; i < n; ++i) threads_.emplace_back([this, i] { Run(i); });
  }

  ~KVLoadImpl() override {
    Cancel();
    for (auto& t : threads_) t.join();
  }

  Status Prioritize(uint32_t layer) override {
    std::lock_guard<std::mutex> l(mu_);
    return PrioritizeLocked(layer);
  }

  Status WaitLayer(uint32_t layer) override {
    std::unique_lock<std::mutex> l(mu_);
    RETURN_IF_ERROR(PrioritizeLocked(layer));
    cv_.wait(l, [&] { return state_[layer] == State::kDone || !status_.ok(); });
    return state_[layer] == State::kDone ? Status::OK() : status_;
  }

  Status Wait() override {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return finished_ == threads_.size(); });
    return status_;
  }

  void Cancel() override {
    std::lock_guard<std::mutex> l(mu_);
    if (finished_ == threads_.size()) return;
    Fail(CancelledError("KV load cancelled"));
    for (grpc::ClientContext* c : contexts_) {
      if (c != nullptr) c->TryCancel();
    }
  }

  bool done() const override {
    std::lock_guard<std::mutex> l(mu_);
    return finished_ == threads_.size();
  }

  KVLoadProgress progress() const override {
    std::lock_guard<std::mutex> l(mu_);
    KVLoadProgress p;
    p.bytes_done = bytes_done_.load();
    p.bytes_total = layer_bytes_ * layers_.size();
    p.layers_done = layers_done_;
    p.layers_total = static_cast<uint32_t>(layers_.size());
    p.frames = frames_.load();
    const auto end = finished_ == threads_.size() ? ended_ : std::chrono::steady_clock::now();
    p.seconds = std::chrono::duration<double>(end - started_).count();
    return p;
  }

 private:
  enum class State : uint8_t { kNotAsked, kQueued, kLoading, kDone };

  Status PrioritizeLocked(uint32_t layer) {
    if (layer >= slot_.size() || slot_[layer] < 0) {
      return InvalidArgumentError("layer: " + std::to_string(layer) + " is not one of the load's " +
                                  std::to_string(layers_.size()) + " layers");
    }
    auto it = std::find(queue_.begin(), queue_.end(), layer);
    if (it != queue_.end()) {
      queue_.erase(it);
      queue_.push_front(layer);
    }
    return Status::OK();
  }

  void Fail(Status s) {  // mu_ held
    if (status_.ok()) status_ = std::move(s);
    queue_.clear();
    cv_.notify_all();
  }

  void Run(int stream) {
    for (;;) {
      uint32_t layer;
      {
        std::lock_guard<std::mutex> l(mu_);
        if (queue_.empty() || !status_.ok()) break;
        layer = queue_.front();
        queue_.pop_front();
        state_[layer] = State::kLoading;
      }
      Status s = LoadLayer(stream, layer);
      std::lock_guard<std::mutex> l(mu_);
      if (s.ok()) {
        state_[layer] = State::kDone;
        ++layers_done_;
        cv_.notify_all();
      } else {
        Fail(std::move(s));
      }
    }
    std::lock_guard<std::mutex> l(mu_);
    if (++finished_ == threads_.size()) ended_ = std::chrono::steady_clock::now();
    cv_.notify_all();
  }

  Status LoadLayer(int stream, uint32_t layer) {
    v1::FetchKVRequest req;
    req.set_context_id(info_.context_id());
    req.add_layers(layer);
    req.set_frame_bytes(frame_bytes_);
    uint64_t layer_done = 0;
    Status result = RetryUnavailable(client_, [&]() -> Status {
      bytes_done_ -= layer_done;  // a retry rewrites the layer from the start
      layer_done = 0;
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineAfter(client_.timeout_s));
      AddCallCredentials(client_, &ctx);
      {
        std::lock_guard<std::mutex> l(mu_);
        if (!status_.ok()) return status_;
        contexts_[stream] = &ctx;
      }
      auto reader = stubs_(stream)->FetchKV(&ctx, req);
      v1::KVFrame frame;
      Status s;
      uint64_t pages = 0;
      while (s.ok() && reader->Read(&frame)) {
        s = Place(layer, frame);
        if (s.ok()) {
          pages += frame.n_blocks();
          layer_done += frame.payload().size();
          bytes_done_ += frame.payload().size();
          ++frames_;
        }
      }
      if (!s.ok()) ctx.TryCancel();
      grpc::Status g = reader->Finish();
      {
        std::lock_guard<std::mutex> l(mu_);
        contexts_[stream] = nullptr;
      }
      if (!s.ok()) return s;
      if (!g.ok()) return FetchKVError(client_, g);
      if (pages != uint64_t{n_blocks_} * info_.model().n_kv_heads()) {
        return DataLossError(
            "FetchKV: layer " + std::to_string(layer) + " ended after " + std::to_string(pages) +
            " of " + std::to_string(uint64_t{n_blocks_} * info_.model().n_kv_heads()) + " pages");
      }
      return Status::OK();
    });
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!status_.ok() && result.ok()) result = status_;
    }
    return result;
  }

  // Checks one frame against the context and its crc32c, then copies its
  // pages into the layout.
  Status Place(uint32_t layer, const v1::KVFrame& f) {
    if (f.layer() != layer || !f.blocks().empty()) {
      return DataLossError("FetchKV frame (layer " + std::to_string(f.layer()) +
                           "): not a run of layer " + std::to_string(layer));
    }
    return PlaceFrame(info_, layout_, slot_[layer], f);
  }

  const ClientOptions client_;
  const v1::ContextInfo info_;
  const std::vector<uint32_t> layers_;
  const KVLayout layout_;
  const uint32_t frame_bytes_;
  const KVStubFor stubs_;
  const size_t row_;
  const uint32_t block_tokens_;
  const uint32_t n_blocks_;
  const uint64_t layer_bytes_;
  std::vector<int> slot_;  // by context layer: its slot in the layout, -1 if not loaded

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<uint32_t> queue_;                   // guarded by mu_
  std::vector<State> state_;                     // guarded by mu_
  std::vector<grpc::ClientContext*> contexts_;   // guarded by mu_: each stream's call
  Status status_;                                // guarded by mu_: the first failure
  uint32_t layers_done_ = 0;                     // guarded by mu_
  size_t finished_ = 0;                          // guarded by mu_: threads that ended
  std::chrono::steady_clock::time_point ended_;  // guarded by mu_
  const std::chrono::steady_clock::time_point started_;
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<uint64_t> frames_{0};
  std::vector<std::thread> threads_;
};

}  // namespace

StatusOr<std::vector<uint32_t>> CheckKVLoad(const v1::ContextInfo& info,
                                            const KVLoadOptions& options, const KVLayout& layout) {
  const auto& m = info.model();
  if (info.state() != v1::CONTEXT_STATE_READY) {
    return FailedPreconditionError("context " + info.context_id() + " is not READY");
  }
  std::vector<uint32_t> layers = options.layers;
  if (layers.empty()) {
    for (uint32_t l = 0; l < m.n_layers(); ++l) layers.push_back(l);
  }
  std::vector<bool> seen(m.n_layers(), false);
  for (uint32_t l : layers) {
    if (l >= m.n_layers()) {
      return InvalidArgumentError("options.layers: " + std::to_string(l) + " out of range [0, " +
                                  std::to_string(m.n_layers()) + ")");
    }
    if (seen[l]) {
      return InvalidArgumentError("options.layers: " + std::to_string(l) + " given twice");
    }
    seen[l] = true;
  }
  if (options.streams < 1) {
    return InvalidArgumentError("options.streams: " + std::to_string(options.streams) +
                                ", expected >= 1");
  }
  if (layout.k == nullptr || layout.v == nullptr) {
    return InvalidArgumentError(std::string("layout.") + (layout.k == nullptr ? "k" : "v") +
                                ": null buffer");
  }
  if (layout.dtype != m.kv_dtype()) {
    return InvalidArgumentError("layout.dtype: " + v1::DType_Name(layout.dtype) +
                                ", expected the context's kv dtype " +
                                v1::DType_Name(m.kv_dtype()));
  }
  const size_t row = m.head_dim() * ElementSize(layout.dtype);
  if (layout.layer_stride < 0 || layout.head_stride < 0 || layout.token_stride < 0) {
    return InvalidArgumentError("layout: strides must be >= 0 (layer_stride " +
                                std::to_string(layout.layer_stride) + ", head_stride " +
                                std::to_string(layout.head_stride) + ", token_stride " +
                                std::to_string(layout.token_stride) + ")");
  }
  if (layout.token_stride != 0 && layout.token_stride < static_cast<int64_t>(row)) {
    return InvalidArgumentError(
        "layout.token_stride: " + std::to_string(layout.token_stride) +
        " bytes, expected 0 or >= head_dim * element size = " + std::to_string(row));
  }
  if (info.n_tokens() == 0) return layers;
  const KVLayout dense = Dense(layout, info);
  const unsigned __int128 need = Extent(dense, layers.size(), m.n_kv_heads(), info.n_tokens(), row);
  for (auto [name, cap] : {std::pair<const char*, size_t>{"layout.k_capacity", layout.k_capacity},
                           {"layout.v_capacity", layout.v_capacity}}) {
    if (need > cap) {
      return InvalidArgumentError(
          std::string(name) + ": " + std::to_string(cap) + " bytes, expected >= " +
          ExtentString(need) +
          " for " + std::to_string(layers.size()) + " layers x " + std::to_string(m.n_kv_heads()) +
          " kv heads x " + std::to_string(info.n_tokens()) + " tokens x " +
          std::to_string(m.head_dim()) + " dims at the layout's strides");
    }
  }
  return layers;
}

Status CheckPageTables(const v1::ContextInfo& info, const v1::FetchPagesRequest& request) {
  const uint32_t bt = info.block_tokens() ? info.block_tokens() : 16;
  return ctxcache::CheckPageTables(info.model().n_layers(), info.model().n_kv_heads(),
                                   (info.n_tokens() + bt - 1) / bt, request.tables());
}

Status FetchTablesInto(const ClientOptions& client, v1::DecodeService::Stub* stub,
                       const v1::ContextInfo& info, const v1::FetchPagesRequest& request,
                       const KVLayout& layout) {
  const KVLayout dense = Dense(layout, info);
  v1::FetchKVRequest req;
  req.set_context_id(request.context_id());
  *req.mutable_tables() = request.tables();
  uint64_t expected = 0;
  for (const v1::PageTable& t : request.tables()) expected += t.blocks_size();
  return RetryUnavailable(client, [&]() -> Status {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineAfter(client.timeout_s));
    AddCallCredentials(client, &ctx);
    auto reader = stub->FetchKV(&ctx, req);
    v1::KVFrame f;
    Status s;
    uint64_t pages = 0;
    while (s.ok() && reader->Read(&f)) {
      s = PlaceFrame(info, dense, f.layer(), f);
      pages += f.n_blocks();
    }
    if (!s.ok()) ctx.TryCancel();
    grpc::Status g = reader->Finish();
    if (!s.ok()) return s;
    if (!g.ok()) return FetchKVError(client, g);
    if (pages != expected) {
      return DataLossError("FetchKV: " + std::to_string(pages) + " pages for tables of " +
                           std::to_string(expected));
    }
    return Status::OK();
  });
}

std::unique_ptr<KVLoad> StartKVLoad(const ClientOptions& client, const v1::ContextInfo& info,
                                    std::vector<uint32_t> layers, const KVLoadOptions& options,
                                    const KVLayout& layout, KVStubFor stubs) {
  return std::make_unique<KVLoadImpl>(client, info, std::move(layers), options, layout,
                                      std::move(stubs));
}

}  // namespace ctxcache::client::internal
