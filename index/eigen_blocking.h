// Eigen plans the blocking of a matrix product (how the product's depth is
// split, and so the order of its sums) from the CPU's cache sizes, read at
// run time. The same product then rounds differently on hosts whose L1 data
// caches differ (32 KiB against 48 KiB cores): a context prefilled on two
// hosts would store different KV bytes, its indexes would differ, and checks
// over a model trace would pass on one host and fail on another.
//
// Every file that includes <Eigen/Core> includes this header instead of it
// or beside it. Its inline variable fixes the cache sizes Eigen plans with,
// once per program and before main: 48 KiB L1, 2 MiB L2, 32 MiB L3 (a
// common server core's). Products are then the same on every x86-64-v3
// host; on a host with other caches the blocking may be slower than the one
// Eigen would pick (not measured). Code that calls Eigen::setCpuCacheSizes
// itself breaks that.
#pragma once

#include <Eigen/Core>

namespace ctxcache::index {

inline const bool kEigenBlockingFixed = [] {
  Eigen::setCpuCacheSizes(48 * 1024, 2 * 1024 * 1024, 32 * 1024 * 1024);
  return true;
}();

}  // namespace ctxcache::index
