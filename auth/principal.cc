#include "auth/principal.h"

namespace ctxcache::auth {

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kOperator:
      return "operator";
    case Role::kAdmin:
      return "admin";
    case Role::kBuilder:
      return "builder";
    case Role::kReader:
      return "reader";
  }
  return "?";
}

StatusOr<Role> ParseRole(std::string_view name) {
  if (name == "operator") return Role::kOperator;
  if (name == "admin") return Role::kAdmin;
  if (name == "builder") return Role::kBuilder;
  if (name == "reader") return Role::kReader;
  return InvalidArgumentError("role: expected reader, builder, admin or operator, got '" +
                              std::string(name.substr(0, 32)) + "'");
}

std::string_view ActionName(Action action) {
  switch (action) {
    case Action::kRead:
      return "read";
    case Action::kBuild:
      return "build";
    case Action::kShare:
      return "share";
    case Action::kStats:
      return "stats";
    case Action::kCluster:
      return "cluster";
  }
  return "?";
}

bool RoleAllows(Role role, Action action) {
  switch (role) {
    case Role::kOperator:
      return true;
    case Role::kAdmin:
      return action != Action::kCluster;
    case Role::kBuilder:
      return action == Action::kBuild || action == Action::kStats;
    case Role::kReader:
      return action == Action::kRead || action == Action::kStats;
  }
  return false;
}

bool IsServerWide(Role role) { return role == Role::kOperator; }

Status ValidateTenantName(std::string_view name, std::string_view field) {
  if (name.empty() || name.size() > 64) {
    return InvalidArgumentError(std::string(field) + ": expected 1-64 characters, got " +
                                std::to_string(name.size()));
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) {
      return InvalidArgumentError(std::string(field) +
                                  ": only letters, digits, '.', '_' and '-' are allowed");
    }
  }
  return Status::OK();
}

}  // namespace ctxcache::auth
