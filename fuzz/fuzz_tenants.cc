// Fuzz target: auth::TenantsConfig::Parse (the per-tenant quotas file).
#include "auth/tenants.h"
#include "fuzz/fuzz_target.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  StatusOr<auth::TenantsConfig> t = auth::TenantsConfig::Parse(fuzz::AsView(data, size));
  if (t.ok()) (void)t->QuotaFor("acme");
  return 0;
}
