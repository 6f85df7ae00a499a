#include "service/kv_frames.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <span>
#include <string>

#include "proto/dtype_convert.h"

namespace ctxcache::service {

KVFrameReader::KVFrameReader(const storage::ContextReader* reader, std::vector<uint32_t> layers,
                             KVFrameOptions options)
    : reader_(reader),
      layers_(std::move(layers)),
      options_(std::move(options)),
      pool_(options_.pool != nullptr ? options_.pool : &own_pool_) {
  producer_ = std::thread([this] { Produce(); });
}

KVFrameReader::KVFrameReader(const storage::ContextReader* reader,
                             std::vector<v1::PageTable> tables, KVFrameOptions options)
    : reader_(reader),
      tables_(std::move(tables)),
      options_(std::move(options)),
      pool_(options_.pool != nullptr ? options_.pool : &own_pool_) {
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

v1::KVFrame FramePool::Take() {
  std::lock_guard<std::mutex> l(mu_);
  if (frames_.empty()) return v1::KVFrame();
  v1::KVFrame frame = std::move(frames_.back());
  frames_.pop_back();
  return frame;
}

void FramePool::Give(v1::KVFrame&& frame) {
  frame.Clear();  // the payload and the lists keep their capacity
  std::lock_guard<std::mutex> l(mu_);
  if (frames_.size() < max_) frames_.push_back(std::move(frame));
}

void KVFrameReader::Recycle(v1::KVFrame&& frame) { pool_->Give(std::move(frame)); }

Status KVFrameReader::status() const {
  std::lock_guard<std::mutex> l(mu_);
  return status_;
}

bool KVFrameReader::Push(v1::KVFrame&& frame) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return queue_.size() < options_.read_ahead || stop_; });
  if (stop_) return false;
  queue_.push_back(std::move(frame));
  l.unlock();
  cv_.notify_all();
  return true;
}

bool KVFrameReader::Send(v1::KVFrame&& frame, uint32_t tokens, uint64_t stored) {
  if (options_.on_bytes_read) options_.on_bytes_read(stored);
  frame.set_n_tokens(tokens);
  std::string* payload = frame.mutable_payload();
  if (options_.corrupt_for_testing && !payload->empty()) (*payload)[0] ^= 0x01;
  return Push(std::move(frame));
}

Status KVFrameReader::ProduceTables(size_t page_bytes) {
  const v1::ContextManifest& m = reader_->manifest();
  const size_t per_frame =
      std::max<size_t>(1, options_.table_frame_bytes / std::max<size_t>(1, page_bytes));
  storage::PageBatch batch;
  for (const v1::PageTable& t : tables_) {
    for (int b0 = 0; b0 < t.blocks_size(); b0 += static_cast<int>(per_frame)) {
      const int n = static_cast<int>(std::min<size_t>(per_frame, t.blocks_size() - b0));
      // Each page once, for a worker's own tier: the block cache stays as it is.
      RETURN_IF_ERROR(reader_->ReadPages(t.layer(), t.kv_head(),
                                         std::span<const uint32_t>(t.blocks().data() + b0, n),
                                         &batch, /*fill_cache=*/false));
      v1::KVFrame frame = pool_->Take();
      frame.set_layer(t.layer());
      frame.set_kv_head(t.kv_head());
      frame.set_first_block(t.blocks(b0));
      frame.set_n_blocks(static_cast<uint32_t>(n));
      frame.set_dtype(m.model().kv_dtype());
      std::string* payload = frame.mutable_payload();
      payload->reserve(static_cast<size_t>(n) * page_bytes);
      uint32_t tokens = 0;
      for (size_t i = 0; i < batch.size(); ++i) {
        const size_t half = size_t{batch.n_tokens[i]} * batch.head_dim * DTypeSize(batch.dtype);
        payload->append(reinterpret_cast<const char*>(batch.K(i)), half);
        payload->append(reinterpret_cast<const char*>(batch.V(i)), half);
        frame.add_blocks(batch.blocks[i]);
        frame.add_page_crc32c(batch.crc32c[i]);
        tokens += batch.n_tokens[i];
      }
      if (!Send(std::move(frame), tokens, batch.stored_bytes)) return Status::OK();
    }
  }
  return Status::OK();
}

Status KVFrameReader::ProduceRuns(size_t page_bytes) {
  const v1::ContextManifest& m = reader_->manifest();
  const uint32_t n_blocks = reader_->n_blocks();
  const uint32_t per_frame = static_cast<uint32_t>(
      std::clamp<size_t>(options_.frame_bytes / std::max<size_t>(1, page_bytes), 1,
                         std::max<uint32_t>(1, n_blocks)));
  for (const uint32_t layer : layers_) {
    for (uint32_t h = 0; h < m.model().n_kv_heads(); ++h) {
      for (uint32_t b0 = 0; b0 < n_blocks; b0 += per_frame) {
        const uint32_t n = std::min(per_frame, n_blocks - b0);
        v1::KVFrame frame = pool_->Take();
        frame.set_layer(layer);
        frame.set_kv_head(h);
        frame.set_first_block(b0);
        frame.set_n_blocks(n);
        frame.set_dtype(m.model().kv_dtype());
        std::string* payload = frame.mutable_payload();
        payload->reserve(size_t{n} * page_bytes);
        uint32_t tokens = 0;
        uint64_t stored = 0;
        // One copy: from the stored value (verified) into the frame.
        RETURN_IF_ERROR(reader_->ScanPages(
            layer, h, b0, n, [&](uint32_t, uint32_t n_tokens, uint32_t crc, std::string_view raw) {
              payload->append(raw);
              frame.add_page_crc32c(crc);
              tokens += n_tokens;
              stored += raw.size();
              return Status::OK();
            }));
        // The consumer went away: read nothing more.
        if (!Send(std::move(frame), tokens, stored)) return Status::OK();
      }
    }
  }
  return Status::OK();
}

void KVFrameReader::Produce() {
  const v1::ContextManifest& m = reader_->manifest();
  auto dtype = FromProtoDType(m.model().kv_dtype());
  const size_t page_bytes =
      2 * size_t{m.block_tokens()} * m.model().head_dim() * (dtype.ok() ? DTypeSize(*dtype) : 4);
  const Status s = tables_.empty() ? ProduceRuns(page_bytes) : ProduceTables(page_bytes);
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
  constexpr uint32_t kPagesPerScan = 512;  // between checks of stop()
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first;  // guarded by mu
  auto failed = [&] {
    std::lock_guard<std::mutex> l(mu);
    return !first.ok();
  };
  auto work = [&] {
    for (size_t slot = next++; slot < layers.size(); slot = next++) {
      const uint32_t layer = layers[slot];
      // Fault the layer's pages in with one call instead of one trap per 4 KiB
      // page (best effort: kernels before 5.14 lack it).
      {
        const auto begin = reinterpret_cast<uintptr_t>(base + slot * layout.layer_stride);
        const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
        const uintptr_t start = begin & ~(page - 1);
        (void)madvise(reinterpret_cast<void*>(start), begin + layout.layer_stride - start,
                      MADV_POPULATE_WRITE);
      }
      Status s;
      for (uint32_t h = 0; h < m.model().n_kv_heads() && s.ok(); ++h) {
        uint8_t* k_head = base + slot * layout.layer_stride + h * layout.head_stride;
        for (uint32_t b0 = 0; b0 < n_blocks && s.ok(); b0 += kPagesPerScan) {
          if (stop() || failed()) return;
          uint64_t stored = 0;
          // One copy: from the stored value (verified) into place.
          s = reader->ScanPages(layer, h, b0, std::min(kPagesPerScan, n_blocks - b0),
                                [&](uint32_t block, uint32_t, uint32_t, std::string_view raw) {
                                  uint8_t* k = k_head + block * block_tokens * layout.token_stride;
                                  std::memcpy(k, raw.data(), raw.size() / 2);
                                  std::memcpy(k + layout.v_offset, raw.data() + raw.size() / 2,
                                              raw.size() / 2);
                                  stored += raw.size();
                                  return Status::OK();
                                });
          if (s.ok() && on_bytes_read) on_bytes_read(stored);
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
