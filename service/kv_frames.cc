#include "service/kv_frames.h"

#include <algorithm>
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

}  // namespace ctxcache::service
