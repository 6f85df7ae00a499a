// StoreCore's builds: parent checks, BeginBuild (idempotent, reuse of a READY
// context), CommitBuild (one synced batch flips the manifest to READY) and
// AbortBuild.
#include "storage/store.h"

#include <rocksdb/cache.h>
#include <rocksdb/convenience.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/statistics.h>
#include <rocksdb/table.h>
#include <spdlog/spdlog.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>
#include <set>

#include "common/logging.h"
#include "storage/manifest_codec.h"
#include "storage/store_detail.h"
#include "storage/store_internal.h"

namespace ctxcache::storage {

using store_detail::kMaxLayersOrHeads;
using store_detail::Hex;

// ---- Builds -----------------------------------------------------------------

Status StoreCore::CheckParentLocked(const BuildRequest& req, const ContextId& parent,
                                    v1::ContextManifest* parent_manifest) const {
  auto it = contexts_.find(parent);
  if (it == contexts_.end() || it->second->doomed) {
    return NotServedLocked(parent).WithContext("parent");
  }
  const v1::ContextManifest& pm = it->second->manifest;
  if (pm.model().fingerprint() != req.model.fingerprint()) {
    return InvalidArgumentError("parent context " + Hex(parent) +
                                " was built with a different model fingerprint");
  }
  if (pm.n_tokens() >= req.tokens.size()) {
    return InvalidArgumentError("tokens: a child of " + Hex(parent) + " needs more than " +
                                std::to_string(pm.n_tokens()) + " tokens, got " +
                                std::to_string(req.tokens.size()));
  }
  if (pm.block_tokens() != options_.block_tokens) {
    return InvalidArgumentError("parent context uses block_tokens " +
                                std::to_string(pm.block_tokens()) + ", store uses " +
                                std::to_string(options_.block_tokens));
  }
  *parent_manifest = pm;
  return Status::OK();
}

StatusOr<std::vector<uint32_t>> StoreCore::ReadTokensRaw(const ContextId& id,
                                                         uint64_t n_tokens) const {
  std::vector<uint32_t> out;
  out.reserve(n_tokens);
  auto l = LockDb();
  uint32_t n_chunks = static_cast<uint32_t>((n_tokens + kTokensPerChunk - 1) / kTokensPerChunk);
  for (uint32_t c = 0; c < n_chunks; ++c) {
    std::string v;
    RETURN_IF_ERROR(FromRocks(db_->Get(rocksdb::ReadOptions(), cf(kCfTokens), TokenKey(id, c), &v),
                              "read tokens of " + Hex(id)));
    uint64_t expect = std::min<uint64_t>(kTokensPerChunk, n_tokens - uint64_t{c} * kTokensPerChunk);
    if (v.size() != expect * 4) {
      return DataLossError("context " + Hex(id) + ": token chunk " + std::to_string(c) + " has " +
                           std::to_string(v.size()) + " bytes, expected " +
                           std::to_string(expect * 4));
    }
    for (size_t i = 0; i < expect; ++i) out.push_back(GetLE32(v.data() + 4 * i));
  }
  return out;
}

Status StoreCore::CheckBuildRequest(const BuildRequest& req) const {
  const v1::ModelSpec& m = req.model;
  if (m.n_layers() == 0 || m.n_layers() > kMaxLayersOrHeads) {
    return InvalidArgumentError("model.n_layers: expected 1..65534, got " +
                                std::to_string(m.n_layers()));
  }
  if (m.n_kv_heads() == 0 || m.n_kv_heads() > kMaxLayersOrHeads) {
    return InvalidArgumentError("model.n_kv_heads: expected 1..65534, got " +
                                std::to_string(m.n_kv_heads()));
  }
  if (m.head_dim() == 0 || m.head_dim() > 0xFFFF) {
    return InvalidArgumentError("model.head_dim: expected 1..65535, got " +
                                std::to_string(m.head_dim()));
  }
  ASSIGN_OR_RETURN(DType dtype, FromProtoDType(m.kv_dtype()));
  if (m.fingerprint().empty()) {
    return InvalidArgumentError("model.fingerprint: expected a non-empty hash");
  }
  if (req.tokens.empty()) return InvalidArgumentError("tokens: expected at least one token");
  size_t staging =
      size_t{m.n_layers()} * m.n_kv_heads() *
      (kPageHeaderSize + 2 * size_t{options_.block_tokens} * m.head_dim() * DTypeSize(dtype));
  if (ingest_pages()) {
    staging += size_t{m.n_layers()} * m.n_kv_heads() *
               (kSstFixedBytes + size_t{options_.ingest_file_pages} * kSstBytesPerPage);
  }
  if (staging + 2 * options_.write_batch_bytes > options_.max_writer_buffer_bytes) {
    return InvalidArgumentError(
        "StoreOptions.max_writer_buffer_bytes: " +
        std::to_string(options_.max_writer_buffer_bytes) +
        " is too small for this model; need at least " +
        std::to_string(staging + 2 * options_.write_batch_bytes) +
        " (per layer and kv head: one partial page and, with ingest_pages, one open SST index;"
        " plus two write batches)");
  }
  return Status::OK();
}

StatusOr<std::shared_ptr<BuildSlot>> StoreCore::ClaimBuildSlot(
    const BuildRequest& req, const ContextId& id, v1::ContextManifest* existing,
    v1::ContextManifest* parent_manifest) {
  std::unique_lock<std::mutex> l(mu_);
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(options_.concurrent_build_wait_ms);
  for (;;) {
    auto it = contexts_.find(id);
    if (it != contexts_.end() && !it->second->doomed) {
      it->second->last_access_ms.store(clock_->NowMillis());
      *existing = it->second->manifest;
      existing->set_last_access_ms(it->second->last_access_ms.load());
      return std::shared_ptr<BuildSlot>();
    }
    if (it != contexts_.end()) {
      return UnavailableError("context " + Hex(id) +
                              " is being deleted (leased); retry after its sessions close");
    }
    if (quarantined_.count(id)) return NotServedLocked(id);
    auto b = building_.find(id);
    if (b == building_.end()) break;
    std::shared_ptr<BuildSlot> other = b->second;
    // Wait for the other build of the same id; then re-check.
    if (!build_cv_.wait_until(l, deadline, [&] { return other->done; })) {
      return UnavailableError("context " + Hex(id) +
                              " is being built by another request; timed out waiting");
    }
  }
  if (req.parent) RETURN_IF_ERROR(CheckParentLocked(req, *req.parent, parent_manifest));
  auto slot = std::make_shared<BuildSlot>();
  slot->id = id;
  slot->parent = req.parent;
  building_[id] = slot;
  if (req.parent) ++contexts_[*req.parent]->children;
  return slot;
}

Status StoreCore::CheckParentPrefix(const BuildRequest& req,
                                    const v1::ContextManifest& parent_manifest) const {
  ASSIGN_OR_RETURN(std::vector<uint32_t> ptoks,
                   ReadTokensRaw(*req.parent, parent_manifest.n_tokens()));
  if (!std::equal(ptoks.begin(), ptoks.end(), req.tokens.begin())) {
    return InvalidArgumentError("tokens: the parent context's " + std::to_string(ptoks.size()) +
                                " token ids are not a prefix of the request's tokens");
  }
  return Status::OK();
}

v1::ContextManifest StoreCore::BuildingManifest(const BuildRequest& req, const ContextId& id,
                                                const v1::ContextManifest& parent_manifest) const {
  const int64_t now = clock_->NowMillis();
  v1::ContextManifest man;
  man.set_context_id(std::string(id.AsBytes()));
  man.set_format_version(kFormatVersion);
  man.set_state(v1::CONTEXT_STATE_BUILDING);
  *man.mutable_model() = req.model;
  man.set_n_tokens(req.tokens.size());
  man.set_block_tokens(options_.block_tokens);
  man.set_page_codec(static_cast<v1::PageCodec>(options_.page_codec.codec));
  man.set_zstd_level(options_.page_codec.zstd_level);
  man.set_created_at_ms(now);
  man.set_last_access_ms(now);
  man.set_pinned(req.pinned);
  man.set_tenant(req.tenant);
  man.set_id_namespace(req.id_namespace);
  man.set_provenance(req.provenance);
  man.set_name(req.name);
  for (const auto& [k, v] : req.labels) (*man.mutable_labels())[k] = v;
  if (req.parent) {
    man.set_parent_id(std::string(req.parent->AsBytes()));
    man.set_prefix_tokens(parent_manifest.n_tokens());
    man.set_shared_blocks(
        static_cast<uint32_t>(parent_manifest.n_tokens() / options_.block_tokens));
  }
  return man;
}

Status StoreCore::WriteBuildingManifest(const BuildRequest& req, const ContextId& id,
                                        v1::ContextManifest* man) {
  RETURN_IF_ERROR(CheckDiskSpace(4 * req.tokens.size() + 4096));
  rocksdb::WriteBatch batch;
  uint64_t token_bytes = 0;
  for (size_t start = 0, c = 0; start < req.tokens.size(); start += kTokensPerChunk, ++c) {
    size_t n = std::min<size_t>(kTokensPerChunk, req.tokens.size() - start);
    std::string v;
    v.reserve(4 * n);
    for (size_t i = 0; i < n; ++i) PutLE32(&v, req.tokens[start + i]);
    token_bytes += v.size();
    RETURN_IF_ERROR(FromRocks(
        batch.Put(cf(kCfTokens), TokenKey(id, static_cast<uint32_t>(c)), v), "put tokens"));
  }
  man->set_stored_bytes(token_bytes);
  Status s =
      FromRocks(batch.Put(cf(kCfMeta), ManifestKey(id), EncodeManifest(*man)), "put manifest");
  if (s.ok()) s = Write(&batch, /*sync=*/true, /*disable_wal=*/false);
  if (!s.ok()) {
    // Best effort: drop what may have been written.
    DeleteContextsData({id}).IgnoreError();
    return s.WithContext("begin build of " + Hex(id));
  }
  return Status::OK();
}

StatusOr<BuildStart> StoreCore::BeginBuild(const BuildRequest& req) {
  RETURN_IF_ERROR(CheckBuildRequest(req));
  const ContextId id = ContextId::Compute(req.id_namespace, req.model.fingerprint(), req.tokens);
  BuildStart out;
  v1::ContextManifest parent_manifest;
  ASSIGN_OR_RETURN(std::shared_ptr<BuildSlot> slot,
                   ClaimBuildSlot(req, id, &out.existing, &parent_manifest));
  if (slot == nullptr) return out;  // already READY: out.existing

  // From here on, failures must release the slot.
  auto fail = [&](Status s) -> Status {
    std::lock_guard<std::mutex> l(mu_);
    if (req.parent) {
      auto p = contexts_.find(*req.parent);
      if (p != contexts_.end()) --p->second->children;
    }
    building_.erase(id);
    slot->done = true;
    build_cv_.notify_all();
    return s;
  };
  if (req.parent) {
    if (Status s = CheckParentPrefix(req, parent_manifest); !s.ok()) return fail(s);
  }
  v1::ContextManifest man = BuildingManifest(req, id, parent_manifest);
  const int64_t ttl = req.ttl_ms > 0 ? req.ttl_ms : options_.default_ttl_ms;
  slot->ttl_ms = ttl > 0 ? ttl : 0;
  // BUILDING manifest first (synced), so a crash leaves a marker for GC.
  // Token ids go in the same batch.
  if (Status s = WriteBuildingManifest(req, id, &man); !s.ok()) return fail(s);
  out.writer.reset(new ContextWriter(this, slot, std::move(man)));
  return out;
}

StatusOr<v1::ContextManifest> StoreCore::CommitBuild(ContextWriter* w, v1::ContextManifest man,
                                                     const std::vector<std::string>& ingest_files) {
  const ContextId id = w->id();
  RETURN_IF_ERROR(MaybeResume());
  {
    auto l = LockDb();
    if (generation_.load() != w->generation_) {
      return AbortedError("build of " + Hex(id) +
                          " lost unflushed pages when the store recovered from a disk error; "
                          "abort it and build again");
    }
    // Pages were written without WAL: make them durable before READY.
    rocksdb::FlushOptions fo;
    fo.wait = true;
    fo.allow_write_stall = true;
    std::vector<rocksdb::ColumnFamilyHandle*> data_cfs = {cf(kCfTokens), cf(kCfPages),
                                                          cf(kCfIndex)};
    rocksdb::Status fs = db_->Flush(fo, data_cfs);
    if (!fs.ok()) {
      needs_resume_.store(true);
      return FromRocks(fs, "flush pages of " + Hex(id));
    }
    if (!ingest_files.empty()) {
      // The files do not overlap each other or any other context, so they go
      // to the bottom level without compaction. RocksDB links and fsyncs the
      // files of one ingestion one after another (~2 ms each here), so they
      // go in up to kIngestGroups concurrent ingestions. Atomicity across
      // groups is not needed: the context is invisible until the READY
      // manifest below, and Open deletes the ranges of a BUILDING context.
      rocksdb::IngestExternalFileOptions io;
      io.move_files = true;
      io.failed_move_fall_back_to_copy = true;
      io.allow_blocking_flush = true;
      io.verify_checksums_before_ingest = false;
      constexpr size_t kIngestGroups = 16;
      const size_t per_group = (ingest_files.size() + kIngestGroups - 1) / kIngestGroups;
      const size_t groups = (ingest_files.size() + per_group - 1) / per_group;
      std::vector<rocksdb::Status> results(groups);
      io_pool_->ParallelFor(groups, [&](size_t begin, size_t end) {
        for (size_t g = begin; g < end; ++g) {
          const auto first = ingest_files.begin() + static_cast<std::ptrdiff_t>(g * per_group);
          const auto last = ingest_files.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                       ingest_files.size(), (g + 1) * per_group));
          results[g] =
              db_->IngestExternalFile(cf(kCfPages), std::vector<std::string>(first, last), io);
        }
      });
      for (const auto& r : results) RETURN_IF_ERROR(FromRocks(r, "ingest pages of " + Hex(id)));
    }
  }
  const int64_t now = clock_->NowMillis();
  man.set_state(v1::CONTEXT_STATE_READY);
  man.set_committed_at_ms(now);
  man.set_last_access_ms(now);
  if (w->slot_->ttl_ms > 0) man.set_expires_at_ms(now + w->slot_->ttl_ms);
  RETURN_IF_ERROR(PutManifestLocked(man, /*sync=*/true).WithContext("commit " + Hex(id)));
  bool over = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto e = std::make_shared<ContextEntry>();
    e->manifest = man;
    e->last_access_ms.store(now);
    e->persisted_access_ms = now;
    contexts_[id] = e;
    building_.erase(id);
    w->slot_->done = true;
    w->slot_->committed = true;
    w->slot_->result = man;
    if (options_.eviction.capacity_bytes > 0) {
      uint64_t used = 0;
      for (auto& [cid, ce] : contexts_) {
        if (!ce->doomed) used += ce->manifest.stored_bytes();
      }
      over = static_cast<double>(used) > options_.eviction.high_watermark *
                                             static_cast<double>(options_.eviction.capacity_bytes);
    }
  }
  build_cv_.notify_all();
  if (over) {
    auto r = RunEvictionPass();
    if (!r.ok()) spdlog::warn("storage: eviction after commit: {}", r.status().ToString());
  }
  return man;
}

Status StoreCore::AbortBuild(ContextWriter* w) {
  const ContextId id = w->id();
  Status s = DeleteContextsData({id});
  {
    std::lock_guard<std::mutex> l(mu_);
    if (w->slot_->parent) {
      auto p = contexts_.find(*w->slot_->parent);
      if (p != contexts_.end()) --p->second->children;
    }
    building_.erase(id);
    w->slot_->done = true;
  }
  build_cv_.notify_all();
  if (!s.ok()) {
    spdlog::warn("storage: abort of {} could not delete its data ({}); it is removed at next open",
                 Hex(id), s.ToString());
  }
  return s;
}

}  // namespace ctxcache::storage
