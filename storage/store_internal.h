// Internal state shared by Store, ContextWriter and ContextReader. Not part
// of the public surface: include only from storage/*.cc.
#pragma once

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/thread_pool.h"
#include "storage/context_reader.h"
#include "storage/context_writer.h"
#include "storage/store.h"

namespace ctxcache::storage {

// Column families, in the order they are opened.
enum Cf : int { kCfMeta = 0, kCfTokens = 1, kCfPages = 2, kCfIndex = 3, kNumCfs = 4 };
inline constexpr const char* kCfNames[kNumCfs] = {"meta", "tokens", "pages", "index"};

// Write buffer of an open ingest SstFileWriter (RocksDB's WritableFileWriter;
// with O_DIRECT one write per buffer).
inline constexpr size_t kSstWriteBufferBytes = 256 << 10;
// In-memory cost of one page in an open SstFileWriter (index entry + bloom
// bits), and of an open SstFileWriter itself (data block buffer + write
// buffer), counted in ContextWriter::buffered_bytes().
inline constexpr size_t kSstBytesPerPage = 48;
inline constexpr size_t kSstFixedBytes = (16 << 10) + kSstWriteBufferBytes;

// Token ids per value in the tokens column family.
inline constexpr uint32_t kTokensPerChunk = 16384;

// Converts a RocksDB status; `what` says which operation failed.
Status FromRocks(const rocksdb::Status& s, std::string_view what);

// One in-process build of a context id (concurrent builds of the same id
// wait on it).
struct BuildSlot {
  ContextId id;
  std::optional<ContextId> parent;
  int64_t ttl_ms = 0;      // applied at commit
  bool done = false;       // guarded by StoreCore::mu
  bool committed = false;  // guarded by StoreCore::mu
  v1::ContextManifest result;
};

struct ContextEntry {
  v1::ContextManifest manifest;  // READY; guarded by StoreCore::mu
  int leases = 0;                // guarded by StoreCore::mu
  // READY and quarantined contexts naming this one as parent; guarded by StoreCore::mu
  int children = 0;
  // Marked for deletion (its stored manifest is an EVICTING marker);
  // guarded by StoreCore::mu
  bool doomed = false;
  std::atomic<int64_t> last_access_ms{0};
  int64_t persisted_access_ms = 0;  // guarded by StoreCore::mu
};

class StoreCore {
 public:
  StoreCore(const StoreOptions& options, std::string path);
  ~StoreCore();

  Status Open();
  void StartBackground();
  void StopBackground();

  StatusOr<BuildStart> BeginBuild(const BuildRequest& request);
  StatusOr<v1::ContextManifest> GetManifest(const ContextId& id) const;
  std::vector<v1::ContextManifest> ListContexts() const;
  StatusOr<std::unique_ptr<ContextReader>> OpenReader(const ContextId& id);
  StatusOr<Lease> AcquireLease(const ContextId& id);
  Status Verify(const ContextId& id);
  Status SetPinned(const ContextId& id, bool pinned);
  Status SetShared(const ContextId& id, bool shared);
  void SetTenantShares(std::map<std::string, uint64_t> shares, uint64_t default_share);
  Status SetExpiry(const ContextId& id, int64_t expires_at_ms);
  StatusOr<bool> Delete(const ContextId& id);
  Status Quarantine(const ContextId& id, std::string_view reason);
  std::vector<v1::ContextManifest> ListQuarantined() const;
  StatusOr<EvictionReport> RunEvictionPass();
  Status FlushAccessTimes();
  StoreStats GetStats() const;

  // Called by Lease.
  void ReleaseLease(const ContextId& id);
  // Called by ContextWriter.
  // `ingest_files`: finished page SSTs to ingest before the READY flip.
  StatusOr<v1::ContextManifest> CommitBuild(ContextWriter* writer, v1::ContextManifest manifest,
                                            const std::vector<std::string>& ingest_files);
  Status AbortBuild(ContextWriter* writer);
  // Writes a batch; data writes skip the WAL (Commit flushes), meta writes
  // use it. Remembers out-of-space errors so the next write resumes the DB.
  Status Write(rocksdb::WriteBatch* batch, bool sync, bool disable_wal);

  // RESOURCE_EXHAUSTED if writing `incoming` more bytes would eat into
  // StoreOptions::min_free_disk_bytes.
  Status CheckDiskSpace(uint64_t incoming) const;

  // Every use of db()/cf() holds this shared lock; it is exclusive while the
  // DB is reopened after an unrecoverable write error (see MaybeResume).
  std::shared_lock<std::shared_mutex> LockDb() const {
    return std::shared_lock<std::shared_mutex>(db_mu_);
  }
  // Bumped by every reopen; a writer started before a reopen cannot commit.
  uint64_t generation() const { return generation_.load(); }

  rocksdb::DB* db() const { return db_.get(); }
  // The store's I/O pool (StoreOptions::io_threads): concurrent page reads,
  // and the ingest writers' per-head work. Its tasks never wait on each
  // other.
  ThreadPool* io_pool() const { return io_pool_.get(); }
  rocksdb::ColumnFamilyHandle* cf(int c) const { return cfs_[c]; }
  const StoreOptions& options() const { return options_; }
  // Options for rocksdb::SstFileWriter of the pages column family.
  const rocksdb::Options& page_sst_options() const { return page_sst_options_; }
  // Whether pages go through SST ingestion (StoreOptions::ingest_pages).
  bool ingest_pages() const { return options_.ingest_pages && !options_.enable_blob_files; }
  // Directory for the ingest files of one build: <path>/ingest/<id hex>.
  std::string IngestDir(const ContextId& id) const { return path_ + "/ingest/" + id.ToHex(); }
  const std::string& path() const { return path_; }
  Clock* clock() const { return clock_; }
  void Touch(const ContextId& id);

 private:
  // read_only: fallback after a failed reopen, so reads go on.
  Status OpenDb(bool read_only);
  void CloseDb();
  Status CheckFormatVersion();
  // One manifest read by ScanManifests.
  struct ScannedManifest {
    ContextId id;
    v1::ContextManifest manifest;  // valid iff status.ok()
    Status status;                 // DATA_LOSS: why it cannot be read
  };
  // Reads every manifest. A meta block that fails its checksum does not stop
  // the scan: its manifests are read one by one, and those whose own crc32c
  // cannot vouch for them come back DATA_LOSS. *complete = false if the
  // rest of the column family could not be walked at all.
  Status ScanManifests(std::vector<ScannedManifest>* out, bool* complete) const;
  // Calls on_range(id) once per context key range in data column family `c`.
  // If a block fails its checksum the scan stops there (*complete = false)
  // and, for each (id, key) of `probes` not scanned yet, a point read of key
  // that fails its checksum calls on_error(id, DATA_LOSS).
  Status ScanDataRanges(int c, const std::vector<std::pair<ContextId, std::string>>& probes,
                        const std::function<void(const ContextId&)>& on_range,
                        const std::function<void(const ContextId&, Status)>& on_error,
                        bool* complete) const;
  // At first open: records `id` as quarantined (FAILED, `reason`), keeping
  // the fields of `m` when given. Not persisted: the next open finds the
  // same fault.
  void QuarantineAtOpen(const ContextId& id, const v1::ContextManifest* m, std::string reason);
  // At first open (reload = false): loads READY contexts, quarantines FAILED
  // and unreadable ones, finishes EVICTING ones, deletes BUILDING ones and
  // key ranges without a manifest (compacting them). On a reload only
  // BUILDING manifests and ranges with no manifest at all are deleted.
  Status CollectGarbage(bool reload);
  // CollectGarbage's steps and what they hand on.
  struct GcPlan {
    std::vector<ContextId> garbage;  // contexts to delete, from their manifests
    std::set<ContextId> keep;        // key ranges not to collect
    std::set<ContextId> orphans;     // key ranges to delete (garbage and orphans)
    bool meta_complete = true;       // the meta column family was read to its end
  };
  // Step 1: sorts every manifest (READY served, FAILED or unreadable
  // quarantined, BUILDING and EVICTING garbage); on a reload only BUILDING
  // ones are garbage.
  Status SortManifestsAtOpen(bool reload, GcPlan* plan);
  // Step 2 (first open): quarantines the children of quarantined contexts
  // and makes garbage of those whose parent is gone, to a fixed point.
  void DropChildrenWithoutParent(GcPlan* plan);
  // Counts each READY context's children (READY and quarantined).
  void CountChildrenAtOpen();
  // One key every READY context has in data column family `c` (if any).
  std::vector<std::pair<ContextId, std::string>> ProbeKeys(int c) const;
  // Step 3: the data column families' key ranges without a manifest join
  // plan->orphans (or, when the meta column family was not read to its
  // end, are quarantined); an unreadable range quarantines its context.
  Status FindOrphanRanges(bool reload, GcPlan* plan);
  // Quarantines the children of quarantined contexts, to a fixed point.
  void QuarantineChildrenOfQuarantined();
  // Deletes every key of `ids`: one synced batch writes an EVICTING marker
  // over each manifest and range-deletes the data CFs; the ranges are then
  // compacted, and only if that succeeded are the markers removed (a crash
  // or failure in between is finished by the next Open()).
  Status DeleteContextsData(const std::vector<ContextId>& ids);
  Status DeleteContextsDataNoLock(const std::vector<ContextId>& ids);
  // Adds an EVICTING marker manifest for each id to `batch`.
  Status PutEvictingMarkers(rocksdb::WriteBatch* batch, const std::vector<ContextId>& ids) const;
  // Persists EVICTING markers (synced) for deferred evictions (mu_ held).
  Status MarkEvictingLocked(const std::vector<ContextId>& ids);
  // The error for an id that is not served: DATA_LOSS quarantined,
  // FAILED_PRECONDITION building, NOT_FOUND otherwise (mu_ held).
  Status NotServedLocked(const ContextId& id) const;
  bool HasChildrenLocked(const ContextId& id) const;
  Status WriteNoLock(rocksdb::WriteBatch* batch, bool sync, bool disable_wal);
  // Removes a READY entry from memory (lock held); returns its id for
  // DeleteContextsData.
  void DetachLocked(const ContextId& id);
  Status MaybeResume();
  Status PutManifestLocked(const v1::ContextManifest& m, bool sync);
  // SetPinned/SetExpiry: NotFound unless id is READY; else applies `edit` to
  // a copy of its manifest, stamps last_access_ms, persists it (sync) and
  // publishes it.
  Status UpdateManifest(const ContextId& id, const std::function<void(v1::ContextManifest*)>& edit);
  StatusOr<std::vector<ContextReader::Owner>> OwnersLocked(const ContextId& id) const;
  Status CheckParentLocked(const BuildRequest& req, const ContextId& parent,
                           v1::ContextManifest* parent_manifest) const;
  StatusOr<std::vector<uint32_t>> ReadTokensRaw(const ContextId& id, uint64_t n_tokens) const;
  // BeginBuild's steps. InvalidArgument naming the field for a request the
  // store cannot build (model shape, dtype, fingerprint, no tokens, a
  // writer buffer too small for the model).
  Status CheckBuildRequest(const BuildRequest& req) const;
  // Under mu_: a READY context of `id` fills *existing (touching its last
  // access) and returns null; otherwise waits out another build of `id`
  // (UNAVAILABLE past StoreOptions::concurrent_build_wait_ms), checks the
  // parent into *parent_manifest and claims the build slot of `id` (and a
  // child reference on the parent). UNAVAILABLE while `id` is being deleted.
  StatusOr<std::shared_ptr<BuildSlot>> ClaimBuildSlot(const BuildRequest& req, const ContextId& id,
                                                      v1::ContextManifest* existing,
                                                      v1::ContextManifest* parent_manifest);
  // InvalidArgument unless the parent's token ids are a prefix of req's.
  Status CheckParentPrefix(const BuildRequest& req,
                           const v1::ContextManifest& parent_manifest) const;
  // The BUILDING manifest of a new build of `id` (stamped now).
  v1::ContextManifest BuildingManifest(const BuildRequest& req, const ContextId& id,
                                       const v1::ContextManifest& parent_manifest) const;
  // One synced batch: the token ids and *man (stored_bytes set to the
  // tokens' bytes). On a write error, best-effort deletes what may have
  // been written.
  Status WriteBuildingManifest(const BuildRequest& req, const ContextId& id,
                               v1::ContextManifest* man);
  void BackgroundLoop();

  StoreOptions options_;
  std::string path_;
  Clock* clock_;
  std::shared_ptr<rocksdb::Cache> block_cache_;
  std::shared_ptr<rocksdb::Statistics> statistics_;  // block cache hit/miss tickers
  std::atomic<uint64_t> policy_evictions_{0};        // TTL/capacity victims since open
  std::shared_ptr<rocksdb::Cache> blob_cache_;
  std::unique_ptr<rocksdb::DB> db_;
  std::unique_ptr<ThreadPool> io_pool_;  // idle when no read or ingest write runs
  rocksdb::Options page_sst_options_;
  rocksdb::ColumnFamilyHandle* cfs_[kNumCfs] = {};
  std::vector<rocksdb::ColumnFamilyHandle*> extra_cfs_;  // default + unknown
  std::atomic<bool> needs_resume_{false};
  bool read_only_ = false;  // guarded by db_mu_
  mutable std::shared_mutex db_mu_;
  std::atomic<uint64_t> generation_{0};

  mutable std::mutex mu_;
  std::condition_variable build_cv_;
  std::map<ContextId, std::shared_ptr<ContextEntry>> contexts_;  // guarded by mu_
  std::map<ContextId, std::shared_ptr<BuildSlot>> building_;     // guarded by mu_
  // FAILED contexts (state FAILED, error = reason); guarded by mu_
  std::map<ContextId, v1::ContextManifest> quarantined_;
  uint64_t gc_contexts_at_open_ = 0;
  uint64_t orphan_prefixes_at_open_ = 0;
  uint64_t evictions_finished_at_open_ = 0;
  uint64_t quarantined_at_open_ = 0;

  std::mutex bg_mu_;
  std::condition_variable bg_cv_;
  bool bg_stop_ = false;  // guarded by bg_mu_
  std::thread bg_thread_;
};

}  // namespace ctxcache::storage
