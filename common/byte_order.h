// Little-endian fixed-width integers in byte buffers: the store's framing
// (format version, token rows, page headers, manifest checksums). Byte by
// byte, so any alignment and any host byte order give the same bytes.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

namespace ctxcache {

inline void PutLE16(char* p, uint16_t v) {
  p[0] = static_cast<char>(v);
  p[1] = static_cast<char>(v >> 8);
}
inline void PutLE32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
// Appends v's 4 bytes to s.
inline void PutLE32(std::string* s, uint32_t v) {
  char b[4];
  PutLE32(b, v);
  s->append(b, 4);
}
inline uint16_t GetLE16(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return static_cast<uint16_t>(u[0] | (u[1] << 8));
}
inline uint32_t GetLE32(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return uint32_t{u[0]} | (uint32_t{u[1]} << 8) | (uint32_t{u[2]} << 16) | (uint32_t{u[3]} << 24);
}

}  // namespace ctxcache
