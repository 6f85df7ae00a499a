// SHA-256 (FIPS 180-4), incremental. Used for ContextIds (storage/) and model
// fingerprints (model/). Small, portable, no OpenSSL.
//
// Thread-safety: a Sha256 object is not thread-safe; Sha256Digest is pure.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ctxcache {

class Sha256 {
 public:
  using Digest = std::array<uint8_t, 32>;

  Sha256();
  // Feeds n bytes.
  void Update(const void* data, size_t n);
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  // Returns the digest; the object must not be updated afterwards.
  Digest Finish();

 private:
  void Compress(const uint8_t block[64]);

  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_bytes_ = 0;
};

// One-shot digest of data[0, n).
Sha256::Digest Sha256Digest(const void* data, size_t n);

// Lower-case hex of `n` bytes.
std::string ToHex(const uint8_t* data, size_t n);

}  // namespace ctxcache
