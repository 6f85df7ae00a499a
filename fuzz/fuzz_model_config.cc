// Fuzz target: model::ParseModelConfig, an HF config.json as text.
#include "fuzz/fuzz_target.h"
#include "model/model.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  StatusOr<model::ModelSpec> spec = model::ParseModelConfig(std::string(fuzz::AsView(data, size)));
  if (spec.ok()) (void)spec->KvBytesPerToken(DType::kBF16);
  return 0;
}
