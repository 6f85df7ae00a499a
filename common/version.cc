#include "common/version.h"

#ifndef CTXCACHE_VERSION
#define CTXCACHE_VERSION "0.0.0"
#endif
#ifndef CTXCACHE_GIT_REVISION
#define CTXCACHE_GIT_REVISION "unknown"
#endif

namespace ctxcache {

std::string_view Version() { return CTXCACHE_VERSION; }

std::string_view GitRevision() { return CTXCACHE_GIT_REVISION; }

std::string VersionString(std::string_view program) {
  return std::string(program) + " " + std::string(Version()) + " (revision " +
         std::string(GitRevision()) + ")";
}

}  // namespace ctxcache
