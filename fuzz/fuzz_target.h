// Shared by every fuzz target in fuzz/: the libFuzzer entry point each
// target defines, and a per-process temp file for decoders that only take a
// path (safetensors, .ctxtrace, the server's --config file).
//
// A target returns 0 for every input and must never crash, trip ASan/UBSan
// or leak: malformed input is an error Status from the decoder under test.
// The same target source builds as a libFuzzer binary (CTXCACHE_FUZZ=ON,
// clang) or, linked with fuzz/standalone_driver.cc, as a plain executable
// that replays the seed corpus and mutations of it (the default build).
//
// Thread-safety: targets are single-threaded; TempFile names include the pid.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace ctxcache::fuzz {

inline std::string_view AsView(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A file in $TMPDIR (default /tmp) named after `tag` and the pid, holding the
// bytes of the last Write(); removed on destruction. Aborts if it cannot be
// written (an environment problem, not an input problem).
class TempFile {
 public:
  explicit TempFile(std::string_view tag) {
    const char* dir = std::getenv("TMPDIR");
    path_ = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/ctxcache-fuzz-" +
            std::string(tag) + "-" + std::to_string(::getpid());
  }
  ~TempFile() { std::remove(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  const std::string& Write(std::string_view bytes) {
    std::FILE* f = std::fopen(path_.c_str(), "wb");
    // An empty view may carry a null data(): fwrite must not see it.
    if (f == nullptr ||
        (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) ||
        std::fclose(f) != 0) {
      std::perror(path_.c_str());
      std::abort();
    }
    return path_;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace ctxcache::fuzz
