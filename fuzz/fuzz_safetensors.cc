// Fuzz target: a safetensors file (8-byte header length, JSON header, tensor
// bytes) opened by model::SafetensorsSet::OpenFile, which only takes a path:
// the input is written to a temp file. Every tensor that opens is read.
#include <vector>

#include "fuzz/fuzz_target.h"
#include "model/safetensors.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::TempFile file("model.safetensors");
  StatusOr<std::unique_ptr<model::SafetensorsSet>> set =
      model::SafetensorsSet::OpenFile(file.Write(fuzz::AsView(data, size)));
  if (!set.ok()) return 0;
  for (const std::string& name : (*set)->Names()) {
    StatusOr<const model::TensorView*> t = (*set)->Get(name);
    if (!t.ok()) continue;
    (void)(*t)->ShapeString();
    if ((*t)->dtype == model::TensorDType::kI64 || (*t)->dtype == model::TensorDType::kI32) {
      std::vector<int64_t> ints;
      (void)(*set)->ReadI64(name, &ints);
    } else {
      std::vector<float> floats;
      (void)(*set)->ReadF32(name, (*t)->shape, &floats);
    }
  }
  return 0;
}
