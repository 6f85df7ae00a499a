#include "client/cli/fsck_command.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "storage/fsck.h"
#include "storage/store.h"

namespace ctxcache::cli {
namespace {

const char* ResultName(storage::FsckEntry::Result r) {
  switch (r) {
    case storage::FsckEntry::Result::kOk:
      return "ok";
    case storage::FsckEntry::Result::kCorrupt:
      return "corrupt";
    case storage::FsckEntry::Result::kQuarantined:
      return "quarantined";
  }
  return "?";
}

}  // namespace

void FsckCommand::Configure(CLI::App* sub) {
  sub->add_option("--data-dir", data_dir_, "ctxcached data dir to check (offline)")->required();
  sub->add_flag("--quarantine", quarantine_,
                "Mark contexts that fail verification FAILED (never served again)");
}

int FsckCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  std::error_code ec;
  if (!std::filesystem::is_directory(data_dir_, ec)) {
    err << "ctxcache: fsck: no data dir at '" << data_dir_ << "'; pass --data-dir DIR\n";
    return kExitUsage;
  }
  storage::StoreOptions so;
  so.background_interval_ms = 0;  // no eviction while checking
  so.min_free_disk_bytes = 0;     // a check writes almost nothing
  auto store = storage::Store::Open(so, data_dir_);
  if (!store.ok()) {
    if (storage::IsDataDirLockedError(store.status().message())) {
      err << "ctxcache: fsck: data dir '" << data_dir_
          << "' is in use (RocksDB LOCK held; is ctxcached running?); stop the server and run "
             "fsck again\n";
    } else {
      err << "ctxcache: fsck: cannot open data dir '" << data_dir_
          << "': " << store.status().ToString() << "\n";
    }
    return kExitFailed;
  }
  storage::FsckOptions fo;
  fo.quarantine = quarantine_;
  auto report = storage::Fsck(store->get(), fo);
  if (!report.ok()) {
    err << "ctxcache: fsck: " << report.status().ToString() << "\n";
    return kExitFailed;
  }
  if (global.json) {
    nlohmann::json j;
    j["data_dir"] = data_dir_;
    j["ok"] = report->ok;
    j["corrupt"] = report->corrupt;
    j["quarantined"] = report->quarantined;
    j["clean"] = report->clean();
    j["contexts"] = nlohmann::json::array();
    for (const auto& e : report->entries) {
      j["contexts"].push_back({{"context_id", e.id.ToHex()},
                               {"name", e.name},
                               {"result", ResultName(e.result)},
                               {"quarantined_now", e.quarantined_now},
                               {"detail", e.detail}});
    }
    out << j.dump() << "\n";
  } else {
    for (const auto& e : report->entries) {
      out << e.id.ToHex() << "  " << ResultName(e.result);
      if (e.quarantined_now) out << " (now)";
      if (!e.name.empty()) out << "  name=" << e.name;
      if (!e.detail.empty()) out << "  " << e.detail;
      out << "\n";
    }
    out << "fsck: " << report->ok << " ok, " << report->corrupt << " corrupt"
        << (quarantine_ && report->corrupt > 0 ? " (quarantined now)" : "") << ", "
        << report->quarantined << " quarantined before\n";
  }
  return report->clean() ? 0 : 1;
}

}  // namespace ctxcache::cli
