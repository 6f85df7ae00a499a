// Fuzz target: a `meta` column value parsed the way Store::Open reads it
// (storage::ParseManifestValue, then the READY-state and parent-id checks of
// its garbage collection), plus a serialize/parse round trip.
#include <google/protobuf/stubs/logging.h>

#include <cstdlib>

#include "fuzz/fuzz_target.h"
#include "storage/keys.h"
#include "storage/store.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // protobuf logs every invalid UTF-8 string field it rejects: mute it.
  static const bool muted = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)muted;
  StatusOr<v1::ContextManifest> m = storage::ParseManifestValue(fuzz::AsView(data, size));
  if (!m.ok()) return 0;
  (void)storage::ContextId::FromBytes(m->context_id());
  if (m->state() == v1::CONTEXT_STATE_READY && !m->parent_id().empty()) {
    (void)storage::ContextId::FromBytes(m->parent_id());
  }
  StatusOr<v1::ContextManifest> again = storage::ParseManifestValue(m->SerializeAsString());
  if (!again.ok()) std::abort();  // what the store writes, it reads back
  return 0;
}
