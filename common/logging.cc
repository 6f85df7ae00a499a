#include "common/logging.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <string>

namespace ctxcache {

Status InitLogging(std::string_view level, std::string_view process_name) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return InvalidArgumentError("unknown log level '" + std::string(level) +
                                "'; expected trace, debug, info, warn, error or off");
  }
  spdlog::drop(std::string(process_name));
  auto logger = spdlog::stderr_logger_mt(std::string(process_name));
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %L [%n] %v", spdlog::pattern_time_type::utc);
  logger->set_level(lvl);
  spdlog::set_default_logger(logger);
  return Status::OK();
}

}  // namespace ctxcache
