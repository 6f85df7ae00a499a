// Who is calling, and what each role may do.
//
// Roles (docs/security.md has the full RPC table):
//   operator - server-wide: every RPC on every tenant's contexts, the
//              ClusterService, server-wide GetStats. The only role allowed
//              the default (no-tenant) namespace in a keys file, and the
//              role of every caller when the server runs without a keys file;
//   admin    - every ContextAdmin and DecodeService RPC (ShareContext
//              included), within its own tenant only: another tenant's
//              context is NOT_FOUND to it, as to a builder or reader;
//   builder  - build, ingest, extend, pin and evict within its tenant;
//   reader   - get, list, fetch, decode sessions and watch within its tenant
//              (plus contexts marked shared).
// GetStats is open to every authenticated role; all but operators see their
// own tenant's numbers.
//
// Thread-safety: value types and pure functions.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace ctxcache::auth {

enum class Role { kReader, kBuilder, kAdmin, kOperator };

// What an RPC needs.
enum class Action {
  kRead,     // GetContext, ListContexts, Decode, FetchIndex, FetchPages, WatchContexts
  kBuild,    // BuildContext, ExtendContext, IngestContext, PinContext, EvictContext
  kShare,    // ShareContext
  kStats,    // GetStats
  kCluster,  // ClusterService (replication between nodes, cluster status)
};

std::string_view RoleName(Role role);
// "reader" | "builder" | "admin" | "operator"; INVALID_ARGUMENT naming the
// field ("role") and the expected values otherwise.
StatusOr<Role> ParseRole(std::string_view name);
std::string_view ActionName(Action action);

// Whether `role` may call an RPC that needs `action` at all; which tenants'
// contexts it reaches is IsServerWide's question.
bool RoleAllows(Role role, Action action);
// True for the operator only: the one role whose calls reach every tenant's
// contexts, name any tenant in a request and see server-wide numbers.
bool IsServerWide(Role role);

struct Principal {
  // Key id, "cert:<CN>" for an mTLS subject, or "anonymous" when the server
  // runs without authentication.
  std::string id = "anonymous";
  // The caller's tenant; "" is the default (no-tenant) namespace.
  std::string tenant;
  // Without a keys file every caller is the anonymous operator.
  Role role = Role::kOperator;
};

// Tenant names: 1-64 characters of [A-Za-z0-9._-]. INVALID_ARGUMENT naming
// `field` otherwise.
Status ValidateTenantName(std::string_view name, std::string_view field);

}  // namespace ctxcache::auth
