// SHA-256 (FIPS 180-4), incremental. Used for the model fingerprint.
//
// Thread-safety: a Sha256 object is not safe for concurrent use; distinct
// objects are independent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ctxcache::model {

class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t n);
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  // Finishes the hash; the object must not be updated afterwards.
  std::array<uint8_t, 32> Final();

  // Lower-case hex of Sha256(data).
  static std::string HexOf(std::string_view data);

 private:
  void Block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

// Lower-case hex of `n` bytes.
std::string ToHex(const uint8_t* data, size_t n);

}  // namespace ctxcache::model
