// StoreCore's open (options, column families, format version), writes, the
// background thread, and the Store facade. Recovery and GC:
// store_recovery.cc; builds: store_build.cc; lookups, leases, admin and
// eviction: store_admin.cc.
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


namespace {

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

}  // namespace ctxcache::storage
