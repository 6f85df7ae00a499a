// Fuzz target: index::LoadSelector("full", bytes) and the loaded selector
// (fuzz/index_artifact.h).
#include "fuzz/index_artifact.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ctxcache::fuzz::FuzzIndexArtifact("full", data, size);
}
