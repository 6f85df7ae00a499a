#include "service/kv_frames.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>

#include "proto/dtype_convert.h"

namespace ctxcache::service {

KVFrameReader::KVFrameReader(const storage::ContextReader* reader, std::vector<uint32_t> layers,
                             KVFrameOptions options)
    : reader_(reader), layers_(std::move(layers)), options_(std::move(options)) {
  producer_ = std::thread([this] { Produce(); });
}

KVFrameReader::~KVFrameReader() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  producer_.join();
}

bool KVFrameReader::Next(v1::KVFrame* frame) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return !queue_.empty() || done_; });
  if (queue_.empty()) return false;
  *frame = std::move(queue_.front());
  queue_.pop_front();
  l.unlock();
  cv_.notify_all();
  return true;
}

Status KVFrameReader::status() const {
  std::lock_guard<std::mutex> l(mu_);
  return status_;
}

void KVFrameReader::Produce() {
  const v1::ContextManifest& m = reader_->manifest();
  const uint32_t n_blocks = reader_->n_blocks();
  auto dtype = FromProtoDType(m.model().kv_dtype());
  const size_t page_bytes =
      2 * size_t{m.block_tokens()} * m.model().head_dim() * (dtype.ok() ? DTypeSize(*dtype) : 4);
  const uint32_t per_frame = static_cast<uint32_t>(
      std::clamp<size_t>(options_.frame_bytes / std::max<size_t>(1, page_bytes), 1, n_blocks));
  storage::PageBatch batch;
  std::vector<uint32_t> blocks;
  Status s;
  bool stopped = false;  // the consumer went away: read nothing more
  for (size_t li = 0; li < layers_.size() && s.ok() && !stopped; ++li) {
    const uint32_t layer = layers_[li];
    for (uint32_t h = 0; h < m.model().n_kv_heads() && s.ok() && !stopped; ++h) {
      for (uint32_t b0 = 0; b0 < n_blocks && s.ok() && !stopped; b0 += per_frame) {
        const uint32_t n = std::min(per_frame, n_blocks - b0);
        blocks.resize(n);
        std::iota(blocks.begin(), blocks.end(), b0);
        s = reader_->ReadPages(layer, h, blocks, &batch);
        if (!s.ok()) break;
        if (options_.on_bytes_read) options_.on_bytes_read(batch.stored_bytes);
        v1::KVFrame frame;
        frame.set_layer(layer);
        frame.set_kv_head(h);
        frame.set_first_block(b0);
        frame.set_n_blocks(n);
        frame.set_dtype(ToProtoDType(batch.dtype));
        const uint32_t tokens = std::accumulate(batch.n_tokens.begin(), batch.n_tokens.end(), 0u);
        frame.set_n_tokens(tokens);
        frame.mutable_page_crc32c()->Add(batch.crc32c.begin(), batch.crc32c.end());
        // Only the context's last page can be short, so the raw payloads are
        // contiguous at page_stride: one copy.
        const size_t payload = size_t{tokens} * 2 * batch.head_dim * DTypeSize(batch.dtype);
        frame.set_payload(reinterpret_cast<const char*>(batch.data.data()), payload);
        if (options_.corrupt_for_testing && payload > 0) (*frame.mutable_payload())[0] ^= 0x01;
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return queue_.size() < options_.read_ahead || stop_; });
        stopped = stop_;
        if (stopped) break;
        queue_.push_back(std::move(frame));
        l.unlock();
        cv_.notify_all();
      }
    }
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    status_ = s;
    done_ = true;
  }
  cv_.notify_all();
}

KVSegmentLayout DenseKVSegmentLayout(const v1::ContextManifest& m) {
  auto dtype = FromProtoDType(m.model().kv_dtype());
  KVSegmentLayout l;
  l.token_stride = uint64_t{m.model().head_dim()} * (dtype.ok() ? DTypeSize(*dtype) : 4);
  l.head_stride = l.token_stride * m.n_tokens();
  l.v_offset = l.head_stride * m.model().n_kv_heads();
  l.layer_stride = 2 * l.v_offset;
  return l;
}

Status FillKVSegment(const storage::ContextReader* reader, const std::vector<uint32_t>& layers,
                     const KVSegmentLayout& layout, uint8_t* base, int threads,
                     const std::function<void(uint32_t)>& on_layer_ready,
                     const std::function<bool()>& stop,
                     const std::function<void(uint64_t)>& on_bytes_read) {
  const v1::ContextManifest& m = reader->manifest();
  const uint32_t n_blocks = reader->n_blocks();
  const uint64_t block_tokens = m.block_tokens();
  constexpr uint32_t kPagesPerRead = 512;
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first;  // guarded by mu
  auto failed = [&] {
    std::lock_guard<std::mutex> l(mu);
    return !first.ok();
  };
  auto work = [&] {
    storage::PageBatch batch;
    std::vector<uint32_t> blocks;
    for (size_t slot = next++; slot < layers.size(); slot = next++) {
      const uint32_t layer = layers[slot];
      Status s;
      for (uint32_t h = 0; h < m.model().n_kv_heads() && s.ok(); ++h) {
        uint8_t* k_head = base + slot * layout.layer_stride + h * layout.head_stride;
        for (uint32_t b0 = 0; b0 < n_blocks && s.ok(); b0 += kPagesPerRead) {
          if (stop() || failed()) return;
          blocks.resize(std::min(kPagesPerRead, n_blocks - b0));
          std::iota(blocks.begin(), blocks.end(), b0);
          s = reader->ReadPages(layer, h, blocks, &batch);
          if (!s.ok()) break;
          if (on_bytes_read) on_bytes_read(batch.stored_bytes);
          for (size_t i = 0; i < batch.size(); ++i) {
            const size_t half = size_t{batch.n_tokens[i]} * layout.token_stride;
            uint8_t* k = k_head + batch.blocks[i] * block_tokens * layout.token_stride;
            std::memcpy(k, batch.K(i), half);
            std::memcpy(k + layout.v_offset, batch.V(i), half);
          }
        }
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> l(mu);
        if (first.ok()) first = s;
        return;
      }
      on_layer_ready(layer);
    }
  };
  const int n = std::clamp(threads, 1, static_cast<int>(std::max<size_t>(1, layers.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  std::lock_guard<std::mutex> l(mu);
  if (first.ok() && stop()) return CancelledError("MapKV: the client went away");
  return first;
}

}  // namespace ctxcache::service
