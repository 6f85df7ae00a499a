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
#include "storage/store_internal.h"

namespace ctxcache::storage {
namespace {

constexpr uint32_t kMaxLayersOrHeads = 0xFFFE;  // 0xFFFF = kWholeContext

std::string Hex(const ContextId& id) { return id.ToHex(); }

void PutLE32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}
uint32_t GetLE32(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return uint32_t{u[0]} | (uint32_t{u[1]} << 8) | (uint32_t{u[2]} << 16) | (uint32_t{u[3]} << 24);
}

Status ValidateOptions(const StoreOptions& o) {
  if (o.block_tokens == 0 || o.block_tokens > 4096) {
    return InvalidArgumentError("StoreOptions.block_tokens: expected 1..4096, got " +
                                std::to_string(o.block_tokens));
  }
  if (!IsValidPageCodec(static_cast<int>(o.page_codec.codec))) {
    return InvalidArgumentError("StoreOptions.page_codec.codec: unknown codec");
  }
  if (o.artifact_chunk_bytes == 0 || o.artifact_chunk_bytes > (1u << 20)) {
    return InvalidArgumentError("StoreOptions.artifact_chunk_bytes: expected 1..1048576");
  }
  if (o.write_batch_bytes == 0 || o.write_batch_bytes > o.max_writer_buffer_bytes) {
    return InvalidArgumentError(
        "StoreOptions.write_batch_bytes: expected 1..max_writer_buffer_bytes");
  }
  if (o.read_io_depth == 0 || o.read_io_depth > 1024) {
    return InvalidArgumentError("StoreOptions.read_io_depth: expected 1..1024, got " +
                                std::to_string(o.read_io_depth));
  }
  if (o.io_threads == 0 || o.io_threads > 4096) {
    return InvalidArgumentError("StoreOptions.io_threads: expected 1..4096, got " +
                                std::to_string(o.io_threads));
  }
  const auto& e = o.eviction;
  if (!(e.low_watermark > 0 && e.low_watermark <= e.high_watermark && e.high_watermark <= 1.0)) {
    return InvalidArgumentError(
        "StoreOptions.eviction: expected 0 < low_watermark <= high_watermark <= 1");
  }
  return Status::OK();
}

rocksdb::ColumnFamilyOptions CfOptions(int cf, const StoreOptions& o,
                                       const std::shared_ptr<rocksdb::Cache>& block_cache,
                                       const std::shared_ptr<rocksdb::Cache>& blob_cache) {
  rocksdb::ColumnFamilyOptions c;
  rocksdb::BlockBasedTableOptions t;
  if (block_cache) {
    t.block_cache = block_cache;
  } else {
    t.no_block_cache = true;
  }
  t.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  t.format_version = 5;
  c.compression = rocksdb::kNoCompression;
  switch (cf) {
    case kCfPages:
      // One page per data block: a page read is one block read of about the
      // page's size. Pages are compressed by the page codec already.
      t.block_size = 4096;
      c.write_buffer_size = o.write_buffer_bytes;
      c.max_write_buffer_number = 4;
      c.target_file_size_base = 256ull << 20;
      c.max_bytes_for_level_base = 1ull << 30;
      c.level0_file_num_compaction_trigger = 8;
      c.level0_slowdown_writes_trigger = 40;
      c.level0_stop_writes_trigger = 64;
      if (o.enable_blob_files) {
        c.enable_blob_files = true;
        c.min_blob_size = o.min_blob_size;
        c.blob_file_size = 256ull << 20;
        c.blob_compression_type = rocksdb::kNoCompression;
        c.enable_blob_garbage_collection = true;
        c.blob_garbage_collection_age_cutoff = 1.0;
        c.blob_cache = blob_cache;
      }
      break;
    case kCfIndex:
      t.block_size = 64 << 10;
      c.write_buffer_size = o.write_buffer_bytes;
      c.target_file_size_base = 256ull << 20;
      break;
    case kCfTokens:
      t.block_size = 16 << 10;
      c.write_buffer_size = std::min<size_t>(8 << 20, o.write_buffer_bytes);
      for (auto ct : rocksdb::GetSupportedCompressions()) {
        if (ct == rocksdb::kZSTD) c.compression = rocksdb::kZSTD;
      }
      break;
    default:  // meta
      t.block_size = 4096;
      c.write_buffer_size = std::min<size_t>(4 << 20, o.write_buffer_bytes);
      break;
  }
  c.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
  c.level_compaction_dynamic_level_bytes = true;
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------

bool IsDataDirLockedError(std::string_view message) {
  // RocksDB's PosixFileSystem::LockFile: "IO error: While lock file: <dir>/LOCK:
  // Resource temporarily unavailable" (another process holds it) or "IO
  // error: lock hold by current process, acquire time ... lock file:
  // <dir>/LOCK: No locks available" (this process). Both name the LOCK file.
  auto has = [&](std::string_view s) { return message.find(s) != std::string_view::npos; };
  return has("/LOCK") && (has("While lock file") || has("lock hold by current process"));
}

Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::OK();
  std::string msg = std::string(what) + ": " + s.ToString();
  if (s.IsNoSpace() || s.subcode() == rocksdb::Status::kSpaceLimit ||
      (s.IsIOError() && s.ToString().find("No space") != std::string::npos)) {
    return ResourceExhaustedError("out of disk space: " + msg);
  }
  if (s.IsCorruption()) return DataLossError(msg);
  if (s.IsNotFound()) return NotFoundError(msg);
  if (s.IsBusy() || s.IsTryAgain() || s.IsTimedOut()) return UnavailableError(msg);
  return InternalError(msg);
}

// ---- Lease ----------------------------------------------------------------

Lease::~Lease() { Release(); }
Lease::Lease(Lease&& other) noexcept : core_(other.core_), id_(other.id_) { other.core_ = nullptr; }
Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    core_ = other.core_;
    id_ = other.id_;
    other.core_ = nullptr;
  }
  return *this;
}
void Lease::Release() {
  if (core_ != nullptr) {
    StoreCore* c = core_;
    core_ = nullptr;
    c->ReleaseLease(id_);
  }
}

// ---- StoreCore: open, GC ---------------------------------------------------

StoreCore::StoreCore(const StoreOptions& options, std::string path)
    : options_(options),
      path_(std::move(path)),
      clock_(options.clock != nullptr ? options.clock : Clock::System()) {}

StoreCore::~StoreCore() {
  StopBackground();
  if (db_) FlushAccessTimes().IgnoreError();
  CloseDb();
}

Status StoreCore::Open() {
  RETURN_IF_ERROR(ValidateOptions(options_));
  statistics_ = rocksdb::CreateDBStatistics();
  statistics_->set_stats_level(rocksdb::StatsLevel::kExceptHistogramOrTimers);
  if (options_.block_cache_bytes > 0) {
    block_cache_ = rocksdb::NewLRUCache(options_.block_cache_bytes);
  }
  if (options_.enable_blob_files && options_.blob_cache_bytes > 0) {
    blob_cache_ = rocksdb::NewLRUCache(options_.blob_cache_bytes);
  }
  RETURN_IF_ERROR(OpenDb(/*read_only=*/false));
  RETURN_IF_ERROR(CheckFormatVersion());
  io_pool_ = std::make_unique<ThreadPool>(options_.io_threads);
  // Ingest files of builds that never committed (no build is live yet).
  std::error_code ec;
  std::filesystem::remove_all(path_ + "/ingest", ec);
  return CollectGarbage(/*reload=*/false);
}

void StoreCore::CloseDb() {
  if (!db_) return;
  for (auto*& h : cfs_) {
    if (h != nullptr) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    h = nullptr;
  }
  for (auto* h : extra_cfs_) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  extra_cfs_.clear();
  db_->Close().PermitUncheckedError();
  db_.reset();
}

Status StoreCore::OpenDb(bool read_only) {
  rocksdb::DBOptions dbo;
  dbo.create_if_missing = true;
  dbo.create_missing_column_families = true;
  dbo.max_background_jobs = options_.max_background_jobs;
  dbo.use_direct_reads = options_.use_direct_reads;
  dbo.bytes_per_sync = 1 << 20;
  dbo.max_total_wal_size = 64 << 20;
  dbo.keep_log_file_num = 3;
  dbo.info_log_level = rocksdb::WARN_LEVEL;
  dbo.max_open_files = -1;
  dbo.statistics = statistics_;
  // After a crash, replay the WAL up to the first damaged record and drop
  // the rest (a torn tail write): every acknowledged meta write was synced,
  // so nothing acknowledged is lost; see docs/reliability.md.
  dbo.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
  if (options_.env != nullptr) dbo.env = options_.env;

  // Open every existing column family (a newer format may have added some),
  // then check the format version before touching anything.
  std::vector<std::string> existing;
  rocksdb::DB::ListColumnFamilies(dbo, path_, &existing).PermitUncheckedError();
  std::set<std::string> names(existing.begin(), existing.end());
  names.insert(rocksdb::kDefaultColumnFamilyName);
  for (const char* n : kCfNames) names.insert(n);
  std::vector<rocksdb::ColumnFamilyDescriptor> descs;
  for (const auto& n : names) {
    int idx = -1;
    for (int c = 0; c < kNumCfs; ++c) {
      if (n == kCfNames[c]) idx = c;
    }
    descs.emplace_back(n, idx >= 0 ? CfOptions(idx, options_, block_cache_, blob_cache_)
                                   : rocksdb::ColumnFamilyOptions());
  }
  page_sst_options_ =
      rocksdb::Options(dbo, CfOptions(kCfPages, options_, block_cache_, blob_cache_));
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  RETURN_IF_ERROR(FromRocks(read_only
                                ? rocksdb::DB::OpenForReadOnly(dbo, path_, descs, &handles, &raw)
                                : rocksdb::DB::Open(dbo, path_, descs, &handles, &raw),
                            "open RocksDB at " + path_));
  db_.reset(raw);
  read_only_ = read_only;
  for (size_t i = 0; i < descs.size(); ++i) {
    int idx = -1;
    for (int c = 0; c < kNumCfs; ++c) {
      if (descs[i].name == kCfNames[c]) idx = c;
    }
    if (idx >= 0) {
      cfs_[idx] = handles[i];
    } else {
      extra_cfs_.push_back(handles[i]);
    }
  }
  return Status::OK();
}

Status StoreCore::CheckFormatVersion() {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), cf(kCfMeta), FormatVersionKey(), &value);
  if (s.IsNotFound()) {
    // A new store; stamp it.
    std::string v;
    PutLE32(&v, kFormatVersion);
    rocksdb::WriteOptions wo;
    wo.sync = true;
    return FromRocks(db_->Put(wo, cf(kCfMeta), FormatVersionKey(), v), "write format_version");
  }
  if (s.IsCorruption()) {
    // Its meta block fails its checksum (the contexts in that block are
    // quarantined by the scan); the 4-byte record is read without it and
    // range-checked below.
    rocksdb::ReadOptions unverified;
    unverified.verify_checksums = false;
    spdlog::error("storage: reading format_version: {}; retrying without block checksums",
                  s.ToString());
    s = db_->Get(unverified, cf(kCfMeta), FormatVersionKey(), &value);
  }
  RETURN_IF_ERROR(FromRocks(s, "read format_version"));
  if (value.size() != 4) {
    return DataLossError("format_version record in " + path_ + " is " +
                         std::to_string(value.size()) + " bytes, expected 4");
  }
  uint32_t version = GetLE32(value.data());
  if (version > kFormatVersion) {
    return FailedPreconditionError(
        "storage format_version " + std::to_string(version) + " in " + path_ +
        " is newer than this build supports (" + std::to_string(kFormatVersion) +
        "); refusing to open. Run a newer ctxcache or use another data dir");
  }
  if (version == 0) return DataLossError("format_version 0 in " + path_ + " is invalid");
  if (version < kFormatVersion) {
    // Version 1 dirs hold unframed manifests, which this build still reads.
    // Re-stamp before any framed manifest is written, so that an older
    // build refuses the dir instead of taking framed manifests for garbage.
    spdlog::info("storage: upgrading {} from format_version {} to {}", path_, version,
                 kFormatVersion);
    std::string v;
    PutLE32(&v, kFormatVersion);
    rocksdb::WriteOptions wo;
    wo.sync = true;
    return FromRocks(db_->Put(wo, cf(kCfMeta), FormatVersionKey(), v), "write format_version");
  }
  return Status::OK();
}

Status StoreCore::ScanManifests(std::vector<ScannedManifest>* out, bool* complete) const {
  *complete = true;
  std::string last_key;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cf(kCfMeta)));
    for (it->Seek("M"); it->Valid() && it->key().starts_with("M"); it->Next()) {
      last_key = it->key().ToString();
      ScannedManifest r;
      if (!ParseManifestKey(it->key().ToStringView(), &r.id)) continue;
      r.status = DecodeManifest(it->value().ToStringView(), &r.manifest);
      out->push_back(std::move(r));
    }
    if (it->status().ok()) return Status::OK();
    if (!it->status().IsCorruption()) return FromRocks(it->status(), "scan manifests");
    spdlog::error("storage: meta column family: {}; reading the remaining manifests one by one",
                  it->status().ToString());
  }
  // A meta block failed its checksum. Walk the rest without block checksums
  // to learn the keys; read each with checksums; where that fails, the
  // manifest's own crc32c decides whether its bytes are intact.
  rocksdb::ReadOptions unverified;
  unverified.verify_checksums = false;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(unverified, cf(kCfMeta)));
  it->Seek(last_key.empty() ? std::string("M") : last_key);
  if (!last_key.empty() && it->Valid() && it->key() == last_key) it->Next();
  for (; it->Valid() && it->key().starts_with("M"); it->Next()) {
    ScannedManifest r;
    if (!ParseManifestKey(it->key().ToStringView(), &r.id)) continue;
    std::string v;
    rocksdb::Status gs = db_->Get(rocksdb::ReadOptions(), cf(kCfMeta), it->key(), &v);
    if (gs.ok()) {
      r.status = DecodeManifest(v, &r.manifest);
    } else {
      std::string_view raw = it->value().ToStringView();
      Status d = IsFramedManifest(raw) ? DecodeManifest(raw, &r.manifest)
                                       : DataLossError("unframed manifest (no crc32c of its own)");
      if (d.ok()) {
        spdlog::warn(
            "storage: manifest of {} lies in a meta block that fails its checksum ({}); "
            "its own crc32c verifies, keeping it",
            Hex(r.id), gs.ToString());
        r.status = Status::OK();
      } else {
        r.status = DataLossError("meta block: " + gs.ToString() + "; " + std::string(d.message()));
      }
    }
    out->push_back(std::move(r));
  }
  if (!it->status().ok()) {
    *complete = false;
    spdlog::error("storage: meta column family unreadable past {}: {}",
                  last_key.empty() ? std::string("the start") : last_key, it->status().ToString());
  }
  return Status::OK();
}

Status StoreCore::ScanDataRanges(int c,
                                 const std::vector<std::pair<ContextId, std::string>>& probes,
                                 const std::function<void(const ContextId&)>& on_range,
                                 const std::function<void(const ContextId&, Status)>& on_error,
                                 bool* complete) const {
  *complete = true;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cf(c)));
  std::string cursor;  // ranges before it are done
  for (it->SeekToFirst(); it->Valid();) {
    ContextId id;
    if (!ParseContextPrefix(it->key().ToStringView(), &id)) {
      it->Next();
      continue;
    }
    on_range(id);
    cursor = ContextRangeEnd(id);
    it->Seek(cursor);
  }
  if (it->status().ok()) return Status::OK();
  if (!it->status().IsCorruption()) {
    return FromRocks(it->status(), std::string("scan ") + kCfNames[c]);
  }
  // A block fails its checksum. The iterator merges every L0 file, so where
  // it failed does not say whose block it is; point reads do (they only
  // touch files whose key range holds the key). Probe one key of every
  // context not scanned yet; the scan of this column family stops here.
  *complete = false;
  spdlog::error("storage: {} column family: {}; probing the contexts after {}", kCfNames[c],
                it->status().ToString(),
                cursor.empty() ? std::string("the start") : rocksdb::Slice(cursor).ToString(true));
  for (const auto& [id, key] : probes) {
    if (ContextRangeBegin(id) < cursor) continue;
    std::string v;
    rocksdb::Status ps = db_->Get(rocksdb::ReadOptions(), cf(c), key, &v);
    if (ps.IsCorruption()) {
      on_error(id, DataLossError(std::string(kCfNames[c]) + " column family: " + ps.ToString()));
    }
  }
  return Status::OK();
}

void StoreCore::QuarantineAtOpen(const ContextId& id, const v1::ContextManifest* m,
                                 std::string reason) {
  spdlog::error("storage: quarantining context {}: {}", Hex(id), reason);
  v1::ContextManifest q;
  if (m != nullptr) q = *m;
  q.set_context_id(std::string(id.AsBytes()));
  q.set_state(v1::CONTEXT_STATE_FAILED);
  q.set_error(std::move(reason));
  quarantined_[id] = std::move(q);
}

Status StoreCore::CollectGarbage(bool reload) {
  // 1. Manifests: READY ones are served; BUILDING and EVICTING ones are
  //    finished (deleted); FAILED or unreadable ones are quarantined.
  //    On a reload (reopen after a disk error) only BUILDING manifests are
  //    collected: in-memory state (leases of EVICTING contexts, quarantine)
  //    stays as it is.
  std::vector<ContextId> garbage;
  std::set<ContextId> keep;  // key ranges not to collect
  std::vector<ScannedManifest> scanned;
  bool meta_complete = true;
  RETURN_IF_ERROR(ScanManifests(&scanned, &meta_complete));
  for (auto& r : scanned) {
    const ContextId id = r.id;
    if (reload) {
      if (r.status.ok() && r.manifest.state() == v1::CONTEXT_STATE_BUILDING) {
        garbage.push_back(id);
      } else {
        keep.insert(id);
      }
      continue;
    }
    if (!r.status.ok()) {
      QuarantineAtOpen(id, nullptr, std::string(r.status.message()));
      keep.insert(id);
      continue;
    }
    v1::ContextManifest& m = r.manifest;
    if (m.context_id() != id.AsBytes()) {
      QuarantineAtOpen(id, nullptr, "manifest under this key names another context id");
      keep.insert(id);
      continue;
    }
    switch (m.state()) {
      case v1::CONTEXT_STATE_READY: {
        keep.insert(id);
        auto e = std::make_shared<ContextEntry>();
        e->last_access_ms.store(m.last_access_ms());
        e->persisted_access_ms = m.last_access_ms();
        e->manifest = std::move(m);
        contexts_[id] = std::move(e);
        break;
      }
      case v1::CONTEXT_STATE_FAILED:
        keep.insert(id);
        quarantined_[id] = std::move(m);
        break;
      case v1::CONTEXT_STATE_EVICTING:
        ++evictions_finished_at_open_;
        garbage.push_back(id);
        break;
      default:  // BUILDING: a build cut short
        ++gc_contexts_at_open_;
        garbage.push_back(id);
        break;
    }
  }
  // 2. READY children whose parent is gone (an interrupted delete) cannot
  //    be served: drop them. Children of a quarantined context are
  //    quarantined with it (their first blocks are its pages). Repeat for
  //    grandchildren.
  for (bool changed = !reload; changed;) {
    changed = false;
    for (auto it = contexts_.begin(); it != contexts_.end();) {
      const auto& m = it->second->manifest;
      if (!m.parent_id().empty()) {
        auto pid = ContextId::FromBytes(m.parent_id());
        if (pid.ok() && contexts_.count(*pid) == 0 && quarantined_.count(*pid) > 0) {
          QuarantineAtOpen(it->first, &m, "parent context " + Hex(*pid) + " is quarantined");
          it = contexts_.erase(it);
          changed = true;
          continue;
        }
        if (!pid.ok() || contexts_.count(*pid) == 0) {
          spdlog::warn("storage: context {} lost its parent; deleting it", Hex(it->first));
          garbage.push_back(it->first);
          keep.erase(it->first);
          ++gc_contexts_at_open_;
          it = contexts_.erase(it);
          changed = true;
          continue;
        }
      }
      ++it;
    }
  }
  if (!reload) {
    auto count_child = [&](const v1::ContextManifest& m) {
      if (m.parent_id().empty()) return;
      auto pid = ContextId::FromBytes(m.parent_id());
      if (!pid.ok()) return;
      auto p = contexts_.find(*pid);
      if (p != contexts_.end()) ++p->second->children;
    };
    for (auto& [id, e] : contexts_) count_child(e->manifest);
    for (auto& [id, m] : quarantined_) count_child(m);
  }
  // 3. Orphans: key ranges in data CFs with no manifest (a crash between
  //    writes). A range that cannot be read quarantines its context. If the
  //    meta column family could not be read to its end, a range without a
  //    manifest may be a context whose manifest is unreadable: quarantine
  //    it instead of deleting it.
  std::set<ContextId> orphan_set(garbage.begin(), garbage.end());
  for (int c : {kCfTokens, kCfPages, kCfIndex}) {
    // One key that every READY context has in `c` (if any).
    std::vector<std::pair<ContextId, std::string>> probes;
    for (const auto& [id, e] : contexts_) {
      const v1::ContextManifest& m = e->manifest;
      const uint64_t n_blocks =
          (m.n_tokens() + m.block_tokens() - 1) / std::max(1u, m.block_tokens());
      if (c == kCfTokens) {
        probes.emplace_back(id, TokenKey(id, 0));
      } else if (c == kCfPages && m.shared_blocks() < n_blocks) {
        probes.emplace_back(id, PageKey(id, 0, 0, m.shared_blocks()));
      } else if (c == kCfIndex && m.artifacts_size() > 0) {
        const auto& a = m.artifacts(0);
        probes.emplace_back(
            id, ArtifactKey(id, static_cast<uint16_t>(a.layer()),
                            static_cast<uint16_t>(a.kv_head()), static_cast<uint8_t>(a.kind()), 0));
      }
    }
    bool complete = true;
    RETURN_IF_ERROR(ScanDataRanges(
        c, probes,
        [&](const ContextId& id) {
          if (keep.count(id) || orphan_set.count(id)) return;
          if (!meta_complete && !reload) {
            QuarantineAtOpen(id, nullptr,
                             "key range without a readable manifest (the meta column family "
                             "could not be read to its end)");
            keep.insert(id);
            return;
          }
          orphan_set.insert(id);
          if (!reload) ++orphan_prefixes_at_open_;
        },
        [&](const ContextId& id, Status why) {
          if (reload) return;  // keep what is there; the next open decides
          auto e = contexts_.find(id);
          if (e != contexts_.end()) {
            QuarantineAtOpen(id, &e->second->manifest, std::string(why.message()));
            contexts_.erase(e);
          } else if (quarantined_.count(id) == 0 && orphan_set.count(id) == 0) {
            QuarantineAtOpen(id, nullptr, std::string(why.message()));
          }
          // Unreadable data of a context being deleted anyway is left to the
          // deletion's range tombstones.
          if (orphan_set.count(id) == 0) keep.insert(id);
        },
        &complete));
    if (!complete) {
      spdlog::error("storage: {} column family only partly scanned", kCfNames[c]);
    }
  }
  // Children of contexts quarantined in step 3 follow them.
  for (bool changed = !reload; changed;) {
    changed = false;
    for (auto it = contexts_.begin(); it != contexts_.end();) {
      auto pid = ContextId::FromBytes(it->second->manifest.parent_id());
      if (pid.ok() && quarantined_.count(*pid) > 0) {
        QuarantineAtOpen(it->first, &it->second->manifest,
                         "parent context " + Hex(*pid) + " is quarantined");
        it = contexts_.erase(it);
        changed = true;
        continue;
      }
      ++it;
    }
  }
  if (!reload) quarantined_at_open_ = quarantined_.size();
  if (!orphan_set.empty()) {
    spdlog::info("storage: open: removing {} incomplete contexts / orphaned key ranges",
                 orphan_set.size());
    RETURN_IF_ERROR(DeleteContextsDataNoLock({orphan_set.begin(), orphan_set.end()}));
  }
  return Status::OK();
}

Status StoreCore::DeleteContextsData(const std::vector<ContextId>& ids) {
  if (ids.empty()) return Status::OK();
  RETURN_IF_ERROR(MaybeResume());
  auto l = LockDb();
  return DeleteContextsDataNoLock(ids);
}

Status StoreCore::PutEvictingMarkers(rocksdb::WriteBatch* batch,
                                     const std::vector<ContextId>& ids) const {
  for (const auto& id : ids) {
    v1::ContextManifest marker;
    marker.set_context_id(std::string(id.AsBytes()));
    marker.set_format_version(kFormatVersion);
    marker.set_state(v1::CONTEXT_STATE_EVICTING);
    RETURN_IF_ERROR(
        FromRocks(batch->Put(cf(kCfMeta), ManifestKey(id), EncodeManifest(marker)), "put marker"));
  }
  return Status::OK();
}

Status StoreCore::DeleteContextsDataNoLock(const std::vector<ContextId>& ids) {
  if (ids.empty()) return Status::OK();
  // 1. One synced batch: the EVICTING marker of every id (replacing its
  //    manifest) and the range deletions. From here on the contexts are
  //    gone for readers, and the marker tells the next Open() to finish the
  //    job if this process dies before step 3.
  rocksdb::WriteBatch batch;
  RETURN_IF_ERROR(PutEvictingMarkers(&batch, ids));
  for (const auto& id : ids) {
    std::string b = ContextRangeBegin(id), e = ContextRangeEnd(id);
    for (int c : {kCfTokens, kCfPages, kCfIndex}) {
      RETURN_IF_ERROR(FromRocks(batch.DeleteRange(cf(c), b, e), "delete range"));
    }
  }
  RETURN_IF_ERROR(WriteNoLock(&batch, /*sync=*/true, /*disable_wal=*/false));
  // 2. Reclaim the space. Failures here only delay reclamation: the markers
  //    stay, and the next Open() compacts again.
  //  a. Drop SST files that lie entirely inside a deleted range: no rewrite,
  //     no free space needed (a full disk cannot run a compaction).
  //  b. Compact exactly the ranges so the tombstones drop the rest (and, with
  //     blob files, rewrite/free the blobs).
  bool reclaimed = true;
  std::vector<std::string> bounds;
  for (const auto& id : ids) {
    bounds.push_back(ContextRangeBegin(id));
    bounds.push_back(ContextRangeEnd(id));
  }
  std::vector<rocksdb::Slice> slices(bounds.begin(), bounds.end());
  std::vector<rocksdb::RangePtr> ranges;
  for (size_t i = 0; i < ids.size(); ++i) ranges.emplace_back(&slices[2 * i], &slices[2 * i + 1]);
  rocksdb::CompactRangeOptions cro;
  cro.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForceOptimized;
  cro.allow_write_stall = true;
  for (int c : {kCfTokens, kCfPages, kCfIndex}) {
    rocksdb::Status ds = rocksdb::DeleteFilesInRanges(db_.get(), cf(c), ranges.data(),
                                                      ranges.size(), /*include_end=*/false);
    if (!ds.ok()) spdlog::warn("storage: delete files in ranges: {}", ds.ToString());
    for (size_t i = 0; i < ids.size(); ++i) {
      rocksdb::Status cs = db_->CompactRange(cro, cf(c), &slices[2 * i], &slices[2 * i + 1]);
      if (!cs.ok()) {
        reclaimed = false;
        spdlog::warn(
            "storage: compacting the deleted range of {}: {} (space is reclaimed at "
            "the next open)",
            Hex(ids[i]), cs.ToString());
      }
    }
  }
  if (!reclaimed) return Status::OK();
  // 3. Done: drop the markers (unsynced: a lost delete only repeats step 2).
  rocksdb::WriteBatch done;
  for (const auto& id : ids) {
    RETURN_IF_ERROR(FromRocks(done.Delete(cf(kCfMeta), ManifestKey(id)), "delete marker"));
  }
  Status s = WriteNoLock(&done, /*sync=*/false, /*disable_wal=*/false);
  if (!s.ok()) spdlog::warn("storage: removing eviction markers: {}", s.ToString());
  return Status::OK();
}

Status StoreCore::MaybeResume() {
  if (!needs_resume_.load()) return Status::OK();
  std::unique_lock<std::shared_mutex> l(db_mu_);
  if (!needs_resume_.load()) return Status::OK();  // another thread recovered
  rocksdb::Status s = read_only_ ? rocksdb::Status::NoSpace("store is read-only after a disk error")
                                 : db_->Resume();
  if (s.ok()) {
    needs_resume_.store(false);
    return Status::OK();
  }
  // A failed flush of WAL-less data (our pages) is fatal for this DB
  // instance; Resume() cannot clear it. Reopen once there is room again:
  // unflushed data only ever belongs to BUILDING contexts (Commit flushes
  // before READY), which the reopen garbage-collects.
  if (options_.min_free_disk_bytes > 0) {
    struct statvfs st;
    if (statvfs(path_.c_str(), &st) == 0 &&
        uint64_t{st.f_bavail} * st.f_frsize < options_.min_free_disk_bytes) {
      return FromRocks(s, "resume after write error");
    }
  }
  spdlog::warn("storage: RocksDB cannot resume ({}); reopening {}", s.ToString(), path_);
  CloseDb();
  ++generation_;
  Status open = OpenDb(/*read_only=*/false);
  if (!open.ok()) {
    // Still no room: serve reads from a read-only instance; the next write
    // tries again.
    Status ro = OpenDb(/*read_only=*/true);
    if (!ro.ok())
      spdlog::error("storage: cannot reopen {} even read-only: {}", path_, ro.ToString());
    return open.code() == StatusCode::kResourceExhausted
               ? open
               : ResourceExhaustedError("reopen after a disk error: " + open.ToString());
  }
  needs_resume_.store(false);
  return CollectGarbage(/*reload=*/true);
}

Status StoreCore::Write(rocksdb::WriteBatch* batch, bool sync, bool disable_wal) {
  RETURN_IF_ERROR(MaybeResume());
  auto l = LockDb();
  return WriteNoLock(batch, sync, disable_wal);
}

Status StoreCore::WriteNoLock(rocksdb::WriteBatch* batch, bool sync, bool disable_wal) {
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  wo.disableWAL = disable_wal;
  rocksdb::Status s = db_->Write(wo, batch);
  if (!s.ok()) {
    needs_resume_.store(true);
    return FromRocks(s, "write");
  }
  return Status::OK();
}

Status StoreCore::CheckDiskSpace(uint64_t incoming) const {
  if (options_.min_free_disk_bytes == 0) return Status::OK();
  struct statvfs st;
  if (statvfs(path_.c_str(), &st) != 0) return Status::OK();  // cannot tell; let RocksDB decide
  const uint64_t free_bytes = uint64_t{st.f_bavail} * st.f_frsize;
  auto l = LockDb();
  uint64_t unflushed = 0;
  for (int c : {kCfTokens, kCfPages, kCfIndex}) {
    uint64_t v = 0;
    if (db_->GetIntProperty(cf(c), "rocksdb.cur-size-all-mem-tables", &v)) unflushed += v;
  }
  const uint64_t need = unflushed + incoming + options_.min_free_disk_bytes;
  if (free_bytes < need) {
    return ResourceExhaustedError(
        "out of disk space in " + path_ + ": " + std::to_string(free_bytes) + " bytes free, need " +
        std::to_string(need) + " (unflushed " + std::to_string(unflushed) + " + incoming " +
        std::to_string(incoming) + " + reserve " + std::to_string(options_.min_free_disk_bytes) +
        ")");
  }
  return Status::OK();
}

Status StoreCore::PutManifestLocked(const v1::ContextManifest& m, bool sync) {
  rocksdb::WriteBatch batch;
  auto id = ContextId::FromBytes(m.context_id());
  if (!id.ok()) return id.status();
  RETURN_IF_ERROR(
      FromRocks(batch.Put(cf(kCfMeta), ManifestKey(*id), EncodeManifest(m)), "put manifest"));
  return Write(&batch, sync, /*disable_wal=*/false);
}

// ---- Background -------------------------------------------------------------

void StoreCore::StartBackground() {
  if (options_.background_interval_ms <= 0) return;
  bg_thread_ = std::thread([this] { BackgroundLoop(); });
}

void StoreCore::StopBackground() {
  {
    std::lock_guard<std::mutex> l(bg_mu_);
    bg_stop_ = true;
  }
  bg_cv_.notify_all();
  if (bg_thread_.joinable()) bg_thread_.join();
}

void StoreCore::BackgroundLoop() {
  std::unique_lock<std::mutex> l(bg_mu_);
  while (!bg_stop_) {
    bg_cv_.wait_for(l, std::chrono::milliseconds(options_.background_interval_ms));
    if (bg_stop_) break;
    l.unlock();
    auto r = RunEvictionPass();
    if (!r.ok()) spdlog::warn("storage: eviction pass: {}", r.status().ToString());
    Status s = FlushAccessTimes();
    if (!s.ok()) spdlog::warn("storage: flush access times: {}", s.ToString());
    l.lock();
  }
}

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

StatusOr<BuildStart> StoreCore::BeginBuild(const BuildRequest& req) {
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

  const ContextId id = ContextId::Compute(req.id_namespace, m.fingerprint(), req.tokens);
  std::shared_ptr<BuildSlot> slot;
  v1::ContextManifest parent_manifest;
  {
    std::unique_lock<std::mutex> l(mu_);
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::milliseconds(options_.concurrent_build_wait_ms);
    for (;;) {
      auto it = contexts_.find(id);
      if (it != contexts_.end() && !it->second->doomed) {
        it->second->last_access_ms.store(clock_->NowMillis());
        BuildStart out;
        out.existing = it->second->manifest;
        out.existing.set_last_access_ms(it->second->last_access_ms.load());
        return out;
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
    if (req.parent) RETURN_IF_ERROR(CheckParentLocked(req, *req.parent, &parent_manifest));
    slot = std::make_shared<BuildSlot>();
    slot->id = id;
    slot->parent = req.parent;
    building_[id] = slot;
    if (req.parent) ++contexts_[*req.parent]->children;
  }

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
    // The parent's token ids must be a prefix of ours.
    auto ptoks = ReadTokensRaw(*req.parent, parent_manifest.n_tokens());
    if (!ptoks.ok()) return fail(ptoks.status());
    if (!std::equal(ptoks->begin(), ptoks->end(), req.tokens.begin())) {
      return fail(InvalidArgumentError("tokens: the parent context's " +
                                       std::to_string(ptoks->size()) +
                                       " token ids are not a prefix of the request's tokens"));
    }
  }

  const int64_t now = clock_->NowMillis();
  v1::ContextManifest man;
  man.set_context_id(std::string(id.AsBytes()));
  man.set_format_version(kFormatVersion);
  man.set_state(v1::CONTEXT_STATE_BUILDING);
  *man.mutable_model() = m;
  man.set_n_tokens(req.tokens.size());
  man.set_block_tokens(options_.block_tokens);
  man.set_page_codec(static_cast<v1::PageCodec>(options_.page_codec.codec));
  man.set_zstd_level(options_.page_codec.zstd_level);
  man.set_created_at_ms(now);
  man.set_last_access_ms(now);
  int64_t ttl = req.ttl_ms > 0 ? req.ttl_ms : options_.default_ttl_ms;
  slot->ttl_ms = ttl > 0 ? ttl : 0;
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

  // BUILDING manifest first (synced), so a crash leaves a marker for GC.
  // Token ids go in the same batch.
  if (Status s = CheckDiskSpace(4 * req.tokens.size() + 4096); !s.ok()) return fail(s);
  rocksdb::WriteBatch batch;
  uint64_t token_bytes = 0;
  for (size_t start = 0, c = 0; start < req.tokens.size(); start += kTokensPerChunk, ++c) {
    size_t n = std::min<size_t>(kTokensPerChunk, req.tokens.size() - start);
    std::string v;
    v.reserve(4 * n);
    for (size_t i = 0; i < n; ++i) PutLE32(&v, req.tokens[start + i]);
    token_bytes += v.size();
    Status s = FromRocks(batch.Put(cf(kCfTokens), TokenKey(id, static_cast<uint32_t>(c)), v),
                         "put tokens");
    if (!s.ok()) return fail(s);
  }
  man.set_stored_bytes(token_bytes);
  {
    Status s =
        FromRocks(batch.Put(cf(kCfMeta), ManifestKey(id), EncodeManifest(man)), "put manifest");
    if (s.ok()) s = Write(&batch, /*sync=*/true, /*disable_wal=*/false);
    if (!s.ok()) {
      // Best effort: drop what may have been written.
      DeleteContextsData({id}).IgnoreError();
      return fail(s.WithContext("begin build of " + Hex(id)));
    }
  }
  BuildStart out;
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

// ---- Lookups, leases --------------------------------------------------------

StatusOr<v1::ContextManifest> StoreCore::GetManifest(const ContextId& id) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = contexts_.find(id);
  if (it == contexts_.end() || it->second->doomed) return NotServedLocked(id);
  v1::ContextManifest m = it->second->manifest;
  m.set_last_access_ms(it->second->last_access_ms.load());
  return m;
}

std::vector<v1::ContextManifest> StoreCore::ListContexts() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<v1::ContextManifest> out;
  for (const auto& [id, e] : contexts_) {
    if (e->doomed) continue;
    out.push_back(e->manifest);
    out.back().set_last_access_ms(e->last_access_ms.load());
  }
  return out;
}

void StoreCore::Touch(const ContextId& id) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = contexts_.find(id);
  if (it != contexts_.end()) it->second->last_access_ms.store(clock_->NowMillis());
}

StatusOr<Lease> StoreCore::AcquireLease(const ContextId& id) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = contexts_.find(id);
  if (it == contexts_.end() || it->second->doomed) return NotServedLocked(id);
  ++it->second->leases;
  it->second->last_access_ms.store(clock_->NowMillis());
  return Lease(this, id);
}

void StoreCore::ReleaseLease(const ContextId& id) {
  bool delete_now = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = contexts_.find(id);
    if (it == contexts_.end()) return;
    if (--it->second->leases == 0 && it->second->doomed) {
      DetachLocked(id);
      delete_now = true;
    }
  }
  if (delete_now) {
    Status s = DeleteContextsData({id});
    if (!s.ok()) spdlog::warn("storage: deferred delete of {}: {}", Hex(id), s.ToString());
  }
}

StatusOr<std::vector<ContextReader::Owner>> StoreCore::OwnersLocked(const ContextId& id) const {
  std::vector<ContextReader::Owner> owners;
  ContextId cur = id;
  for (int depth = 0; depth < 1000; ++depth) {
    auto it = contexts_.find(cur);
    if (it == contexts_.end()) {
      return DataLossError("context " + Hex(id) + ": ancestor " + Hex(cur) + " is missing");
    }
    const auto& m = it->second->manifest;
    owners.push_back({m.shared_blocks(), cur});
    if (m.parent_id().empty()) return owners;
    ASSIGN_OR_RETURN(cur, ContextId::FromBytes(m.parent_id()));
  }
  return DataLossError("context " + Hex(id) + ": parent chain too deep");
}

StatusOr<std::unique_ptr<ContextReader>> StoreCore::OpenReader(const ContextId& id) {
  ASSIGN_OR_RETURN(Lease lease, AcquireLease(id));
  v1::ContextManifest m;
  std::vector<ContextReader::Owner> owners;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = contexts_.find(id);
    m = it->second->manifest;
    ASSIGN_OR_RETURN(owners, OwnersLocked(id));
  }
  return std::unique_ptr<ContextReader>(
      new ContextReader(this, std::move(lease), std::move(m), std::move(owners)));
}

Status StoreCore::Verify(const ContextId& id) {
  ASSIGN_OR_RETURN(auto reader, OpenReader(id));
  const auto& m = reader->manifest();
  std::vector<uint32_t> blocks;
  PageBatch batch;
  for (uint32_t l = 0; l < m.model().n_layers(); ++l) {
    for (uint32_t h = 0; h < m.model().n_kv_heads(); ++h) {
      for (uint32_t b0 = 0; b0 < reader->n_blocks(); b0 += 1024) {
        blocks.clear();
        for (uint32_t b = b0; b < std::min(reader->n_blocks(), b0 + 1024); ++b) blocks.push_back(b);
        RETURN_IF_ERROR(reader->ReadPages(l, h, blocks, &batch));
      }
    }
  }
  for (const auto& a : m.artifacts()) {
    RETURN_IF_ERROR(
        reader->ReadArtifact(a.layer(), a.kv_head(), static_cast<uint8_t>(a.kind())).status());
  }
  ASSIGN_OR_RETURN(std::vector<uint32_t> tokens, reader->ReadTokens());
  if (ContextId::Compute(m.id_namespace(), m.model().fingerprint(), tokens) != id) {
    return DataLossError("context " + Hex(id) + ": stored token ids do not hash to its id");
  }
  return Status::OK();
}

// ---- Admin, eviction ----------------------------------------------------------

// The one admin manifest update: edits a copy of a READY manifest, stamps the
// current access time and persists it synchronously before publishing it.
Status StoreCore::UpdateManifest(const ContextId& id,
                                 const std::function<void(v1::ContextManifest*)>& edit) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = contexts_.find(id);
  if (it == contexts_.end() || it->second->doomed) return NotServedLocked(id);
  v1::ContextManifest m = it->second->manifest;
  edit(&m);
  m.set_last_access_ms(it->second->last_access_ms.load());
  RETURN_IF_ERROR(PutManifestLocked(m, /*sync=*/true));
  it->second->manifest = std::move(m);
  it->second->persisted_access_ms = it->second->manifest.last_access_ms();
  return Status::OK();
}

Status StoreCore::SetPinned(const ContextId& id, bool pinned) {
  return UpdateManifest(id, [pinned](v1::ContextManifest* m) { m->set_pinned(pinned); });
}

void StoreCore::SetTenantShares(std::map<std::string, uint64_t> shares, uint64_t default_share) {
  std::lock_guard<std::mutex> l(mu_);
  options_.eviction.tenant_share_bytes = std::move(shares);
  options_.eviction.default_tenant_share_bytes = default_share;
}

Status StoreCore::SetShared(const ContextId& id, bool shared) {
  return UpdateManifest(id, [shared](v1::ContextManifest* m) { m->set_shared(shared); });
}

Status StoreCore::SetExpiry(const ContextId& id, int64_t expires_at_ms) {
  return UpdateManifest(
      id, [expires_at_ms](v1::ContextManifest* m) { m->set_expires_at_ms(expires_at_ms); });
}

void StoreCore::DetachLocked(const ContextId& id) {
  auto it = contexts_.find(id);
  if (it == contexts_.end()) return;
  const auto& m = it->second->manifest;
  if (!m.parent_id().empty()) {
    auto pid = ContextId::FromBytes(m.parent_id());
    if (pid.ok()) {
      auto p = contexts_.find(*pid);
      if (p != contexts_.end()) --p->second->children;
    }
  }
  contexts_.erase(it);
}

StatusOr<bool> StoreCore::Delete(const ContextId& id) {
  {
    std::lock_guard<std::mutex> l(mu_);
    auto q = quarantined_.find(id);
    if (q != quarantined_.end()) {
      // The one way a quarantined context goes: an explicit delete.
      if (HasChildrenLocked(id)) {
        return FailedPreconditionError("quarantined context " + Hex(id) +
                                       " is the parent of other contexts; delete them first");
      }
      auto pid = ContextId::FromBytes(q->second.parent_id());
      if (pid.ok()) {
        auto p = contexts_.find(*pid);
        if (p != contexts_.end()) --p->second->children;
      }
      quarantined_.erase(q);
    } else {
      auto it = contexts_.find(id);
      if (it == contexts_.end() || it->second->doomed) {
        if (building_.count(id)) {
          return FailedPreconditionError("context " + Hex(id) + " is BUILDING; abort its build");
        }
        return ContextNotFoundError(id);
      }
      auto& e = *it->second;
      if (e.manifest.pinned()) {
        return FailedPreconditionError("context " + Hex(id) + " is pinned; unpin it first");
      }
      if (e.children > 0) {
        return FailedPreconditionError("context " + Hex(id) + " is the parent of " +
                                       std::to_string(e.children) +
                                       " context(s); delete them first");
      }
      if (e.leases > 0) {
        RETURN_IF_ERROR(MarkEvictingLocked({id}));
        e.doomed = true;
        return true;
      }
      DetachLocked(id);
    }
  }
  RETURN_IF_ERROR(DeleteContextsData({id}));
  return false;
}

Status StoreCore::MarkEvictingLocked(const std::vector<ContextId>& ids) {
  if (ids.empty()) return Status::OK();
  rocksdb::WriteBatch batch;
  RETURN_IF_ERROR(PutEvictingMarkers(&batch, ids));
  return Write(&batch, /*sync=*/true, /*disable_wal=*/false).WithContext("mark for eviction");
}

bool StoreCore::HasChildrenLocked(const ContextId& id) const {
  const std::string raw(id.AsBytes());
  for (const auto& [cid, e] : contexts_) {
    if (e->manifest.parent_id() == raw) return true;
  }
  for (const auto& [cid, m] : quarantined_) {
    if (m.parent_id() == raw) return true;
  }
  return false;
}

Status StoreCore::NotServedLocked(const ContextId& id) const {
  auto q = quarantined_.find(id);
  if (q != quarantined_.end()) {
    return DataLossError("context " + Hex(id) + " is quarantined (FAILED): " + q->second.error());
  }
  if (building_.count(id)) {
    return FailedPreconditionError("context " + Hex(id) + " is BUILDING, not READY");
  }
  return ContextNotFoundError(id);
}

Status StoreCore::Quarantine(const ContextId& id, std::string_view reason) {
  std::lock_guard<std::mutex> l(mu_);
  if (quarantined_.count(id)) return Status::OK();
  auto it = contexts_.find(id);
  if (it == contexts_.end() || it->second->doomed) return NotServedLocked(id);
  v1::ContextManifest m = it->second->manifest;
  m.set_last_access_ms(it->second->last_access_ms.load());
  m.set_state(v1::CONTEXT_STATE_FAILED);
  m.set_error(std::string(reason));
  RETURN_IF_ERROR(PutManifestLocked(m, /*sync=*/true).WithContext("quarantine " + Hex(id)));
  spdlog::error("storage: quarantined context {}: {}", Hex(id), reason);
  // Open readers keep their manifest copy; a parent keeps counting this
  // child (it still references the parent's pages).
  contexts_.erase(it);
  quarantined_[id] = std::move(m);
  // Descendants read this context's pages: they follow it (in memory; Open
  // derives the same from the persisted FAILED state).
  for (bool changed = true; changed;) {
    changed = false;
    for (auto c = contexts_.begin(); c != contexts_.end(); ++c) {
      auto pid = ContextId::FromBytes(c->second->manifest.parent_id());
      if (!pid.ok() || quarantined_.count(*pid) == 0) continue;
      v1::ContextManifest cm = c->second->manifest;
      cm.set_state(v1::CONTEXT_STATE_FAILED);
      cm.set_error("parent context " + Hex(*pid) + " is quarantined");
      quarantined_[c->first] = std::move(cm);
      contexts_.erase(c);
      changed = true;
      break;
    }
  }
  return Status::OK();
}

std::vector<v1::ContextManifest> StoreCore::ListQuarantined() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<v1::ContextManifest> out;
  for (const auto& [id, m] : quarantined_) out.push_back(m);
  return out;
}

StatusOr<EvictionReport> StoreCore::RunEvictionPass() {
  EvictionReport report;
  {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<EvictionCandidate> cands;
    for (const auto& [id, e] : contexts_) {
      if (e->doomed) continue;
      EvictionCandidate c;
      c.id = id;
      if (!e->manifest.parent_id().empty()) {
        auto pid = ContextId::FromBytes(e->manifest.parent_id());
        if (pid.ok()) c.parent = *pid;
      }
      c.tenant = e->manifest.tenant();
      c.bytes = e->manifest.stored_bytes();
      c.last_access_ms = e->last_access_ms.load();
      c.expires_at_ms = e->manifest.expires_at_ms();
      c.pinned = e->manifest.pinned();
      c.leased = e->leases > 0;
      c.children = e->children;
      cands.push_back(std::move(c));
    }
    auto decisions =
        SelectEvictionVictims(options_.eviction, std::move(cands), clock_->NowMillis());
    // Deferred evictions are acknowledged only once their markers are durable.
    std::vector<ContextId> deferred;
    for (const auto& d : decisions) {
      if (d.deferred) deferred.push_back(d.id);
    }
    RETURN_IF_ERROR(MarkEvictingLocked(deferred));
    for (const auto& d : decisions) {
      if (d.deferred) {
        contexts_[d.id]->doomed = true;
        report.deferred.push_back(d.id);
      } else {
        DetachLocked(d.id);
        report.deleted.push_back(d.id);
      }
    }
  }
  policy_evictions_ += report.deleted.size() + report.deferred.size();
  if (!report.deleted.empty()) {
    for (const auto& id : report.deleted) {
      spdlog::info("storage: evicting context {}", Hex(id));
    }
    RETURN_IF_ERROR(DeleteContextsData(report.deleted));
  }
  return report;
}

Status StoreCore::FlushAccessTimes() {
  std::lock_guard<std::mutex> l(mu_);
  rocksdb::WriteBatch batch;
  std::vector<std::pair<ContextEntry*, int64_t>> updated;
  for (auto& [id, e] : contexts_) {
    int64_t t = e->last_access_ms.load();
    // A doomed context's stored manifest is its EVICTING marker: keep it.
    if (t == e->persisted_access_ms || e->doomed) continue;
    v1::ContextManifest m = e->manifest;
    m.set_last_access_ms(t);
    RETURN_IF_ERROR(
        FromRocks(batch.Put(cf(kCfMeta), ManifestKey(id), EncodeManifest(m)), "put manifest"));
    updated.emplace_back(e.get(), t);
  }
  if (updated.empty()) return Status::OK();
  RETURN_IF_ERROR(Write(&batch, /*sync=*/false, /*disable_wal=*/false));
  for (auto& [e, t] : updated) {
    e->persisted_access_ms = t;
    e->manifest.set_last_access_ms(t);
  }
  return Status::OK();
}

StoreStats StoreCore::GetStats() const {
  StoreStats s;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (const auto& [id, e] : contexts_) {
      if (e->doomed) continue;
      ++s.ready_contexts;
      s.stored_bytes += e->manifest.stored_bytes();
    }
    s.building_contexts = building_.size();
    s.quarantined_contexts = quarantined_.size();
  }
  s.capacity_bytes = options_.eviction.capacity_bytes;
  auto l = LockDb();
  for (int c = 0; c < kNumCfs; ++c) {
    uint64_t v = 0, cf_bytes = 0;
    if (db_->GetIntProperty(cf(c), "rocksdb.live-sst-files-size", &v)) cf_bytes += v;
    if (db_->GetIntProperty(cf(c), "rocksdb.live-blob-file-size", &v)) cf_bytes += v;
    s.live_sst_bytes += cf_bytes;
    s.bytes_by_cf[kCfNames[c]] = cf_bytes;
  }
  if (block_cache_) s.block_cache_usage_bytes = block_cache_->GetUsage();
  s.policy_evictions = policy_evictions_.load();
  if (statistics_) {
    s.block_cache_hits = statistics_->getTickerCount(rocksdb::BLOCK_CACHE_HIT);
    s.block_cache_misses = statistics_->getTickerCount(rocksdb::BLOCK_CACHE_MISS);
  }
  s.gc_contexts_at_open = gc_contexts_at_open_;
  s.orphan_prefixes_at_open = orphan_prefixes_at_open_;
  s.evictions_finished_at_open = evictions_finished_at_open_;
  s.quarantined_at_open = quarantined_at_open_;
  return s;
}

// ---- Store ----------------------------------------------------------------------

Store::Store(std::unique_ptr<StoreCore> core) : core_(std::move(core)) {}
Store::~Store() = default;

StatusOr<std::unique_ptr<Store>> Store::Open(const StoreOptions& options, const std::string& path) {
  auto core = std::make_unique<StoreCore>(options, path);
  RETURN_IF_ERROR(core->Open());
  core->StartBackground();
  return std::unique_ptr<Store>(new Store(std::move(core)));
}

StatusOr<BuildStart> Store::BeginBuild(const BuildRequest& r) { return core_->BeginBuild(r); }
StatusOr<v1::ContextManifest> Store::GetManifest(const ContextId& id) const {
  return core_->GetManifest(id);
}
std::vector<v1::ContextManifest> Store::ListContexts() const { return core_->ListContexts(); }
StatusOr<std::unique_ptr<ContextReader>> Store::OpenReader(const ContextId& id) {
  return core_->OpenReader(id);
}
StatusOr<Lease> Store::AcquireLease(const ContextId& id) { return core_->AcquireLease(id); }
Status Store::Verify(const ContextId& id) { return core_->Verify(id); }
Status Store::SetPinned(const ContextId& id, bool pinned) { return core_->SetPinned(id, pinned); }
Status Store::SetShared(const ContextId& id, bool shared) { return core_->SetShared(id, shared); }
void Store::SetTenantShares(std::map<std::string, uint64_t> shares, uint64_t default_share) {
  core_->SetTenantShares(std::move(shares), default_share);
}
Status Store::SetExpiry(const ContextId& id, int64_t t) { return core_->SetExpiry(id, t); }
StatusOr<bool> Store::Delete(const ContextId& id) { return core_->Delete(id); }
Status Store::Quarantine(const ContextId& id, std::string_view reason) {
  return core_->Quarantine(id, reason);
}
std::vector<v1::ContextManifest> Store::ListQuarantined() const { return core_->ListQuarantined(); }
StatusOr<EvictionReport> Store::RunEvictionPass() { return core_->RunEvictionPass(); }
Status Store::FlushAccessTimes() { return core_->FlushAccessTimes(); }
StoreStats Store::GetStats() const { return core_->GetStats(); }
const StoreOptions& Store::options() const { return core_->options(); }
const std::string& Store::path() const { return core_->path(); }

Clock* Clock::System() {
  class SystemClock : public Clock {
   public:
    int64_t NowMillis() const override {
      return std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::system_clock::now().time_since_epoch())
          .count();
    }
  };
  static SystemClock* clock = new SystemClock();
  return clock;
}

}  // namespace ctxcache::storage
