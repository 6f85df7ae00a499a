// StoreCore's lookups, leases and administration: manifests, readers,
// verify, pin/share/expiry, delete, quarantine, the eviction pass, access
// times and stats.
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

}  // namespace ctxcache::storage
