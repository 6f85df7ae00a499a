// Fuzz target: index::LoadSelector("csa", bytes), both layouts (plain "CSAP"
// and compact "CSAC", chosen by magic), and the loaded selector
// (fuzz/index_artifact.h).
#include "fuzz/index_artifact.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ctxcache::fuzz::FuzzIndexArtifact("csa", data, size);
}
