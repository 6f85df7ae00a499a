// ContextWriter: the streaming build of one context (created by
// Store::BeginBuild).
//
// KV arrives per (layer, kv_head) in token order, in chunks of any size; the
// writer cuts it into pages of B tokens, encodes each full page and hands it
// to RocksDB as soon as its write batch reaches StoreOptions::write_batch_bytes.
// Only the current partial page of each (layer, kv_head) and one pending
// batch are buffered, so memory does not grow with the context
// (peak_buffered_bytes() <= StoreOptions::max_writer_buffer_bytes, checked
// at BeginBuild).
//
// For a child context (BuildRequest::parent) the KV starts at token
// first_token() == parent's n_tokens; blocks below shared_blocks =
// floor(prefix_tokens / B) are read from the parent, and the parent's
// partially filled last block is copied into the child's first own block.
//
// Commit() checks that every (layer, kv_head) received exactly n_tokens
// tokens, makes the pages durable, and flips the manifest to READY in one
// synced WriteBatch. Abort() (or destruction without Commit) deletes
// everything written and reclaims the space. After any error the writer
// should be aborted.
//
// Thread-safety: AppendKV / AppendLayerKV / PutArtifact may be called
// concurrently for different (layer, kv_head); Commit and Abort must not race
// with any other call.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "ctxcache/v1/storage.pb.h"
#include "storage/keys.h"

namespace rocksdb {
class WriteBatch;
}  // namespace rocksdb

namespace ctxcache::storage {

class StoreCore;
struct BuildSlot;

class ContextWriter {
 public:
  ~ContextWriter();  // Aborts if neither committed nor aborted.
  ContextWriter(const ContextWriter&) = delete;
  ContextWriter& operator=(const ContextWriter&) = delete;

  const ContextId& id() const { return id_; }
  // The BUILDING manifest (n_tokens, model, parent, ...).
  const v1::ContextManifest& manifest() const { return manifest_; }
  // First token whose KV this writer expects (0, or prefix_tokens for a child).
  uint64_t first_token() const { return first_token_; }

  // KV of tokens [token_start, token_start + n_tokens) of one (layer, kv_head).
  // k and v hold n_tokens * head_dim elements each, row-major [token][dim],
  // of `dtype`, which must equal the model's kv_dtype. token_start must be
  // where the previous call for this (layer, kv_head) ended.
  Status AppendKV(uint32_t layer, uint32_t kv_head, uint64_t token_start, uint32_t n_tokens,
                  DType dtype, const void* k, const void* v);

  // KV of all kv heads of one layer: k and v are [n_tokens][n_kv_heads][head_dim]
  // (the layout a forward pass produces).
  Status AppendLayerKV(uint32_t layer, uint64_t token_start, uint32_t n_tokens, DType dtype,
                       const void* k, const void* v);
  // The same for any layout: kv head h's row t at h * head_stride + t *
  // token_stride bytes from k (and v). [n_kv_heads][n_tokens][head_dim] (an
  // ingest chunk's layout) is head_stride = n_tokens * row, token_stride = row.
  // The heads are encoded and written in parallel (parallel_encode).
  Status AppendLayerKVStrided(uint32_t layer, uint64_t token_start, uint32_t n_tokens,
                              DType dtype, const void* k, const void* v, size_t head_stride,
                              size_t token_stride);

  // Stores an index artifact (opaque bytes, chunked) under (layer, kv_head,
  // kind); layer = kv_head = kWholeContext for per-context artifacts. A
  // second artifact with the same key is INVALID_ARGUMENT.
  Status PutArtifact(uint32_t layer, uint32_t kv_head, uint8_t kind, std::string_view name,
                     std::string_view bytes);
  // Records the parameters of an index method in the manifest.
  void AddIndexParams(const v1::IndexParams& params);

  // Makes the context READY and returns its manifest.
  StatusOr<v1::ContextManifest> Commit();
  // Deletes everything written. Idempotent.
  Status Abort();

  // Bytes buffered now / at most so far (partial pages + pending batch).
  size_t buffered_bytes() const { return buffered_bytes_.load(); }
  size_t peak_buffered_bytes() const { return peak_buffered_bytes_.load(); }
  // Encoded bytes handed to RocksDB so far.
  uint64_t bytes_written() const { return stored_bytes_.load(); }

 private:
  friend class StoreCore;
  struct HeadState;

  ContextWriter(StoreCore* core, std::shared_ptr<BuildSlot> slot, v1::ContextManifest manifest);
  Status AppendStrided(uint32_t layer, uint32_t kv_head, uint64_t token_start, uint32_t n_tokens,
                       DType dtype, const uint8_t* k, const uint8_t* v, size_t row_stride_bytes);
  Status EmitPage(uint32_t layer, uint32_t kv_head, HeadState* hs);
  Status SeedFromParent(uint32_t layer, uint32_t kv_head, HeadState* hs);
  Status AddToBatch(const std::string& key, std::string_view value, int cf);
  Status PutToSst(uint32_t layer, uint32_t kv_head, HeadState* hs, const std::string& key,
                  std::string_view value);
  Status FinishSst(HeadState* hs);
  void DropIngestFiles();
  Status FlushBatchLocked();
  void AdjustBuffered(int64_t delta);

  StoreCore* core_;
  std::shared_ptr<BuildSlot> slot_;
  v1::ContextManifest manifest_;
  ContextId id_;
  DType dtype_;
  uint32_t n_layers_, n_kv_heads_, head_dim_, block_tokens_;
  uint64_t first_token_;
  uint32_t shared_blocks_;
  uint64_t generation_;  // StoreCore::generation() at BeginBuild
  size_t page_bytes_;    // raw bytes of a full page

  std::vector<std::unique_ptr<HeadState>> heads_;  // n_layers * n_kv_heads

  std::mutex batch_mu_;
  std::unique_ptr<rocksdb::WriteBatch> batch_;  // guarded by batch_mu_
  size_t batch_accounted_ = 0;  // bytes of batch_ counted in buffered_bytes_; guarded by batch_mu_
  std::vector<v1::ArtifactInfo> artifacts_;  // guarded by batch_mu_
  std::vector<std::string> ingest_files_;    // finished page SSTs; guarded by batch_mu_
  bool ingest_ = false;
  std::string ingest_dir_;
  Status first_error_;  // guarded by batch_mu_

  std::atomic<size_t> buffered_bytes_{0};
  std::atomic<size_t> peak_buffered_bytes_{0};
  std::atomic<uint64_t> stored_bytes_{0};
  std::atomic<uint64_t> raw_kv_bytes_{0};
  bool finished_ = false;
};

}  // namespace ctxcache::storage
