// Fuzz target: index::LoadSelector("streaming", bytes) and the loaded selector
// (fuzz/index_artifact.h).
#include "fuzz/index_artifact.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ctxcache::fuzz::FuzzIndexArtifact("streaming", data, size);
}
