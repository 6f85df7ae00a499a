// The build's version and git revision, as --version, the start-up log and
// the build_info metric print them. CMake sets them for common/version.cc
// only, so a new revision recompiles one file.
#pragma once

#include <string>
#include <string_view>

namespace ctxcache {

// The project version (CMake's PROJECT_VERSION).
std::string_view Version();
// The short git revision of the source tree, or "unknown" outside a checkout.
std::string_view GitRevision();
// "<program> <version> (revision <git revision>)".
std::string VersionString(std::string_view program);

}  // namespace ctxcache
