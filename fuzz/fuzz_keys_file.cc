// Fuzz target: auth::KeysFile::Parse (the API keys file), plus a
// Serialize/Parse round trip of what parses.
#include <cstdlib>

#include "auth/keys_file.h"
#include "fuzz/fuzz_target.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  StatusOr<auth::KeysFile> f = auth::KeysFile::Parse(fuzz::AsView(data, size));
  if (!f.ok()) return 0;
  StatusOr<auth::KeysFile> again = auth::KeysFile::Parse(f->Serialize());
  if (!again.ok() || again->keys.size() != f->keys.size() ||
      again->subjects.size() != f->subjects.size()) {
    std::abort();  // what the server writes, it reads back
  }
  return 0;
}
