#include "storage/fsck.h"

namespace ctxcache::storage {

StatusOr<FsckReport> Fsck(Store* store, const FsckOptions& options) {
  FsckReport report;
  for (const auto& m : store->ListContexts()) {
    ASSIGN_OR_RETURN(ContextId id, ContextId::FromBytes(m.context_id()));
    FsckEntry e;
    e.id = id;
    e.name = m.name();
    Status v = store->Verify(id);
    if (v.ok()) {
      ++report.ok;
    } else if (v.code() == StatusCode::kDataLoss) {
      ++report.corrupt;
      e.result = FsckEntry::Result::kCorrupt;
      e.detail = std::string(v.message());
      if (options.quarantine) {
        RETURN_IF_ERROR(store->Quarantine(id, "fsck: " + e.detail));
        e.result = FsckEntry::Result::kQuarantined;
        e.quarantined_now = true;
      }
    } else {
      return v.WithContext("fsck of " + id.ToHex());
    }
    report.entries.push_back(std::move(e));
  }
  for (const auto& m : store->ListQuarantined()) {
    ASSIGN_OR_RETURN(ContextId id, ContextId::FromBytes(m.context_id()));
    bool now = false;
    for (const auto& e : report.entries) now |= e.quarantined_now && e.id == id;
    if (now) continue;
    FsckEntry e;
    e.id = id;
    e.name = m.name();
    e.result = FsckEntry::Result::kQuarantined;
    e.detail = m.error();
    ++report.quarantined;
    report.entries.push_back(std::move(e));
  }
  return report;
}

}  // namespace ctxcache::storage
