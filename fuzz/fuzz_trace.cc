// Fuzz target: model::ReadTrace, a .ctxtrace file (only takes a path: the
// input is written to a temp file). A trace that reads must validate.
//
// The trailing crc32c covers everything after the fixed 16-byte prefix, so
// almost every mutation would stop at the checksum, before the JSON header
// and the payload sizes it guards. The target rewrites the trailer to the
// input's own checksum (the mismatch path is tests/model/trace_test.cc's).
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/crc32c.h"
#include "fuzz/fuzz_target.h"
#include "model/trace.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::TempFile file("trace.ctxtrace");
  std::string bytes(fuzz::AsView(data, size));
  if (bytes.size() >= 20) {
    const uint32_t crc = crc32c::Value(bytes.data() + 16, bytes.size() - 20);
    std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
  }
  StatusOr<model::Trace> t = model::ReadTrace(file.Write(bytes));
  if (t.ok() && !t->Validate().ok()) std::abort();
  return 0;
}
