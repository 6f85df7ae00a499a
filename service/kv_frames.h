// KVFrameReader: a context's pages as KVFrames (the FetchKV RPC), read on a
// background thread ahead of the caller, so storage reads overlap sends.
//
// Frames come in (layer in the given order, kv_head, block) order; each holds
// whole consecutive pages of one (layer, kv_head), about frame_bytes of
// payload (at least one page). Pages are verified against their crc32c as
// they are read (storage/context_reader.h); the stored crc travels with the
// page, so the client checks the same value end to end.
//
// FillKVSegment copies the same pages into a dense memory segment instead
// (MapKV's shared memory).
//
// Thread-safety: one consumer thread calls Next; the reader owns its
// producer thread and joins it in the destructor (which also stops it early).
// FillKVSegment is reentrant.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "common/status.h"
#include "ctxcache/v1/ctxcache_service.pb.h"
#include "storage/context_reader.h"

namespace ctxcache::service {

// Sent frames kept for reuse, so a new frame's payload is memory already
// faulted in: a fresh 4 MiB payload is a fresh mapping whose pages the
// kernel faults in and clears (15% of the server's samples while a worker
// fetched pages on the 2-core VM). Holds at most `max_frames`.
// Thread-safe.
class FramePool {
 public:
  explicit FramePool(size_t max_frames = 16) : max_(max_frames) {}
  // An empty frame, with a kept one's buffers when there is one.
  v1::KVFrame Take();
  // Clears `frame` (its buffers keep their capacity) and keeps it if there is room.
  void Give(v1::KVFrame&& frame);

 private:
  const size_t max_;
  std::mutex mu_;
  std::vector<v1::KVFrame> frames_;  // guarded by mu_
};

struct KVFrameOptions {
  // Target payload bytes per frame of a bulk load (whole layers). Default: 4 MiB.
  size_t frame_bytes = 4u << 20;
  // The same for page tables (a decode step's scattered pages, often a few
  // MiB a call): smaller frames let reading, sending and the client's
  // placing overlap within one call. Default: 1 MiB (a call of 410 pages,
  // 3.3 MB, on the 2-core VM: 0.70-0.78 GB/s, against 0.42-0.56 in one
  // 4 MiB frame; docs/benchmarks.md, "Sparse time to first token").
  size_t table_frame_bytes = 1u << 20;
  // Frames read ahead of the consumer. Default: 4.
  size_t read_ahead = 4;
  // Flip one bit of each frame's first page after its crc was taken
  // (--fault-corrupt-pages-for-testing). Default: false.
  bool corrupt_for_testing = false;
  // Called with the stored bytes read for each frame (metrics). May be empty.
  std::function<void(uint64_t)> on_bytes_read;
  // Where frames come from and Recycle returns them (shared by a server's
  // calls; must outlive the reader). Default: null = the reader's own.
  FramePool* pool = nullptr;
};

class KVFrameReader {
 public:
  // `reader` must outlive this object. `layers` are valid layer numbers.
  KVFrameReader(const storage::ContextReader* reader, std::vector<uint32_t> layers,
                KVFrameOptions options);
  // Only the pages of `tables` (checked by proto/page_tables.h), table by table;
  // each frame holds pages of one table and lists them in KVFrame.blocks.
  KVFrameReader(const storage::ContextReader* reader, std::vector<v1::PageTable> tables,
                KVFrameOptions options);
  ~KVFrameReader();
  KVFrameReader(const KVFrameReader&) = delete;
  KVFrameReader& operator=(const KVFrameReader&) = delete;

  // The next frame into *frame; false at the end or after an error
  // (status() says which).
  bool Next(v1::KVFrame* frame);
  // Hands a sent frame back to the pool (KVFrameOptions::pool): later frames
  // reuse its buffers.
  void Recycle(v1::KVFrame&& frame);
  // OK, or the first read error (e.g. DATA_LOSS naming the page).
  Status status() const;

 private:
  void Produce();
  // Whole layers as runs of consecutive pages; only the tables' pages.
  Status ProduceRuns(size_t page_bytes);
  Status ProduceTables(size_t page_bytes);
  // Completes a frame (its token count, the metrics) and hands it over.
  bool Send(v1::KVFrame&& frame, uint32_t tokens, uint64_t stored);
  // Hands a frame to the consumer; false once it went away.
  bool Push(v1::KVFrame&& frame);

  const storage::ContextReader* reader_;
  const std::vector<uint32_t> layers_;
  const std::vector<v1::PageTable> tables_;
  const KVFrameOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::KVFrame> queue_;  // guarded by mu_
  FramePool own_pool_;
  FramePool* pool_;  // options_.pool or &own_pool_
  bool done_ = false;              // guarded by mu_: the producer finished
  bool stop_ = false;              // guarded by mu_: the consumer went away
  Status status_;                  // guarded by mu_
  std::thread producer_;
};

// Where each element goes in a KV segment: K of (layer slot i, kv head h,
// token t) at i * layer_stride + h * head_stride + t * token_stride, V at
// the same plus v_offset (bytes). Dense: [slot][K then V][kv head][token][dim].
struct KVSegmentLayout {
  uint64_t layer_stride = 0;
  uint64_t head_stride = 0;
  uint64_t token_stride = 0;
  uint64_t v_offset = 0;
};
KVSegmentLayout DenseKVSegmentLayout(const v1::ContextManifest& m);

// Copies every page of `layers` (valid layer numbers, slot order) into
// `base` (at least layers.size() * layout.layer_stride bytes) at `layout`,
// up to `threads` layers at a time. Calls on_layer_ready(layer) from the
// filling threads as each layer completes; stops early (CANCELLED) once
// stop() returns true. Returns the first read error (e.g. DATA_LOSS).
Status FillKVSegment(const storage::ContextReader* reader, const std::vector<uint32_t>& layers,
                     const KVSegmentLayout& layout, uint8_t* base, int threads,
                     const std::function<void(uint32_t)>& on_layer_ready,
                     const std::function<bool()>& stop,
                     const std::function<void(uint64_t)>& on_bytes_read);

}  // namespace ctxcache::service
