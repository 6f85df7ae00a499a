// CRC-32C (Castagnoli), as used by iSCSI, ext4 and RocksDB, computed with the
// SSE4.2 crc32 instruction. Value(data) of "123456789" is 0xE3069283.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ctxcache::crc32c {

// Returns the crc32c of data[0, n) continuing from `init_crc` (0 to start).
uint32_t Extend(uint32_t init_crc, const void* data, size_t n);

inline uint32_t Value(const void* data, size_t n) { return Extend(0, data, n); }
inline uint32_t Value(std::string_view s) { return Extend(0, s.data(), s.size()); }
// crc32c of a || b (e.g. a page's K then V).
inline uint32_t Value(std::string_view a, std::string_view b) {
  return Extend(Value(a), b.data(), b.size());
}

}  // namespace ctxcache::crc32c
