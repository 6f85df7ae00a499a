#include "service/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ctxcache::service {

namespace {

// Seconds since the epoch at boot ("btime" in /proc/stat), 0 if unknown.
double BootTimeSeconds() {
  std::ifstream f("/proc/stat");
  std::string key;
  double value = 0;
  while (f >> key) {
    if (key == "btime") {
      f >> value;
      return value;
    }
    f.ignore(1 << 20, '\n');
  }
  return 0;
}

}  // namespace

ProcessStats ReadProcessStats() {
  ProcessStats s;
  // /proc/self/stat: "pid (comm) state ..." where comm may hold spaces and
  // parentheses; the fields after the last ')' start at field 3 (state).
  std::ifstream f("/proc/self/stat");
  std::string line;
  if (std::getline(f, line)) {
    const size_t close = line.rfind(')');
    if (close != std::string::npos) {
      std::istringstream rest(line.substr(close + 1));
      std::vector<std::string> fields;  // fields[0] is field 3 of proc(5)
      for (std::string x; rest >> x;) fields.push_back(x);
      auto field = [&](size_t n) -> double {  // n: proc(5)'s 1-based number
        return fields.size() > n - 3 ? std::strtod(fields[n - 3].c_str(), nullptr) : 0.0;
      };
      const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
      const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
      if (ticks > 0) {
        s.cpu_seconds = (field(14) + field(15)) / ticks;  // utime + stime
        const double boot = BootTimeSeconds();
        if (boot > 0) s.start_time_seconds = boot + field(22) / ticks;
      }
      s.virtual_bytes = static_cast<uint64_t>(field(23));
      s.resident_bytes = static_cast<uint64_t>(field(24) * page);
    }
  }
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++s.open_fds;
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    s.max_fds = limit.rlim_cur;
  }
  return s;
}

void RegisterProcessMetrics(MetricsRegistry* m) {
  m->AddCallbackCounter("process_cpu_seconds_total",
                        "Total user and system CPU time spent in seconds",
                        [] { return ReadProcessStats().cpu_seconds; });
  m->AddCallbackGauge("process_resident_memory_bytes", "Resident memory size in bytes",
                      [] { return static_cast<double>(ReadProcessStats().resident_bytes); });
  m->AddCallbackGauge("process_virtual_memory_bytes", "Virtual memory size in bytes",
                      [] { return static_cast<double>(ReadProcessStats().virtual_bytes); });
  m->AddCallbackGauge("process_open_fds", "Number of open file descriptors",
                      [] { return static_cast<double>(ReadProcessStats().open_fds); });
  m->AddCallbackGauge("process_max_fds", "Maximum number of open file descriptors",
                      [] { return static_cast<double>(ReadProcessStats().max_fds); });
  m->AddCallbackGauge("process_start_time_seconds",
                      "Start time of the process since unix epoch in seconds",
                      [] { return ReadProcessStats().start_time_seconds; });
}

}  // namespace ctxcache::service
