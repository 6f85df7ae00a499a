// Logging setup (spdlog). Call InitLogging once at process start; modules log
// through spdlog's default logger (spdlog::info(...)).
//
// Thread-safety: InitLogging is not thread-safe; logging itself is.
#pragma once

#include <string_view>

#include "common/status.h"

namespace ctxcache {

// level: trace|debug|info|warn|error|off. Logs go to stderr as one line per
// event: "2026-11-21T05:40:00.123Z I [ctxcached] message".
Status InitLogging(std::string_view level, std::string_view process_name);

}  // namespace ctxcache
