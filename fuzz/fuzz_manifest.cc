// Fuzz target: a `meta` column value parsed the way Store::Open reads it
// (storage::DecodeManifest: framed with crc32c, or legacy unframed; then the
// id checks of its scan), plus an encode/decode round trip.
#include <google/protobuf/stubs/logging.h>

#include <cstdlib>

#include "fuzz/fuzz_target.h"
#include "storage/keys.h"
#include "storage/manifest_codec.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // protobuf logs every invalid UTF-8 string field it rejects: mute it.
  static const bool muted = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)muted;
  v1::ContextManifest m;
  if (!storage::DecodeManifest(fuzz::AsView(data, size), &m).ok()) return 0;
  (void)storage::ContextId::FromBytes(m.context_id());
  if (m.state() == v1::CONTEXT_STATE_READY && !m.parent_id().empty()) {
    (void)storage::ContextId::FromBytes(m.parent_id());
  }
  v1::ContextManifest again;
  if (!storage::DecodeManifest(storage::EncodeManifest(m), &again).ok()) {
    std::abort();  // what the store writes, it reads back
  }
  return 0;
}
