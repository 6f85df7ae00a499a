#include "storage/context_reader.h"

#include <rocksdb/db.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>

#include "common/crc32c.h"
#include "common/thread_pool.h"
#include "storage/page_codec.h"
#include "storage/store_internal.h"

namespace ctxcache::storage {

namespace {

// Reads of pages skip RocksDB's block checksum: every page carries a crc32c
// of its payload that DecodeInto / DecodePageView verify on each read (and a
// header naming its layer, kv head and block that CheckPage compares), so the
// block checksum would verify the same bytes a second time. A damaged block
// still fails: its pages' crcs or keys no longer match (DATA_LOSS).
rocksdb::ReadOptions PageReadOptions() {
  rocksdb::ReadOptions ro;
  ro.verify_checksums = false;
  return ro;
}

}  // namespace

ContextReader::ContextReader(StoreCore* core, Lease lease, v1::ContextManifest manifest,
                             std::vector<Owner> owners)
    : core_(core),
      lease_(std::move(lease)),
      manifest_(std::move(manifest)),
      owners_(std::move(owners)) {
  id_ = *ContextId::FromBytes(manifest_.context_id());
  dtype_ = *FromProtoDType(manifest_.model().kv_dtype());
  const uint64_t b = manifest_.block_tokens();
  n_blocks_ = static_cast<uint32_t>((manifest_.n_tokens() + b - 1) / b);
}

ContextReader::~ContextReader() = default;

const ContextId& ContextReader::OwnerOf(uint32_t block) const {
  for (const auto& o : owners_) {
    if (block >= o.first_block) return o.id;
  }
  return owners_.back().id;
}

Status ContextReader::CheckTable(uint32_t layer, uint32_t kv_head,
                                 std::span<const uint32_t> blocks) const {
  if (layer >= manifest_.model().n_layers()) {
    return InvalidArgumentError("layer: expected < " +
                                std::to_string(manifest_.model().n_layers()) + ", got " +
                                std::to_string(layer));
  }
  if (kv_head >= manifest_.model().n_kv_heads()) {
    return InvalidArgumentError("kv_head: expected < " +
                                std::to_string(manifest_.model().n_kv_heads()) + ", got " +
                                std::to_string(kv_head));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] >= n_blocks_) {
      return InvalidArgumentError("page table: block " + std::to_string(blocks[i]) +
                                  " out of range (context has " + std::to_string(n_blocks_) +
                                  " blocks)");
    }
    if (i > 0 && blocks[i] <= blocks[i - 1]) {
      return InvalidArgumentError("page table: blocks must be strictly increasing (entry " +
                                  std::to_string(i) + ")");
    }
  }
  return Status::OK();
}

Status ContextReader::CheckPage(uint32_t layer, uint32_t kv_head, uint32_t block, Status s,
                                const PageHeader& h) const {
  const uint64_t b = manifest_.block_tokens();
  const uint32_t expect_tokens =
      static_cast<uint32_t>(std::min<uint64_t>(b, manifest_.n_tokens() - block * b));
  if (s.ok() && (h.shape.n_tokens != expect_tokens ||
                 h.shape.head_dim != manifest_.model().head_dim() || h.shape.dtype != dtype_)) {
    s = DataLossError("page shape (" + std::to_string(h.shape.n_tokens) + " tokens, head_dim " +
                      std::to_string(h.shape.head_dim) + ") does not match the manifest");
  }
  if (s.ok()) return s;
  return Status(s.code() == StatusCode::kInvalidArgument ? StatusCode::kInternal : s.code(),
                "context " + id_.ToHex() + " (stored in " + OwnerOf(block).ToHex() + ") layer " +
                    std::to_string(layer) + " kv_head " + std::to_string(kv_head) + " block " +
                    std::to_string(block) + ": " + std::string(s.message()));
}

Status ContextReader::DecodeInto(uint32_t layer, uint32_t kv_head, uint32_t block,
                                 std::string_view value, size_t slot, PageBatch* out) const {
  PageHeader h;
  RETURN_IF_ERROR(CheckPage(
      layer, kv_head, block,
      DecodePage(value, out->data.data() + slot * out->page_stride, out->page_stride, &h), h));
  out->n_tokens[slot] = h.shape.n_tokens;
  out->crc32c[slot] = h.crc32c;
  return Status::OK();
}

Status ContextReader::ScanPages(uint32_t layer, uint32_t kv_head, uint32_t first_block, uint32_t n,
                                const PageVisitor& visit) const {
  if (layer >= manifest_.model().n_layers() || kv_head >= manifest_.model().n_kv_heads() ||
      uint64_t{first_block} + n > n_blocks_) {
    return InvalidArgumentError("page scan: layer " + std::to_string(layer) + " kv_head " +
                                std::to_string(kv_head) + " blocks " + std::to_string(first_block) +
                                "+" + std::to_string(n) + " out of range");
  }
  core_->Touch(id_);
  auto db_lock = core_->LockDb();
  rocksdb::ReadOptions ro = PageReadOptions();
  ro.fill_cache = false;
  ro.readahead_size = 4u << 20;
  std::unique_ptr<rocksdb::Iterator> it(core_->db()->NewIterator(ro, core_->cf(kCfPages)));
  const auto l16 = static_cast<uint16_t>(layer);
  const auto h16 = static_cast<uint16_t>(kv_head);
  char key_bytes[kPageKeySize];
  std::string scratch;
  for (uint32_t block = first_block; block < first_block + n; ++block) {
    EncodePageKey(OwnerOf(block), l16, h16, block, key_bytes);
    const rocksdb::Slice key(key_bytes, kPageKeySize);
    if (!(it->Valid() && it->key() == key)) it->Seek(key);
    if (!(it->Valid() && it->key() == key)) {
      if (!it->status().ok()) return FromRocks(it->status(), "read page");
      return DataLossError("context " + id_.ToHex() + " layer " + std::to_string(layer) +
                           " kv_head " + std::to_string(kv_head) + " block " +
                           std::to_string(block) + ": page missing");
    }
    PageHeader h;
    auto raw = DecodePageView(it->value().ToStringView(), &scratch, &h);
    RETURN_IF_ERROR(CheckPage(layer, kv_head, block, raw.status(), h));
    RETURN_IF_ERROR(visit(block, h.shape.n_tokens, h.crc32c, *raw));
    it->Next();
  }
  return Status::OK();
}

Status ContextReader::CheckAndDecode(uint32_t layer, uint32_t kv_head, uint32_t block,
                                     const rocksdb::Status& read, std::string_view value,
                                     size_t slot, PageBatch* out) const {
  if (read.IsNotFound()) {
    return DataLossError("context " + id_.ToHex() + " layer " + std::to_string(layer) +
                         " kv_head " + std::to_string(kv_head) + " block " + std::to_string(block) +
                         ": page missing");
  }
  if (!read.ok()) return FromRocks(read, "read page");
  return DecodeInto(layer, kv_head, block, value, slot, out);
}

namespace {

// Runs task(0) on the calling thread and task(1..n-1) on `pool`, and waits
// for all of them. Unlike ThreadPool::ParallelFor it queues from any thread:
// the I/O pool's tasks never wait on each other, so this cannot deadlock.
void RunOnPool(ThreadPool* pool, size_t n, const std::function<void(size_t)>& task) {
  size_t remaining = n - 1;
  std::mutex mu;
  std::condition_variable cv;
  for (size_t i = 1; i < n; ++i) {
    pool->Submit([&, i] {
      task(i);
      std::lock_guard<std::mutex> l(mu);
      if (--remaining == 0) cv.notify_one();
    });
  }
  task(0);
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return remaining == 0; });
}

// The first error by slot, so that the reported page does not depend on
// which I/O task finished first.
struct FirstError {
  size_t slot = SIZE_MAX;
  Status status;
  void Keep(size_t at, Status s) {
    if (!s.ok() && at < slot) {
      slot = at;
      status = std::move(s);
    }
  }
};

}  // namespace

Status ContextReader::MultiGetPages(uint32_t layer, uint32_t kv_head,
                                    std::span<const uint32_t> blocks,
                                    std::span<const rocksdb::Slice> keys, bool fill_cache,
                                    PageBatch* out) const {
  const size_t n = keys.size();
  // Keys of one owner are sorted; owners are visited parent-first, so the
  // whole list is sorted only without a parent.
  const bool sorted = owners_.size() == 1;
  rocksdb::DB* db = core_->db();
  rocksdb::ColumnFamilyHandle* cf = core_->cf(kCfPages);
  ThreadPool* pool = core_->io_pool();
  const size_t depth = core_->options().read_io_depth;
  std::vector<rocksdb::PinnableSlice> values(n);
  std::vector<rocksdb::Status> statuses(n);
  FirstError first;
  uint64_t stored = 0;
  std::vector<size_t> misses;
  if (depth > 1 && n > 1) {
    // Pass 1, on this thread and without I/O: what the block cache and the
    // memtables hold; misses come back Incomplete. Get, not MultiGet:
    // RocksDB 7.8's MultiGet reads data blocks from the file even under
    // kBlockCacheTier (and then does not cache them).
    rocksdb::ReadOptions cached = PageReadOptions();
    cached.read_tier = rocksdb::kBlockCacheTier;
    for (size_t i = 0; i < n; ++i) statuses[i] = db->Get(cached, cf, keys[i], &values[i]);
    for (size_t i = 0; i < n; ++i) {
      if (statuses[i].IsIncomplete()) {
        misses.push_back(i);
        continue;
      }
      first.Keep(i, CheckAndDecode(layer, kv_head, blocks[i], statuses[i], values[i].ToStringView(),
                                   i, out));
      stored += values[i].size();
      values[i].Reset();
    }
  } else {
    misses.resize(n);
    for (size_t i = 0; i < n; ++i) misses[i] = i;
  }
  if (!misses.empty()) {
    // Pass 2: the misses, split into up to `depth` sorted MultiGets that run
    // at once (each a sequence of synchronous reads), so up to `depth` reads
    // are in flight; each part decodes and verifies its own pages.
    const size_t chunk = (misses.size() + depth - 1) / depth;
    const size_t parts = (misses.size() + chunk - 1) / chunk;
    std::vector<FirstError> part_errors(parts);
    std::vector<uint64_t> part_stored(parts, 0);
    auto read_part = [&](size_t p) {
      const size_t begin = p * chunk, m = std::min(misses.size(), begin + chunk) - begin;
      std::vector<rocksdb::Slice> part_keys(m);
      for (size_t j = 0; j < m; ++j) part_keys[j] = keys[misses[begin + j]];
      std::vector<rocksdb::PinnableSlice> part_values(m);
      std::vector<rocksdb::Status> part_statuses(m);
      rocksdb::ReadOptions ro = PageReadOptions();
      ro.fill_cache = fill_cache;
      db->MultiGet(ro, cf, m, part_keys.data(), part_values.data(), part_statuses.data(), sorted);
      for (size_t j = 0; j < m; ++j) {
        const size_t i = misses[begin + j];
        part_errors[p].Keep(i, CheckAndDecode(layer, kv_head, blocks[i], part_statuses[j],
                                              part_values[j].ToStringView(), i, out));
        part_stored[p] += part_values[j].size();
      }
    };
    if (parts == 1) {
      read_part(0);
    } else {
      RunOnPool(pool, parts, read_part);
    }
    for (size_t p = 0; p < parts; ++p) {
      first.Keep(part_errors[p].slot, std::move(part_errors[p].status));
      stored += part_stored[p];
    }
  }
  out->stored_bytes = stored;
  return first.status;
}

Status ContextReader::ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                                PageBatch* out) const {
  return ReadPagesWith(layer, kv_head, blocks, out, core_->options().page_read_method, true);
}

Status ContextReader::ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                                PageBatch* out, PageReadMethod method) const {
  return ReadPagesWith(layer, kv_head, blocks, out, method, true);
}

Status ContextReader::ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                                PageBatch* out, bool fill_cache) const {
  return ReadPagesWith(layer, kv_head, blocks, out, core_->options().page_read_method,
                       fill_cache);
}

Status ContextReader::ReadPagesWith(uint32_t layer, uint32_t kv_head,
                                    std::span<const uint32_t> blocks, PageBatch* out,
                                    PageReadMethod method, bool fill_cache) const {
  out->dtype = dtype_;
  out->head_dim = manifest_.model().head_dim();
  out->block_tokens = manifest_.block_tokens();
  out->page_stride = 2 * size_t{out->block_tokens} * out->head_dim * DTypeSize(dtype_);
  out->blocks.clear();
  out->n_tokens.clear();
  out->crc32c.clear();
  out->stored_bytes = 0;
  Status s = CheckTable(layer, kv_head, blocks);
  if (s.ok()) {
    out->blocks.assign(blocks.begin(), blocks.end());
    out->n_tokens.assign(blocks.size(), 0);
    out->crc32c.assign(blocks.size(), 0);
    out->data.resize(blocks.size() * out->page_stride);
    core_->Touch(id_);
    auto db_lock = core_->LockDb();
    const auto l16 = static_cast<uint16_t>(layer);
    const auto h16 = static_cast<uint16_t>(kv_head);
    // All keys in one buffer: no allocation per page.
    std::vector<char> key_bytes(blocks.size() * kPageKeySize);
    std::vector<rocksdb::Slice> keys(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      char* k = key_bytes.data() + i * kPageKeySize;
      EncodePageKey(OwnerOf(blocks[i]), l16, h16, blocks[i], k);
      keys[i] = rocksdb::Slice(k, kPageKeySize);
    }
    if (method == PageReadMethod::kMultiGet) {
      s = MultiGetPages(layer, kv_head, blocks, keys, fill_cache, out);
    } else {
      rocksdb::ReadOptions ro = PageReadOptions();
      ro.fill_cache = fill_cache;
      std::unique_ptr<rocksdb::Iterator> it(core_->db()->NewIterator(ro, core_->cf(kCfPages)));
      for (size_t i = 0; i < keys.size() && s.ok(); ++i) {
        if (!(it->Valid() && it->key() == keys[i])) it->Seek(keys[i]);
        const bool found = it->Valid() && it->key() == keys[i];
        s = CheckAndDecode(layer, kv_head, blocks[i],
                           found               ? rocksdb::Status::OK()
                           : it->status().ok() ? rocksdb::Status::NotFound()
                                               : it->status(),
                           found ? it->value().ToStringView() : std::string_view(), i, out);
        if (s.ok()) out->stored_bytes += it->value().size();
        if (found) it->Next();
      }
    }
  }
  if (!s.ok()) {
    // Never hand out a partially verified batch.
    out->blocks.clear();
    out->n_tokens.clear();
    out->crc32c.clear();
    out->data.clear();
    out->stored_bytes = 0;
  }
  return s;
}

StatusOr<std::string> ContextReader::ReadArtifact(uint32_t layer, uint32_t kv_head,
                                                  uint8_t kind) const {
  const v1::ArtifactInfo* info = nullptr;
  for (const auto& a : manifest_.artifacts()) {
    if (a.layer() == layer && a.kv_head() == kv_head && a.kind() == kind) info = &a;
  }
  const std::string where = "context " + id_.ToHex() + " artifact (layer " + std::to_string(layer) +
                            ", kv_head " + std::to_string(kv_head) + ", kind " +
                            std::to_string(kind) + ")";
  if (info == nullptr) return NotFoundError(where + " not found");
  core_->Touch(id_);
  auto db_lock = core_->LockDb();
  std::string out;
  out.reserve(info->size_bytes());
  std::string chunk;
  for (uint32_t c = 0; c < info->n_chunks(); ++c) {
    rocksdb::Status rs = core_->db()->Get(
        rocksdb::ReadOptions(), core_->cf(kCfIndex),
        ArtifactKey(id_, static_cast<uint16_t>(layer), static_cast<uint16_t>(kv_head), kind, c),
        &chunk);
    if (rs.IsNotFound()) return DataLossError(where + ": chunk " + std::to_string(c) + " missing");
    RETURN_IF_ERROR(FromRocks(rs, where));
    out += chunk;
  }
  if (out.size() != info->size_bytes() || crc32c::Value(out) != info->crc32c()) {
    return DataLossError(where + ": size or crc32c mismatch");
  }
  return out;
}

StatusOr<std::vector<uint32_t>> ContextReader::ReadTokens() const {
  std::vector<uint32_t> out;
  const uint64_t n = manifest_.n_tokens();
  out.reserve(n);
  std::string v;
  auto db_lock = core_->LockDb();
  for (uint32_t c = 0; uint64_t{c} * kTokensPerChunk < n; ++c) {
    rocksdb::Status rs =
        core_->db()->Get(rocksdb::ReadOptions(), core_->cf(kCfTokens), TokenKey(id_, c), &v);
    if (rs.IsNotFound()) {
      return DataLossError("context " + id_.ToHex() + ": token chunk " + std::to_string(c) +
                           " missing");
    }
    RETURN_IF_ERROR(FromRocks(rs, "read tokens"));
    const uint64_t expect = std::min<uint64_t>(kTokensPerChunk, n - uint64_t{c} * kTokensPerChunk);
    if (v.size() != expect * 4) {
      return DataLossError("context " + id_.ToHex() + ": token chunk " + std::to_string(c) +
                           " has the wrong size");
    }
    for (size_t i = 0; i < expect; ++i) {
      uint32_t t;
      std::memcpy(&t, v.data() + 4 * i, 4);  // little-endian host (x86-64)
      out.push_back(t);
    }
  }
  return out;
}

}  // namespace ctxcache::storage
