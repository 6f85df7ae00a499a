#include "storage/context_reader.h"

#include <rocksdb/db.h>

#include <cstring>

#include "common/crc32c.h"
#include "storage/page_codec.h"
#include "storage/store_internal.h"

namespace ctxcache::storage {

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

Status ContextReader::DecodeInto(uint32_t layer, uint32_t kv_head, uint32_t block,
                                 std::string_view value, size_t slot, PageBatch* out) const {
  PageHeader h;
  Status s = DecodePage(value, out->data.data() + slot * out->page_stride, out->page_stride, &h);
  const uint64_t b = manifest_.block_tokens();
  const uint32_t expect_tokens =
      static_cast<uint32_t>(std::min<uint64_t>(b, manifest_.n_tokens() - block * b));
  if (s.ok() && (h.shape.n_tokens != expect_tokens || h.shape.head_dim != out->head_dim ||
                 h.shape.dtype != dtype_)) {
    s = DataLossError("page shape (" + std::to_string(h.shape.n_tokens) + " tokens, head_dim " +
                      std::to_string(h.shape.head_dim) + ") does not match the manifest");
  }
  if (!s.ok()) {
    return Status(s.code() == StatusCode::kInvalidArgument ? StatusCode::kInternal : s.code(),
                  "context " + id_.ToHex() + " (stored in " + OwnerOf(block).ToHex() + ") layer " +
                      std::to_string(layer) + " kv_head " + std::to_string(kv_head) + " block " +
                      std::to_string(block) + ": " + std::string(s.message()));
  }
  out->n_tokens[slot] = h.shape.n_tokens;
  out->stored_bytes += value.size();
  return Status::OK();
}

Status ContextReader::ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                                PageBatch* out) const {
  return ReadPages(layer, kv_head, blocks, out, core_->options().page_read_method);
}

Status ContextReader::ReadPages(uint32_t layer, uint32_t kv_head, std::span<const uint32_t> blocks,
                                PageBatch* out, PageReadMethod method) const {
  out->dtype = dtype_;
  out->head_dim = manifest_.model().head_dim();
  out->block_tokens = manifest_.block_tokens();
  out->page_stride = 2 * size_t{out->block_tokens} * out->head_dim * DTypeSize(dtype_);
  out->blocks.clear();
  out->n_tokens.clear();
  out->stored_bytes = 0;
  Status s = CheckTable(layer, kv_head, blocks);
  if (s.ok()) {
    out->blocks.assign(blocks.begin(), blocks.end());
    out->n_tokens.assign(blocks.size(), 0);
    out->data.resize(blocks.size() * out->page_stride);
    core_->Touch(id_);
    auto db_lock = core_->LockDb();
    const auto l16 = static_cast<uint16_t>(layer);
    const auto h16 = static_cast<uint16_t>(kv_head);
    rocksdb::ColumnFamilyHandle* cf = core_->cf(kCfPages);
    std::vector<std::string> keys(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i)
      keys[i] = PageKey(OwnerOf(blocks[i]), l16, h16, blocks[i]);
    rocksdb::ReadOptions ro;
    if (method == PageReadMethod::kMultiGet) {
      std::vector<rocksdb::Slice> slices(keys.begin(), keys.end());
      std::vector<rocksdb::PinnableSlice> values(keys.size());
      std::vector<rocksdb::Status> statuses(keys.size());
      // Keys of one owner are sorted; owners are visited parent-first, so the
      // whole list is sorted only without a parent.
      core_->db()->MultiGet(ro, cf, keys.size(), slices.data(), values.data(), statuses.data(),
                            /*sorted_input=*/owners_.size() == 1);
      for (size_t i = 0; i < keys.size() && s.ok(); ++i) {
        if (statuses[i].IsNotFound()) {
          s = DataLossError("context " + id_.ToHex() + " layer " + std::to_string(layer) +
                            " kv_head " + std::to_string(kv_head) + " block " +
                            std::to_string(blocks[i]) + ": page missing");
        } else if (!statuses[i].ok()) {
          s = FromRocks(statuses[i], "read page");
        } else {
          s = DecodeInto(layer, kv_head, blocks[i], values[i].ToStringView(), i, out);
        }
      }
    } else {
      std::unique_ptr<rocksdb::Iterator> it;
      for (size_t i = 0; i < keys.size() && s.ok(); ++i) {
        if (!it) it.reset(core_->db()->NewIterator(ro, cf));
        if (!(it->Valid() && it->key() == rocksdb::Slice(keys[i]))) it->Seek(keys[i]);
        if (!it->Valid() || it->key() != rocksdb::Slice(keys[i])) {
          s = it->status().ok()
                  ? DataLossError("context " + id_.ToHex() + " layer " + std::to_string(layer) +
                                  " kv_head " + std::to_string(kv_head) + " block " +
                                  std::to_string(blocks[i]) + ": page missing")
                  : FromRocks(it->status(), "read page");
          break;
        }
        s = DecodeInto(layer, kv_head, blocks[i], it->value().ToStringView(), i, out);
        it->Next();
      }
    }
  }
  if (!s.ok()) {
    // Never hand out a partially verified batch.
    out->blocks.clear();
    out->n_tokens.clear();
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
