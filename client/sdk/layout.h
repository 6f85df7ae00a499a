// Caller-memory layouts of the bulk calls (Client::StartLoadKV's KVLayout,
// IngestStream's IngestLayerLayout): the one extent computation that both
// check capacities with.
//
// Thread-safety: stateless.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace ctxcache::client::internal {

// One dimension of a strided layout: `count` elements `stride` bytes apart.
struct StridedDim {
  uint64_t count;
  int64_t stride;  // >= 0
};

// Bytes a layout reaches: the end of its last element, `row` bytes long.
// Every count >= 1. 128-bit: huge strides cannot wrap.
inline unsigned __int128 StridedExtent(std::initializer_list<StridedDim> dims, size_t row) {
  unsigned __int128 end = row;
  for (const StridedDim& d : dims) {
    end += static_cast<unsigned __int128>(d.count - 1) * static_cast<uint64_t>(d.stride);
  }
  return end;
}

// An extent for a message ("2^64" beyond 64 bits).
inline std::string ExtentString(unsigned __int128 bytes) {
  return bytes > UINT64_MAX ? std::string("2^64") : std::to_string(static_cast<uint64_t>(bytes));
}

}  // namespace ctxcache::client::internal
