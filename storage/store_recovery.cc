// StoreCore's recovery: the manifest and data scans at open, garbage
// collection of unreferenced or half-written data, quarantine at open, the
// deletes that GC and eviction share, and resuming after a background error.
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

using store_detail::Hex;

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

Status StoreCore::SortManifestsAtOpen(bool reload, GcPlan* plan) {
  std::vector<ScannedManifest> scanned;
  RETURN_IF_ERROR(ScanManifests(&scanned, &plan->meta_complete));
  for (auto& r : scanned) {
    const ContextId id = r.id;
    if (reload) {
      if (r.status.ok() && r.manifest.state() == v1::CONTEXT_STATE_BUILDING) {
        plan->garbage.push_back(id);
      } else {
        plan->keep.insert(id);
      }
      continue;
    }
    if (!r.status.ok()) {
      QuarantineAtOpen(id, nullptr, std::string(r.status.message()));
      plan->keep.insert(id);
      continue;
    }
    v1::ContextManifest& m = r.manifest;
    if (m.context_id() != id.AsBytes()) {
      QuarantineAtOpen(id, nullptr, "manifest under this key names another context id");
      plan->keep.insert(id);
      continue;
    }
    switch (m.state()) {
      case v1::CONTEXT_STATE_READY: {
        plan->keep.insert(id);
        auto e = std::make_shared<ContextEntry>();
        e->last_access_ms.store(m.last_access_ms());
        e->persisted_access_ms = m.last_access_ms();
        e->manifest = std::move(m);
        contexts_[id] = std::move(e);
        break;
      }
      case v1::CONTEXT_STATE_FAILED:
        plan->keep.insert(id);
        quarantined_[id] = std::move(m);
        break;
      case v1::CONTEXT_STATE_EVICTING:
        ++evictions_finished_at_open_;
        plan->garbage.push_back(id);
        break;
      default:  // BUILDING: a build cut short
        ++gc_contexts_at_open_;
        plan->garbage.push_back(id);
        break;
    }
  }
  return Status::OK();
}

void StoreCore::DropChildrenWithoutParent(GcPlan* plan) {
  for (bool changed = true; changed;) {
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
          plan->garbage.push_back(it->first);
          plan->keep.erase(it->first);
          ++gc_contexts_at_open_;
          it = contexts_.erase(it);
          changed = true;
          continue;
        }
      }
      ++it;
    }
  }
}

void StoreCore::CountChildrenAtOpen() {
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

std::vector<std::pair<ContextId, std::string>> StoreCore::ProbeKeys(int c) const {
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
  return probes;
}

Status StoreCore::FindOrphanRanges(bool reload, GcPlan* plan) {
  std::set<ContextId>& keep = plan->keep;
  std::set<ContextId>& orphan_set = plan->orphans;
  for (int c : {kCfTokens, kCfPages, kCfIndex}) {
    bool complete = true;
    RETURN_IF_ERROR(ScanDataRanges(
        c, ProbeKeys(c),
        [&](const ContextId& id) {
          if (keep.count(id) || orphan_set.count(id)) return;
          if (!plan->meta_complete && !reload) {
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
  return Status::OK();
}

void StoreCore::QuarantineChildrenOfQuarantined() {
  for (bool changed = true; changed;) {
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
}

Status StoreCore::CollectGarbage(bool reload) {
  GcPlan plan;
  // 1. Manifests: READY ones are served; BUILDING and EVICTING ones are
  //    finished (deleted); FAILED or unreadable ones are quarantined.
  //    On a reload (reopen after a disk error) only BUILDING manifests are
  //    collected: in-memory state (leases of EVICTING contexts, quarantine)
  //    stays as it is.
  RETURN_IF_ERROR(SortManifestsAtOpen(reload, &plan));
  // 2. READY children whose parent is gone (an interrupted delete) cannot
  //    be served: drop them. Children of a quarantined context are
  //    quarantined with it (their first blocks are its pages). Repeat for
  //    grandchildren.
  if (!reload) {
    DropChildrenWithoutParent(&plan);
    CountChildrenAtOpen();
  }
  // 3. Orphans: key ranges in data CFs with no manifest (a crash between
  //    writes). A range that cannot be read quarantines its context. If the
  //    meta column family could not be read to its end, a range without a
  //    manifest may be a context whose manifest is unreadable: quarantine
  //    it instead of deleting it.
  plan.orphans.insert(plan.garbage.begin(), plan.garbage.end());
  RETURN_IF_ERROR(FindOrphanRanges(reload, &plan));
  if (!reload) {
    // Children of contexts quarantined in step 3 follow them.
    QuarantineChildrenOfQuarantined();
    quarantined_at_open_ = quarantined_.size();
  }
  if (!plan.orphans.empty()) {
    spdlog::info("storage: open: removing {} incomplete contexts / orphaned key ranges",
                 plan.orphans.size());
    RETURN_IF_ERROR(DeleteContextsDataNoLock({plan.orphans.begin(), plan.orphans.end()}));
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

}  // namespace ctxcache::storage
