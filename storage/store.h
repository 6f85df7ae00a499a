// Store: the persistent context cache on one RocksDB instance.
//
// A context is the KV cache (as pages), the index artifacts and the token ids
// of one prompt on one model, addressed by its ContextId. It is written once
// through a ContextWriter (state BUILDING, invisible to readers), becomes
// READY atomically in Commit(), is read through ContextReaders, and is
// deleted by eviction (capacity/LRU, TTL) or explicitly. Key schema and value
// layouts: docs/storage-format.md.
//
// Guarantees:
//  - After a crash, Open() garbage-collects every BUILDING context and any
//    orphaned keys, and reclaims their space; only READY (and quarantined)
//    contexts survive.
//  - An acknowledged eviction (Delete or RunEvictionPass returned, deferred
//    or not) is durable: its EVICTING marker is synced first, and Open()
//    finishes every marked context (range delete + compaction) so the space
//    comes back even if the process died mid-eviction or with leases open.
//  - A context whose manifest fails its crc32c or does not parse, whose
//    metadata blocks fail their RocksDB checksums at open, or that was
//    passed to Quarantine() is quarantined: kept on disk in state FAILED
//    with a reason, never served (DATA_LOSS), deleted only by Delete().
//    Open() does not fail for it; the other contexts are served.
//  - A page is verified (crc32c) on every read; a bad page is DATA_LOSS and
//    never handed out.
//  - A context with a live Lease (every ContextReader holds one) is never
//    deleted; evicting it marks it and deletes it when the last lease drops.
//  - A parent stays while any child context references its pages.
//
// Errors: NOT_FOUND unknown context (or one being evicted);
// FAILED_PRECONDITION not READY, pinned, or has children (explicit delete);
// INVALID_ARGUMENT bad shapes/dtypes/options; RESOURCE_EXHAUSTED out of disk
// space (the store stays usable); DATA_LOSS corrupt data or a quarantined
// context; INTERNAL other RocksDB errors.
//
// Ownership and lifetime: Store owns the DB. Every ContextWriter,
// ContextReader and Lease must be destroyed before the Store.
//
// Thread-safety: Store is safe for concurrent use without external
// synchronization.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "ctxcache/v1/storage.pb.h"
#include "proto/dtype_convert.h"
#include "storage/eviction_policy.h"
#include "storage/keys.h"
#include "storage/page_codec.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace ctxcache::storage {

class ContextWriter;
class ContextReader;
class StoreCore;

// On-disk format version written by this build. Open() refuses a data dir
// with a larger version and upgrades a version 1 dir in place (2 added the
// manifest framing, docs/storage-format.md).
inline constexpr uint32_t kFormatVersion = 2;

enum class PageReadMethod {
  kMultiGet,  // one rocksdb::DB::MultiGet per page table
  kIterator,  // one iterator per page table, Seek + Next
};

struct StoreOptions {
  // ---- Pages --------------------------------------------------------------
  // Tokens per KV page (B). Default: 16.
  uint32_t block_tokens = 16;
  // Page compression. Default: none (chosen by `ctxcache-bench storage`,
  // see storage/NOTES.md and page_codec.h).
  PageCodecOptions page_codec;

  // ---- Writer -------------------------------------------------------------
  // Upper bound on the bytes one ContextWriter buffers (partial pages +
  // pending write batch), whatever the context size. Default: 256 MiB.
  size_t max_writer_buffer_bytes = 256u << 20;
  // A writer hands its batch to RocksDB when it reaches this size. Default: 8 MiB.
  size_t write_batch_bytes = 8u << 20;
  // Artifacts are stored in chunks of at most this many bytes. Default: 1 MiB.
  size_t artifact_chunk_bytes = 1u << 20;
  // Write pages into per-(layer, kv_head) SST files and ingest them at
  // Commit (no memtable, no WAL, no compaction rewrite of page data) instead
  // of through WAL-less memtable writes flushed at Commit. Either way the
  // pages are durable before the synced READY manifest. Ignored when
  // enable_blob_files. Default: true (a build is write-once; reads after
  // ingestion are as fast as after the memtable path: docs/benchmarks.md).
  bool ingest_pages = true;
  // Write the ingest SST files with O_DIRECT (no copy into the page cache;
  // Commit's fsync has nothing left to write back). Falls back to buffered
  // writes where the filesystem refuses O_DIRECT (e.g. tmpfs). Default: true.
  bool direct_ingest_writes = true;
  // An ingest file is closed after this many pages (bounds the writer's
  // in-memory SST index, whatever the context size). Default: 4096.
  uint32_t ingest_file_pages = 4096;
  // Encode the heads of AppendLayerKV in parallel on ThreadPool::Default().
  // Default: true.
  bool parallel_encode = true;
  // How long BeginBuild waits for a concurrent build of the same id before
  // returning UNAVAILABLE. Default: 10 minutes.
  int64_t concurrent_build_wait_ms = 600'000;

  // ---- Reader -------------------------------------------------------------
  // How ReadPages fetches a page table. Default: MultiGet (faster than the
  // iterator cold; docs/benchmarks.md).
  PageReadMethod page_read_method = PageReadMethod::kMultiGet;
  // Reads one MultiGet page-table fetch keeps in flight: pages not in the
  // block cache are split into up to this many MultiGets that run at once on
  // the store's I/O pool (RocksDB 7.8 here has no io_uring, so one MultiGet
  // reads one page at a time). 1 = one MultiGet on the calling thread.
  // 1..1024. Default: 32.
  uint32_t read_io_depth = 32;
  // Threads of the store's I/O pool, shared by every reader and writer: the
  // concurrent page reads of ReadPages, and on the ingestion path the
  // per-head work of AppendLayerKV and the SST finish (fsync) at Commit,
  // which block on O_DIRECT writes. Bounds the page reads in flight
  // store-wide. 1..4096. Default: 64.
  uint32_t io_threads = 64;

  // ---- Eviction -----------------------------------------------------------
  // Capacity budget and watermarks, on the bytes stored by READY contexts
  // (ContextManifest.stored_bytes). Default: unlimited.
  EvictionPolicyOptions eviction;
  // TTL given to contexts whose BuildRequest has none; 0 = never expire.
  int64_t default_ttl_ms = 0;
  // Period of the background eviction pass (TTL + capacity) and of the lazy
  // last-access flush; 0 = no background thread (call RunEvictionPass and
  // FlushAccessTimes yourself). Default: 30 s.
  int64_t background_interval_ms = 30'000;
  // Clock for TTL/LRU; not owned; nullptr = Clock::System().
  Clock* clock = nullptr;

  // ---- RocksDB ------------------------------------------------------------
  // Shared LRU block cache; 0 disables the block cache. Default: 256 MiB.
  size_t block_cache_bytes = 256u << 20;
  // Store pages as blobs (integrated BlobDB) instead of in SST blocks.
  // Default: false (see storage/NOTES.md for the measurement).
  bool enable_blob_files = false;
  // Values at least this large go to blob files when enabled. Default: 4096.
  uint64_t min_blob_size = 4096;
  // Blob cache; 0 = none. Default: 0.
  size_t blob_cache_bytes = 0;
  // O_DIRECT reads (bypass the OS page cache). Default: false.
  bool use_direct_reads = false;
  // Memtable size per column family. Default: 64 MiB.
  size_t write_buffer_bytes = 64u << 20;
  // Free disk space a writer leaves untouched: a batch is refused with
  // RESOURCE_EXHAUSTED when free space < unflushed memtables + batch + this
  // reserve, so RocksDB's own flushes and compactions never hit ENOSPC.
  // 0 disables the check. Default: 256 MiB.
  uint64_t min_free_disk_bytes = 256ull << 20;
  // RocksDB background flush/compaction threads. Default: 2.
  int max_background_jobs = 2;
  // Environment (filesystem) for RocksDB; not owned; nullptr = default.
  // Tests use it for fault injection.
  rocksdb::Env* env = nullptr;
};

// What to build. The ContextId is derived from id_namespace,
// model.fingerprint and tokens (ContextId::Compute).
struct BuildRequest {
  v1::ModelSpec model;
  // Separates ids of different tenants and provenances (see
  // ContextManifest.id_namespace). Default: "" (ids as in format 1).
  std::string id_namespace;
  // Recorded in the manifest. Default: built by the server.
  v1::Provenance provenance = v1::PROVENANCE_BUILT;
  // All token ids of the context (for a child: parent's tokens + new ones).
  std::span<const uint32_t> tokens;
  // Prefix sharing: reuse this READY context's pages for its tokens. Its
  // token ids must be a prefix of `tokens` and its model the same.
  std::optional<ContextId> parent;
  std::string name;
  std::string tenant;
  std::map<std::string, std::string> labels;
  // Time to live from commit; 0 = StoreOptions::default_ttl_ms.
  int64_t ttl_ms = 0;
  bool pinned = false;
};

// Result of BeginBuild: either a writer for a new context, or (writer ==
// nullptr) the manifest of the READY context with the same id.
struct BuildStart {
  std::unique_ptr<ContextWriter> writer;
  v1::ContextManifest existing;
};

// Keeps a READY context from being deleted while alive. Movable, RAII.
class Lease {
 public:
  Lease() = default;
  ~Lease();
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  bool valid() const { return core_ != nullptr; }
  const ContextId& id() const { return id_; }
  // Releases early (idempotent).
  void Release();

 private:
  friend class StoreCore;
  Lease(StoreCore* core, const ContextId& id) : core_(core), id_(id) {}
  StoreCore* core_ = nullptr;
  ContextId id_;
};

struct EvictionReport {
  std::vector<ContextId> deleted;   // deleted now
  std::vector<ContextId> deferred;  // leased: deleted when the last lease drops
};

struct StoreStats {
  uint64_t ready_contexts = 0;
  uint64_t building_contexts = 0;
  uint64_t stored_bytes = 0;             // sum of READY stored_bytes (capacity accounting)
  uint64_t capacity_bytes = 0;           // 0 = unlimited
  uint64_t live_sst_bytes = 0;           // RocksDB's view of live SST + blob files
  uint64_t block_cache_usage_bytes = 0;  // bytes held by the block cache
  uint64_t policy_evictions = 0;         // contexts evicted by TTL/capacity since open
  uint64_t block_cache_hits = 0;         // since open (RocksDB ticker BLOCK_CACHE_HIT)
  uint64_t block_cache_misses = 0;       // since open (BLOCK_CACHE_MISS)
  // Live SST + blob bytes per column family: "meta", "tokens", "pages", "index".
  std::map<std::string, uint64_t> bytes_by_cf;
  uint64_t gc_contexts_at_open = 0;         // BUILDING contexts removed by Open
  uint64_t orphan_prefixes_at_open = 0;     // key ranges with no manifest at all, removed by Open
  uint64_t evictions_finished_at_open = 0;  // EVICTING contexts Open deleted and compacted
  uint64_t quarantined_contexts = 0;        // FAILED contexts held now
  uint64_t quarantined_at_open = 0;         // FAILED contexts found or made by Open
};

// Whether a Store::Open error message is RocksDB failing to take the data
// dir's LOCK file (another process, or another Store in this process, has
// the dir open). Matches only the LOCK-file IOError, not other errors that
// mention "lock" (e.g. "block checksum mismatch").
bool IsDataDirLockedError(std::string_view message);

class Store {
 public:
  // Opens (creating if missing) the store in directory `path`. Runs crash
  // GC and finishes interrupted evictions. FAILED_PRECONDITION if the data
  // dir's format_version is newer than kFormatVersion; INVALID_ARGUMENT for
  // bad options; an error for which IsDataDirLockedError() holds if the dir
  // is open elsewhere; DATA_LOSS/INTERNAL if RocksDB's own MANIFEST/CURRENT
  // cannot be read. Corrupt context metadata does not fail Open (see
  // quarantine above).
  static StatusOr<std::unique_ptr<Store>> Open(const StoreOptions& options,
                                               const std::string& path);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Starts a build, or returns the READY context with the same id (then
  // writer == nullptr). A build of the same id already running in this
  // process is waited for; if it commits, its manifest is returned.
  StatusOr<BuildStart> BeginBuild(const BuildRequest& request);

  // Manifest of a READY context (NOT_FOUND if unknown or being evicted,
  // FAILED_PRECONDITION if BUILDING, DATA_LOSS if quarantined). Reflects
  // in-memory last access.
  StatusOr<v1::ContextManifest> GetManifest(const ContextId& id) const;
  // All READY contexts (not marked for deletion), ordered by id.
  std::vector<v1::ContextManifest> ListContexts() const;

  // Opens a reader; it holds a lease until destroyed. Touches last access.
  StatusOr<std::unique_ptr<ContextReader>> OpenReader(const ContextId& id);
  // A bare lease (e.g. for a session that opens readers later).
  StatusOr<Lease> AcquireLease(const ContextId& id);

  // Reads and checks every page (and artifact, and the token ids against the
  // id) of a READY context. DATA_LOSS names the first bad item.
  Status Verify(const ContextId& id);

  Status SetPinned(const ContextId& id, bool pinned);
  // Marks a READY context readable by every tenant (ContextManifest.shared).
  Status SetShared(const ContextId& id, bool shared);
  // Replaces EvictionPolicyOptions::tenant_share_bytes and
  // default_tenant_share_bytes (fair capacity eviction across tenants);
  // takes effect at the next eviction pass.
  void SetTenantShares(std::map<std::string, uint64_t> shares, uint64_t default_share);
  // Sets the absolute expiry (ms since epoch, 0 = never).
  Status SetExpiry(const ContextId& id, int64_t expires_at_ms);
  // Deletes a context now, or when its last lease drops (deferred = true;
  // the context is then gone for new lookups, the open leases keep reading,
  // and the eviction survives a restart). A quarantined context is deleted
  // now. FAILED_PRECONDITION if pinned or referenced by a child.
  StatusOr<bool /*deferred*/> Delete(const ContextId& id);

  // Marks a READY context FAILED with `reason` (persisted, synced): it is no
  // longer served and its READY descendants are quarantined with it. Open
  // readers keep working. OK if already quarantined; NOT_FOUND otherwise.
  Status Quarantine(const ContextId& id, std::string_view reason);
  // Quarantined (FAILED) contexts with their reasons (ContextManifest.error),
  // ordered by id.
  std::vector<v1::ContextManifest> ListQuarantined() const;

  // One eviction pass (TTL + capacity); see eviction_policy.h.
  StatusOr<EvictionReport> RunEvictionPass();
  // Persists in-memory last-access times (done lazily otherwise).
  Status FlushAccessTimes();

  StoreStats GetStats() const;
  const StoreOptions& options() const;
  const std::string& path() const;

 private:
  explicit Store(std::unique_ptr<StoreCore> core);
  std::unique_ptr<StoreCore> core_;
};

}  // namespace ctxcache::storage
