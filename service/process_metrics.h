// The standard process_* metrics of Prometheus client libraries, which
// prometheus-cpp 1.0.1 does not provide, read from /proc/self at scrape time:
//   process_cpu_seconds_total       counter: user + system CPU time, s
//   process_resident_memory_bytes   gauge: RSS
//   process_virtual_memory_bytes    gauge: virtual memory size
//   process_open_fds                gauge: open file descriptors
//   process_max_fds                 gauge: RLIMIT_NOFILE (soft)
//   process_start_time_seconds      gauge: start time, Unix seconds
// A value that cannot be read (no /proc) is reported as 0.
//
// Thread-safety: the callbacks read /proc only; safe from any thread.
#pragma once

#include <cstdint>

#include "service/metrics.h"

namespace ctxcache::service {

// What /proc/self says now (0 for what cannot be read).
struct ProcessStats {
  double cpu_seconds = 0;
  uint64_t resident_bytes = 0;
  uint64_t virtual_bytes = 0;
  uint64_t open_fds = 0;
  uint64_t max_fds = 0;
  double start_time_seconds = 0;
};
ProcessStats ReadProcessStats();

// Registers the six metrics above on `m` (callbacks; nothing is cached).
void RegisterProcessMetrics(MetricsRegistry* m);

}  // namespace ctxcache::service
