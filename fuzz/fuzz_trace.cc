// Fuzz target: model::ReadTrace, a .ctxtrace file (only takes a path: the
// input is written to a temp file). A trace that reads must validate.
#include <cstdlib>

#include "fuzz/fuzz_target.h"
#include "model/trace.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::TempFile file("trace.ctxtrace");
  StatusOr<model::Trace> t = model::ReadTrace(file.Write(fuzz::AsView(data, size)));
  if (t.ok() && !t->Validate().ok()) std::abort();
  return 0;
}
