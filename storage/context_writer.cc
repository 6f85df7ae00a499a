#include "storage/context_writer.h"

#include <rocksdb/sst_file_writer.h>
#include <rocksdb/write_batch.h>

#include <cstring>
#include <filesystem>

#include "common/crc32c.h"
#include "common/thread_pool.h"
#include "storage/page_codec.h"
#include "storage/store_internal.h"

namespace ctxcache::storage {

struct ContextWriter::HeadState {
  uint64_t next_token = 0;  // next token index expected
  uint32_t fill = 0;        // tokens in `staging`
  bool seeded = false;      // parent's boundary tokens copied in
  // kPageHeaderSize bytes of room for the page header, then K rows [B][d],
  // then V rows [B][d]: a codec-none page is encoded in place (Payload()).
  std::vector<uint8_t> staging;
  uint8_t* Payload() { return staging.data() + kPageHeaderSize; }
  std::string encoded;  // scratch for the encoded page
  // Ingest path: the open SST of this (layer, kv_head).
  std::unique_ptr<rocksdb::SstFileWriter> sst;
  std::string sst_path;
  uint32_t sst_pages = 0;
  uint32_t sst_seq = 0;
  uint64_t sst_bytes_since_check = 0;
};

ContextWriter::ContextWriter(StoreCore* core, std::shared_ptr<BuildSlot> slot,
                             v1::ContextManifest manifest)
    : core_(core), slot_(std::move(slot)), manifest_(std::move(manifest)) {
  id_ = slot_->id;
  dtype_ = *FromProtoDType(manifest_.model().kv_dtype());
  n_layers_ = manifest_.model().n_layers();
  n_kv_heads_ = manifest_.model().n_kv_heads();
  head_dim_ = manifest_.model().head_dim();
  block_tokens_ = manifest_.block_tokens();
  first_token_ = manifest_.prefix_tokens();
  generation_ = core_->generation();
  shared_blocks_ = manifest_.shared_blocks();
  page_bytes_ = 2 * size_t{block_tokens_} * head_dim_ * DTypeSize(dtype_);
  heads_.resize(size_t{n_layers_} * n_kv_heads_);
  batch_ = std::make_unique<rocksdb::WriteBatch>();
  stored_bytes_.store(manifest_.stored_bytes());  // token ids
  ingest_ = core_->ingest_pages();
  if (ingest_) ingest_dir_ = core_->IngestDir(id_);
}

ContextWriter::~ContextWriter() {
  if (!finished_) Abort().IgnoreError();
}

void ContextWriter::AdjustBuffered(int64_t delta) {
  size_t now = buffered_bytes_.fetch_add(static_cast<size_t>(delta)) + static_cast<size_t>(delta);
  size_t peak = peak_buffered_bytes_.load();
  while (now > peak && !peak_buffered_bytes_.compare_exchange_weak(peak, now)) {
  }
}

Status ContextWriter::FlushBatchLocked() {
  if (batch_->Count() == 0) return Status::OK();
  Status s = core_->CheckDiskSpace(batch_->GetDataSize());
  if (s.ok() && core_->generation() != generation_) {
    s = AbortedError("the store recovered from a disk error during this build; abort and rebuild");
  }
  if (s.ok()) s = core_->Write(batch_.get(), /*sync=*/false, /*disable_wal=*/true);
  batch_->Clear();
  AdjustBuffered(-static_cast<int64_t>(batch_accounted_));
  batch_accounted_ = 0;
  if (!s.ok()) {
    s = s.WithContext("build of " + id_.ToHex());
    if (first_error_.ok()) first_error_ = s;
  }
  return s;
}

Status ContextWriter::AddToBatch(const std::string& key, std::string_view value, int cf) {
  std::lock_guard<std::mutex> l(batch_mu_);
  if (!first_error_.ok()) return first_error_;
  const size_t before = batch_->GetDataSize();
  RETURN_IF_ERROR(FromRocks(
      batch_->Put(core_->cf(cf), key, rocksdb::Slice(value.data(), value.size())), "batch put"));
  const size_t delta = batch_->GetDataSize() - before;
  batch_accounted_ += delta;
  AdjustBuffered(static_cast<int64_t>(delta));
  stored_bytes_.fetch_add(value.size());
  if (batch_->GetDataSize() >= core_->options().write_batch_bytes) return FlushBatchLocked();
  return Status::OK();
}

Status ContextWriter::PutToSst(uint32_t layer, uint32_t kv_head, HeadState* hs,
                               const std::string& key, std::string_view value) {
  if (!hs->sst) {
    RETURN_IF_ERROR(core_->CheckDiskSpace(1 << 20));
    std::error_code ec;
    std::filesystem::create_directories(ingest_dir_, ec);
    hs->sst_path = ingest_dir_ + "/" + std::to_string(layer) + "_" + std::to_string(kv_head) + "_" +
                   std::to_string(hs->sst_seq++) + ".sst";
    // No fallocate: RocksDB would preallocate target_file_size_base per open
    // file, which is wasted (and can exhaust a small disk) with many heads.
    rocksdb::EnvOptions env_options;
    env_options.allow_fallocate = false;
    env_options.writable_file_max_buffer_size = kSstWriteBufferBytes;
    // Start writeback every MiB so that Commit's fsync has little left to do.
    env_options.bytes_per_sync = 1 << 20;
    // O_DIRECT: no copy into the page cache, and nothing left for Commit's
    // fsync to write back. Where the filesystem refuses it, buffered writes.
    env_options.use_direct_writes = core_->options().direct_ingest_writes;
    hs->sst = std::make_unique<rocksdb::SstFileWriter>(env_options, core_->page_sst_options());
    rocksdb::Status opened = hs->sst->Open(hs->sst_path);
    if (!opened.ok() && env_options.use_direct_writes) {
      env_options.use_direct_writes = false;
      hs->sst = std::make_unique<rocksdb::SstFileWriter>(env_options, core_->page_sst_options());
      opened = hs->sst->Open(hs->sst_path);
    }
    RETURN_IF_ERROR(FromRocks(opened, "open " + hs->sst_path));
    hs->sst_pages = 0;
    AdjustBuffered(static_cast<int64_t>(kSstFixedBytes));
  }
  RETURN_IF_ERROR(FromRocks(hs->sst->Put(key, rocksdb::Slice(value.data(), value.size())),
                            "write " + hs->sst_path));
  ++hs->sst_pages;
  AdjustBuffered(static_cast<int64_t>(kSstBytesPerPage));
  stored_bytes_.fetch_add(value.size());
  hs->sst_bytes_since_check += value.size();
  if (hs->sst_bytes_since_check >= (1 << 20)) {
    hs->sst_bytes_since_check = 0;
    RETURN_IF_ERROR(core_->CheckDiskSpace(1 << 20));
  }
  if (hs->sst_pages >= core_->options().ingest_file_pages) return FinishSst(hs);
  return Status::OK();
}

Status ContextWriter::FinishSst(HeadState* hs) {
  if (!hs->sst) return Status::OK();
  Status s = FromRocks(hs->sst->Finish(), "finish " + hs->sst_path);
  AdjustBuffered(-static_cast<int64_t>(kSstFixedBytes + size_t{hs->sst_pages} * kSstBytesPerPage));
  hs->sst.reset();
  hs->sst_pages = 0;
  if (s.ok()) {
    std::lock_guard<std::mutex> l(batch_mu_);
    ingest_files_.push_back(hs->sst_path);
  }
  return s;
}

void ContextWriter::DropIngestFiles() {
  for (auto& hs : heads_) {
    if (hs && hs->sst) {
      AdjustBuffered(
          -static_cast<int64_t>(kSstFixedBytes + size_t{hs->sst_pages} * kSstBytesPerPage));
      hs->sst.reset();
    }
  }
  if (!ingest_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(ingest_dir_, ec);
  }
}

Status ContextWriter::SeedFromParent(uint32_t layer, uint32_t kv_head, HeadState* hs) {
  hs->seeded = true;
  const uint32_t boundary = static_cast<uint32_t>(first_token_ % block_tokens_);
  if (boundary == 0) return Status::OK();
  // The parent's last block is always stored by the parent itself
  // (its shared_blocks <= floor(its prefix / B) <= floor(first_token / B)).
  ASSIGN_OR_RETURN(ContextId parent, ContextId::FromBytes(manifest_.parent_id()));
  std::string value;
  auto db_lock = core_->LockDb();
  RETURN_IF_ERROR(
      FromRocks(core_->db()->Get(rocksdb::ReadOptions(), core_->cf(kCfPages),
                                 PageKey(parent, static_cast<uint16_t>(layer),
                                         static_cast<uint16_t>(kv_head), shared_blocks_),
                                 &value),
                "read parent boundary page"));
  std::vector<uint8_t> raw(page_bytes_);
  PageHeader h;
  Status s = DecodePage(value, raw.data(), raw.size(), &h);
  if (!s.ok()) {
    return s.WithContext("parent context " + parent.ToHex() + " layer " + std::to_string(layer) +
                         " kv_head " + std::to_string(kv_head) + " block " +
                         std::to_string(shared_blocks_));
  }
  if (h.shape.n_tokens != boundary || h.shape.head_dim != head_dim_ || h.shape.dtype != dtype_) {
    return DataLossError("parent context " + parent.ToHex() + ": boundary page has " +
                         std::to_string(h.shape.n_tokens) + " tokens, expected " +
                         std::to_string(boundary));
  }
  const size_t row = size_t{head_dim_} * DTypeSize(dtype_);
  std::memcpy(hs->Payload(), raw.data(), boundary * row);
  std::memcpy(hs->Payload() + page_bytes_ / 2, raw.data() + boundary * row, boundary * row);
  hs->fill = boundary;
  return Status::OK();
}

Status ContextWriter::EmitPage(uint32_t layer, uint32_t kv_head, HeadState* hs) {
  const uint32_t n = hs->fill;
  const uint32_t block = static_cast<uint32_t>((hs->next_token - n) / block_tokens_);
  const size_t row = size_t{head_dim_} * DTypeSize(dtype_);
  if (n < block_tokens_) {
    // Partial last page: V rows follow the n K rows.
    std::memmove(hs->Payload() + n * row, hs->Payload() + page_bytes_ / 2, n * row);
  }
  PageShape shape{dtype_, n, head_dim_};
  std::string_view encoded;
  if (core_->options().page_codec.codec == PageCodec::kNone) {
    ASSIGN_OR_RETURN(encoded,
                     EncodeRawPageInPlace(shape, reinterpret_cast<char*>(hs->staging.data())));
  } else {
    hs->encoded.clear();
    std::string_view raw(reinterpret_cast<const char*>(hs->Payload()), shape.RawBytes());
    RETURN_IF_ERROR(EncodePage(core_->options().page_codec, shape, raw, &hs->encoded));
    encoded = hs->encoded;
  }
  raw_kv_bytes_.fetch_add(shape.RawBytes());
  hs->fill = 0;
  std::string key =
      PageKey(id_, static_cast<uint16_t>(layer), static_cast<uint16_t>(kv_head), block);
  if (ingest_) return PutToSst(layer, kv_head, hs, key, encoded);
  return AddToBatch(key, encoded, kCfPages);
}

Status ContextWriter::AppendStrided(uint32_t layer, uint32_t kv_head, uint64_t token_start,
                                    uint32_t n_tokens, DType dtype, const uint8_t* k,
                                    const uint8_t* v, size_t row_stride_bytes) {
  if (finished_) return FailedPreconditionError("writer already committed or aborted");
  if (layer >= n_layers_) {
    return InvalidArgumentError("layer: expected < " + std::to_string(n_layers_) + ", got " +
                                std::to_string(layer));
  }
  if (kv_head >= n_kv_heads_) {
    return InvalidArgumentError("kv_head: expected < " + std::to_string(n_kv_heads_) + ", got " +
                                std::to_string(kv_head));
  }
  if (dtype != dtype_) {
    return InvalidArgumentError("dtype: context stores " + std::string(DTypeName(dtype_)) +
                                ", got " + std::string(DTypeName(dtype)));
  }
  if (k == nullptr || v == nullptr) return InvalidArgumentError("k/v: null pointer");
  HeadState* hs = heads_[size_t{layer} * n_kv_heads_ + kv_head].get();
  if (hs == nullptr) {
    auto fresh = std::make_unique<HeadState>();
    fresh->next_token = first_token_;
    fresh->staging.resize(kPageHeaderSize + page_bytes_);
    AdjustBuffered(static_cast<int64_t>(fresh->staging.size()));
    hs = fresh.get();
    heads_[size_t{layer} * n_kv_heads_ + kv_head] = std::move(fresh);
  }
  if (token_start != hs->next_token) {
    return InvalidArgumentError(
        "token_start for layer " + std::to_string(layer) + " kv_head " + std::to_string(kv_head) +
        ": expected " + std::to_string(hs->next_token) + ", got " + std::to_string(token_start));
  }
  if (token_start + n_tokens > manifest_.n_tokens()) {
    return InvalidArgumentError("n_tokens: tokens [" + std::to_string(token_start) + ", " +
                                std::to_string(token_start + n_tokens) + ") exceed the context's " +
                                std::to_string(manifest_.n_tokens()));
  }
  if (!hs->seeded) RETURN_IF_ERROR(SeedFromParent(layer, kv_head, hs));
  const size_t row = size_t{head_dim_} * DTypeSize(dtype_);
  uint32_t done = 0;
  while (done < n_tokens) {
    uint32_t take = std::min(n_tokens - done, block_tokens_ - hs->fill);
    for (uint32_t t = 0; t < take; ++t) {
      std::memcpy(hs->Payload() + (hs->fill + t) * row, k + (done + t) * row_stride_bytes, row);
      std::memcpy(hs->Payload() + page_bytes_ / 2 + (hs->fill + t) * row,
                  v + (done + t) * row_stride_bytes, row);
    }
    hs->fill += take;
    hs->next_token += take;
    done += take;
    if (hs->fill == block_tokens_) RETURN_IF_ERROR(EmitPage(layer, kv_head, hs));
  }
  return Status::OK();
}

Status ContextWriter::AppendKV(uint32_t layer, uint32_t kv_head, uint64_t token_start,
                               uint32_t n_tokens, DType dtype, const void* k, const void* v) {
  return AppendStrided(layer, kv_head, token_start, n_tokens, dtype, static_cast<const uint8_t*>(k),
                       static_cast<const uint8_t*>(v), size_t{head_dim_} * DTypeSize(dtype_));
}

Status ContextWriter::AppendLayerKV(uint32_t layer, uint64_t token_start, uint32_t n_tokens,
                                    DType dtype, const void* k, const void* v) {
  const size_t row = size_t{head_dim_} * DTypeSize(dtype_);
  return AppendLayerKVStrided(layer, token_start, n_tokens, dtype, k, v, row, row * n_kv_heads_);
}

Status ContextWriter::AppendLayerKVStrided(uint32_t layer, uint64_t token_start,
                                           uint32_t n_tokens, DType dtype, const void* k,
                                           const void* v, size_t head_stride,
                                           size_t token_stride) {
  auto* kb = static_cast<const uint8_t*>(k);
  auto* vb = static_cast<const uint8_t*>(v);
  if (!core_->options().parallel_encode || n_kv_heads_ == 1) {
    for (uint32_t h = 0; h < n_kv_heads_; ++h) {
      RETURN_IF_ERROR(AppendStrided(layer, h, token_start, n_tokens, dtype, kb + h * head_stride,
                                    vb + h * head_stride, token_stride));
    }
    return Status::OK();
  }
  std::vector<Status> results(n_kv_heads_);
  // Ingest writers block on O_DIRECT writes: give every head a thread of the
  // store's I/O pool so that the CPU work of the others overlaps them.
  ThreadPool* pool = ingest_ ? core_->io_pool() : ThreadPool::Default();
  pool->ParallelFor(n_kv_heads_, [&](size_t begin, size_t end) {
    for (size_t h = begin; h < end; ++h) {
      results[h] = AppendStrided(layer, static_cast<uint32_t>(h), token_start, n_tokens, dtype,
                                 kb + h * head_stride, vb + h * head_stride, token_stride);
    }
  });
  for (auto& s : results) RETURN_IF_ERROR(s);
  return Status::OK();
}

Status ContextWriter::PutArtifact(uint32_t layer, uint32_t kv_head, uint8_t kind,
                                  std::string_view name, std::string_view bytes) {
  if (finished_) return FailedPreconditionError("writer already committed or aborted");
  const bool whole = layer == kWholeContext && kv_head == kWholeContext;
  if (!whole && (layer >= n_layers_ || kv_head >= n_kv_heads_)) {
    return InvalidArgumentError("artifact (layer, kv_head): expected (< " +
                                std::to_string(n_layers_) + ", < " + std::to_string(n_kv_heads_) +
                                ") or (0xFFFF, 0xFFFF), got (" + std::to_string(layer) + ", " +
                                std::to_string(kv_head) + ")");
  }
  const size_t chunk = core_->options().artifact_chunk_bytes;
  const uint64_t n_chunks = bytes.empty() ? 0 : (bytes.size() + chunk - 1) / chunk;
  if (n_chunks > 0xFFFFFFFFull) return InvalidArgumentError("artifact: too large");
  {
    std::lock_guard<std::mutex> l(batch_mu_);
    for (const auto& a : artifacts_) {
      if (a.layer() == layer && a.kv_head() == kv_head && a.kind() == kind) {
        return InvalidArgumentError("artifact (layer " + std::to_string(layer) + ", kv_head " +
                                    std::to_string(kv_head) + ", kind " + std::to_string(kind) +
                                    ") already written");
      }
    }
    v1::ArtifactInfo info;
    info.set_layer(layer);
    info.set_kv_head(kv_head);
    info.set_kind(kind);
    info.set_name(std::string(name));
    info.set_size_bytes(bytes.size());
    info.set_crc32c(crc32c::Value(bytes));
    info.set_n_chunks(static_cast<uint32_t>(n_chunks));
    artifacts_.push_back(std::move(info));
  }
  for (uint64_t c = 0; c < n_chunks; ++c) {
    std::string_view part = bytes.substr(c * chunk, chunk);
    RETURN_IF_ERROR(
        AddToBatch(ArtifactKey(id_, static_cast<uint16_t>(layer), static_cast<uint16_t>(kv_head),
                               kind, static_cast<uint32_t>(c)),
                   part, kCfIndex));
  }
  return Status::OK();
}

void ContextWriter::AddIndexParams(const v1::IndexParams& params) {
  std::lock_guard<std::mutex> l(batch_mu_);
  *manifest_.add_index_params() = params;
}

StatusOr<v1::ContextManifest> ContextWriter::Commit() {
  if (finished_) return FailedPreconditionError("writer already committed or aborted");
  {
    std::lock_guard<std::mutex> l(batch_mu_);
    if (!first_error_.ok()) return first_error_;
  }
  const uint64_t n = manifest_.n_tokens();
  for (uint32_t layer = 0; layer < n_layers_; ++layer) {
    for (uint32_t h = 0; h < n_kv_heads_; ++h) {
      HeadState* hs = heads_[size_t{layer} * n_kv_heads_ + h].get();
      uint64_t got = hs ? hs->next_token : first_token_;
      if (got != n) {
        return InvalidArgumentError("commit: layer " + std::to_string(layer) + " kv_head " +
                                    std::to_string(h) + " has KV up to token " +
                                    std::to_string(got) + ", expected " + std::to_string(n));
      }
      if (hs != nullptr && hs->fill > 0) RETURN_IF_ERROR(EmitPage(layer, h, hs));
    }
  }
  if (ingest_) {
    // Finish (fsync) the open SSTs in parallel on the I/O pool: the device
    // and the filesystem journal overlap them.
    std::vector<Status> results(heads_.size());
    core_->io_pool()->ParallelFor(heads_.size(), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        if (heads_[i]) results[i] = FinishSst(heads_[i].get());
      }
    });
    for (auto& s : results) RETURN_IF_ERROR(s);
  }
  {
    std::lock_guard<std::mutex> l(batch_mu_);
    RETURN_IF_ERROR(FlushBatchLocked());
  }
  for (auto& hs : heads_) {
    if (hs) {
      AdjustBuffered(-static_cast<int64_t>(hs->staging.size()));
      hs.reset();
    }
  }
  v1::ContextManifest man = manifest_;
  for (const auto& a : artifacts_) *man.add_artifacts() = a;
  man.set_stored_bytes(stored_bytes_.load());
  man.set_raw_kv_bytes(raw_kv_bytes_.load());
  ASSIGN_OR_RETURN(v1::ContextManifest committed,
                   core_->CommitBuild(this, std::move(man), ingest_files_));
  finished_ = true;
  manifest_ = committed;
  DropIngestFiles();  // moved into the DB; remove what is left of the dir
  return committed;
}

Status ContextWriter::Abort() {
  if (finished_) return Status::OK();
  finished_ = true;
  {
    std::lock_guard<std::mutex> l(batch_mu_);
    AdjustBuffered(-static_cast<int64_t>(batch_accounted_));
    batch_accounted_ = 0;
    batch_->Clear();
  }
  DropIngestFiles();
  for (auto& hs : heads_) {
    if (hs) {
      AdjustBuffered(-static_cast<int64_t>(hs->staging.size()));
      hs.reset();
    }
  }
  return core_->AbortBuild(this);
}

}  // namespace ctxcache::storage
