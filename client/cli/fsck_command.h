// `ctxcache fsck --data-dir DIR [--quarantine]`: checks a data dir offline
// (no server may have it open): opens the store (which finishes crash
// recovery: unfinished builds and evictions), verifies every READY
// context's pages, artifacts and token ids (storage::Fsck) and prints one
// line per context (JSON with --json). --quarantine marks the contexts that
// fail FAILED so the server never serves them.
//
// Exit codes: 0 every context verified and none is quarantined; 1 corruption
// found (corrupt or quarantined contexts); 2 the data dir cannot be opened
// (locked by a running ctxcached, missing, or RocksDB's own files corrupt).
#pragma once

#include <string>

#include "client/cli/command.h"

namespace ctxcache::cli {

class FsckCommand final : public Command {
 public:
  void Configure(CLI::App* sub) override;
  int Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) override;

 private:
  std::string data_dir_;
  bool quarantine_ = false;
};

}  // namespace ctxcache::cli
