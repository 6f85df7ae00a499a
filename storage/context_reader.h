// ContextReader: reads one READY context (pages by page table, artifacts,
// token ids). Created by Store::OpenReader; holds a Lease, so the context is
// not deleted while the reader lives.
//
// Every page read is checked against its crc32c. A bad page makes the whole
// call fail with DATA_LOSS naming context, layer, kv head and block, and the
// output batch is cleared: a bad page is never handed out.
//
// Thread-safety: const methods are safe for concurrent use; each caller
// passes its own PageBatch.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "ctxcache/v1/storage.pb.h"
#include "storage/keys.h"
#include "storage/store.h"

namespace rocksdb {
class Slice;
class Status;
}  // namespace rocksdb

namespace ctxcache::storage {

struct PageHeader;

// Decoded pages of one (layer, kv_head), fixed stride. Page i occupies
// data[i * page_stride, (i+1) * page_stride): K rows [n_tokens[i]][head_dim]
// at offset 0, V rows at offset n_tokens[i] * head_dim * DTypeSize(dtype).
// Only the last block of a context can have n_tokens < block_tokens.
struct PageBatch {
  DType dtype = DType::kBF16;
  uint32_t head_dim = 0;
  uint32_t block_tokens = 0;
  size_t page_stride = 0;  // 2 * block_tokens * head_dim * DTypeSize(dtype)
  std::vector<uint32_t> blocks;
  std::vector<uint32_t> n_tokens;
  // crc32c of each page's raw payload (K rows then V rows), verified on read.
  std::vector<uint32_t> crc32c;
  std::vector<uint8_t> data;
  // Encoded bytes read from storage for this batch.
  uint64_t stored_bytes = 0;

  size_t size() const { return blocks.size(); }
  const uint8_t* K(size_t i) const { return data.data() + i * page_stride; }
  const uint8_t* V(size_t i) const {
    return K(i) + size_t{n_tokens[i]} * head_dim * DTypeSize(dtype);
  }
};

class ContextReader {
 public:
  ~ContextReader();
  ContextReader(const ContextReader&) = delete;
  ContextReader& operator=(const ContextReader&) = delete;

  const ContextId& id() const { return id_; }
  const v1::ContextManifest& manifest() const { return manifest_; }
  uint32_t n_blocks() const { return n_blocks_; }

  // Reads the pages `blocks` (a page table: strictly increasing block
  // numbers < n_blocks()) of (layer, kv_head) into *out (resized; previous
  // contents dropped). Blocks shared with a parent are read from it.
  // `method` overrides StoreOptions::page_read_method.
  Status ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                   PageBatch* out) const;
  Status ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                   PageBatch* out, PageReadMethod method) const;
  // The same, leaving the block cache as it is when `fill_cache` is false:
  // for pages fetched once (a worker filling its own host tier), which would
  // only churn the cache. Pages already cached are still read from it.
  Status ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                   PageBatch* out, bool fill_cache) const;

  // Bulk read: visits pages [first_block, first_block + n) of (layer,
  // kv_head) in order (first_block + n <= n_blocks()), each verified like
  // ReadPages, as a view of its raw payload (K rows then V rows, n_tokens
  // each) valid only during the call: no copy into a batch. Reads ahead and
  // leaves the block cache alone (a bulk load of a context larger than the
  // cache would only churn it). Stops at the first error (DATA_LOSS naming
  // the page) or the first non-OK status `visit` returns, and returns it.
  using PageVisitor = std::function<Status(uint32_t block, uint32_t n_tokens, uint32_t crc32c,
                                           std::string_view raw)>;
  Status ScanPages(uint32_t layer, uint32_t kv_head, uint32_t first_block, uint32_t n,
                   const PageVisitor& visit) const;

  // The artifact stored under (layer, kv_head, kind); NOT_FOUND if none,
  // DATA_LOSS if its size or crc32c does not match the manifest.
  StatusOr<std::string> ReadArtifact(uint32_t layer, uint32_t kv_head, uint8_t kind) const;

  // All token ids of the context.
  StatusOr<std::vector<uint32_t>> ReadTokens() const;

 private:
  friend class StoreCore;
  struct Owner {
    uint32_t first_block;  // this owner stores blocks >= first_block (down to the next owner)
    ContextId id;
  };
  ContextReader(StoreCore* core, Lease lease, v1::ContextManifest manifest,
                std::vector<Owner> owners);
  const ContextId& OwnerOf(uint32_t block) const;
  Status CheckTable(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks) const;
  // The page's shape against the manifest, and any error `s` of reading or
  // decoding it prefixed with the page's coordinates.
  Status CheckPage(uint32_t layer, uint32_t kv_head, uint32_t block, Status s,
                   const PageHeader& h) const;
  // Decodes and verifies one page into slot `slot` of *out.
  Status DecodeInto(uint32_t layer, uint32_t kv_head, uint32_t block, std::string_view value,
                    size_t slot, PageBatch* out) const;
  // DecodeInto after the RocksDB read status of the page (NotFound: the page
  // is missing, DATA_LOSS).
  Status CheckAndDecode(uint32_t layer, uint32_t kv_head, uint32_t block,
                        const rocksdb::Status& read, std::string_view value, size_t slot,
                        PageBatch* out) const;
  // PageReadMethod::kMultiGet: cached pages on this thread, the misses as
  // up to StoreOptions::read_io_depth concurrent MultiGets on the store's
  // I/O pool. Sets out->stored_bytes.
  Status MultiGetPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                       std::span<const rocksdb::Slice> keys, bool fill_cache,
                       PageBatch* out) const;
  Status ReadPagesWith(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                       PageBatch* out, PageReadMethod method, bool fill_cache) const;

  StoreCore* core_;
  Lease lease_;
  v1::ContextManifest manifest_;
  ContextId id_;
  DType dtype_;
  uint32_t n_blocks_;
  std::vector<Owner> owners_;  // ordered by first_block descending
};

}  // namespace ctxcache::storage
