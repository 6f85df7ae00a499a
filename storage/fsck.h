// Offline consistency check of a store (`ctxcache fsck`): verifies every
// READY context's pages, artifacts and token ids (Store::Verify: crc32c of
// every page and artifact, token ids against the context id) and lists the
// quarantined ones. With FsckOptions::quarantine, a context that fails is
// marked FAILED (Store::Quarantine) so it is never served again.
//
// Thread-safety: Fsck may run while other threads use the store, but it is
// meant for a store opened offline (no server on the data dir).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "storage/store.h"

namespace ctxcache::storage {

struct FsckOptions {
  // Quarantine every context that fails verification. Default: false
  // (report only).
  bool quarantine = false;
};

struct FsckEntry {
  enum class Result {
    kOk,           // READY and verified
    kCorrupt,      // READY, failed verification (detail says where)
    kQuarantined,  // FAILED (quarantined before or by this run; detail = reason)
  };
  ContextId id;
  std::string name;
  Result result = Result::kOk;
  std::string detail;
  bool quarantined_now = false;  // this run quarantined it
};

struct FsckReport {
  std::vector<FsckEntry> entries;  // READY contexts by id, then quarantined ones by id
  uint64_t ok = 0;
  uint64_t corrupt = 0;      // failed verification in this run
  uint64_t quarantined = 0;  // FAILED before this run
  // No corruption found: every context verified and none is quarantined.
  bool clean() const { return corrupt == 0 && quarantined == 0; }
};

// Checks every context of `store`. Errors other than DATA_LOSS from a
// verification (e.g. INTERNAL I/O errors) abort the check and are returned.
StatusOr<FsckReport> Fsck(Store* store, const FsckOptions& options);

}  // namespace ctxcache::storage
