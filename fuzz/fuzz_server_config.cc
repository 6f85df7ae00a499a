// Fuzz target: service::ParseServerConfig with `--config FILE`, the TOML/INI
// file written from the input (ctxcached reads it at start).
#include "fuzz/fuzz_target.h"
#include "service/config.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::TempFile file("config.toml");
  std::string path = file.Write(fuzz::AsView(data, size));
  std::string arg0 = "ctxcached", arg1 = "--config";
  char* argv[] = {arg0.data(), arg1.data(), path.data(), nullptr};
  StatusOr<service::ServerConfig> c = service::ParseServerConfig(3, argv);
  if (c.ok()) (void)c->ToToml();
  return 0;
}
