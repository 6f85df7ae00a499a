// Links the installed SDK and talks to a server given on the command line
// (or checks that an unreachable one is reported as UNAVAILABLE).
#include <ctxcache/client.h>

#include <cstdio>

int main(int argc, char** argv) {
  ctxcache::client::ClientOptions o;
  o.server = argc > 1 ? argv[1] : "127.0.0.1:1";
  o.max_attempts = 1;
  o.timeout_s = 2;
  auto client = ctxcache::client::Client::Connect(o);
  if (!client.ok()) return 1;
  auto stats = (*client)->GetStats();
  std::printf("%s\n", stats.ok() ? "ok" : stats.status().ToString().c_str());
  return stats.ok() || stats.status().code() == ctxcache::StatusCode::kUnavailable ? 0 : 1;
}
