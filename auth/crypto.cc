#include "auth/crypto.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

namespace ctxcache::auth {

Sha256::Digest HmacSha256(std::string_view key, std::string_view message) {
  constexpr size_t kBlock = 64;
  uint8_t k[kBlock] = {};
  if (key.size() > kBlock) {
    Sha256::Digest d = Sha256Digest(key.data(), key.size());
    std::memcpy(k, d.data(), d.size());
  } else {
    std::memcpy(k, key.data(), key.size());
  }
  uint8_t ipad[kBlock], opad[kBlock];
  for (size_t i = 0; i < kBlock; ++i) {
    ipad[i] = k[i] ^ 0x36;
    opad[i] = k[i] ^ 0x5c;
  }
  Sha256 inner;
  inner.Update(ipad, kBlock);
  inner.Update(message);
  Sha256::Digest ih = inner.Finish();
  Sha256 outer;
  outer.Update(opad, kBlock);
  outer.Update(ih.data(), ih.size());
  return outer.Finish();
}

StatusOr<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return InternalError(std::string("getrandom: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<uint8_t>(a[i] ^ b[i]);
  }
  return diff == 0;
}

std::string HexEncode(std::string_view bytes) {
  return ToHex(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

StatusOr<std::string> HexDecode(std::string_view hex, std::string_view what) {
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() % 2 != 0) {
    return InvalidArgumentError(std::string(what) + ": expected hex digits, got an odd count (" +
                                std::to_string(hex.size()) + ")");
  }
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return InvalidArgumentError(std::string(what) + ": expected hex digits");
    }
    out[i] = static_cast<char>(hi << 4 | lo);
  }
  return out;
}

}  // namespace ctxcache::auth
