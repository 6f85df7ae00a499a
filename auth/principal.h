// Who is calling, and what each role may do.
//
// Roles (docs/security.md has the full RPC table):
//   admin   - every RPC, every tenant (including ShareContext);
//   builder - build, ingest, extend, pin and evict within its tenant;
//   reader  - get, list, fetch, decode sessions and watch within its tenant
//             (plus contexts an admin marked shared).
// GetStats is open to every authenticated role; non-admins see their own
// tenant's numbers.
//
// Thread-safety: value types and pure functions.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace ctxcache::auth {

enum class Role { kReader, kBuilder, kAdmin };

// What an RPC needs.
enum class Action {
  kRead,   // GetContext, ListContexts, Decode, FetchIndex, FetchPages, WatchContexts
  kBuild,  // BuildContext, ExtendContext, IngestContext, PinContext, EvictContext
  kAdmin,  // ShareContext
  kStats,  // GetStats
};

std::string_view RoleName(Role role);
// "admin" | "builder" | "reader"; INVALID_ARGUMENT naming the choices otherwise.
StatusOr<Role> ParseRole(std::string_view name);
std::string_view ActionName(Action action);

bool RoleAllows(Role role, Action action);

struct Principal {
  // Key id, "cert:<CN>" for an mTLS subject, or "anonymous" when the server
  // runs without authentication.
  std::string id = "anonymous";
  // The caller's tenant; "" is the default (no-tenant) namespace.
  std::string tenant;
  Role role = Role::kAdmin;
};

// Tenant names: 1-64 characters of [A-Za-z0-9._-]. INVALID_ARGUMENT naming
// `field` otherwise.
Status ValidateTenantName(std::string_view name, std::string_view field);

}  // namespace ctxcache::auth
