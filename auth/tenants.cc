#include "auth/tenants.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "auth/crypto.h"
#include "auth/principal.h"

namespace ctxcache::auth {

namespace {

std::string Trim(std::string s) {
  size_t b = s.find_first_not_of(" \t\r");
  size_t e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

StatusOr<uint64_t> ParseSize(const std::string& v, const std::string& where) {
  if (v.empty()) return InvalidArgumentError(where + ": empty value");
  size_t i = 0;
  uint64_t n = 0;
  for (; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) {
    if (n > (UINT64_MAX - 9) / 10) return InvalidArgumentError(where + ": value too large");
    n = n * 10 + static_cast<uint64_t>(v[i] - '0');
  }
  if (i == 0) return InvalidArgumentError(where + ": expected a non-negative integer");
  std::string suffix = Trim(v.substr(i));
  int shift = 0;
  if (suffix.empty()) {
    shift = 0;
  } else if (suffix == "K" || suffix == "KiB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MiB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GiB") {
    shift = 30;
  } else if (suffix == "T" || suffix == "TiB") {
    shift = 40;
  } else {
    return InvalidArgumentError(where + ": unknown suffix '" + suffix.substr(0, 8) +
                                "' (expected K, M, G or T)");
  }
  if (shift && n > (UINT64_MAX >> shift)) return InvalidArgumentError(where + ": value too large");
  return n << shift;
}

}  // namespace

StatusOr<TenantsConfig> TenantsConfig::Parse(std::string_view text) {
  TenantsConfig out;
  TenantQuota* section = nullptr;
  std::istringstream in{std::string(text)};
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    line = Trim(line);
    if (line.empty()) continue;
    const std::string where = "tenants file line " + std::to_string(lineno);
    if (line.front() == '[') {
      if (line.back() != ']') return InvalidArgumentError(where + ": unterminated section");
      std::string name = Trim(line.substr(1, line.size() - 2));
      if (name == "default") {
        section = &out.defaults;
      } else if (name.rfind("tenant.", 0) == 0) {
        std::string t = name.substr(7);
        RETURN_IF_ERROR(ValidateTenantName(t, "tenant").WithContext(where));
        section = &out.tenants[t];
      } else {
        return InvalidArgumentError(where + ": expected [default] or [tenant.<name>], got [" +
                                    name.substr(0, 64) + "]");
      }
      continue;
    }
    auto eq = line.find('=');
    if (eq == std::string::npos) return InvalidArgumentError(where + ": expected key = value");
    if (!section) return InvalidArgumentError(where + ": a key before any [section]");
    std::string key = Trim(line.substr(0, eq));
    std::string value = Trim(line.substr(eq + 1));
    auto v = ParseSize(value, where + " " + key);
    if (!v.ok()) return v.status();
    if (key == "max_stored_bytes") {
      section->max_stored_bytes = *v;
    } else if (key == "max_contexts") {
      section->max_contexts = *v;
    } else if (key == "max_sessions") {
      section->max_sessions = *v;
    } else if (key == "max_builds") {
      section->max_builds = *v;
    } else if (key == "build_tokens_per_minute") {
      section->build_tokens_per_minute = *v;
    } else if (key == "max_streams") {
      section->max_streams = *v;
    } else if (key == "max_messages_per_second") {
      section->max_messages_per_second = *v;
    } else {
      return InvalidArgumentError(where + ": unknown key '" + key.substr(0, 64) +
                                  "' (expected max_stored_bytes, max_contexts, max_sessions, "
                                  "max_builds, build_tokens_per_minute, max_streams or "
                                  "max_messages_per_second)");
    }
  }
  // Tenants inherit unset values from [default] only by being absent; a
  // section states the tenant's whole quota.
  return out;
}

StatusOr<TenantsConfig> TenantsConfig::Read(const std::string& path) {
  std::ifstream f(path);
  if (!f)
    return NotFoundError("tenants file '" + path + "' cannot be read: " + std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  auto parsed = Parse(ss.str());
  if (!parsed.ok()) return parsed.status().WithContext(path);
  return parsed;
}

std::string IdNamespace(std::string_view id_secret, std::string_view tenant, bool ingested) {
  if (tenant.empty() && !ingested) return "";
  std::string msg = "tenant";
  msg.push_back('\0');
  msg.append(tenant);
  Sha256::Digest salt = HmacSha256(id_secret, msg);
  std::string ns(1, ingested ? 'I' : 'B');
  ns.append(reinterpret_cast<const char*>(salt.data()), salt.size());
  return ns;
}

StatusOr<std::string> LoadOrCreateIdSecret(const std::string& path) {
  constexpr size_t kBytes = 32;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ASSIGN_OR_RETURN(std::string secret, RandomBytes(kBytes));
    std::string hex = HexEncode(secret) + "\n";
    bool ok =
        ::write(fd, hex.data(), hex.size()) == static_cast<ssize_t>(hex.size()) && ::fsync(fd) == 0;
    ::close(fd);
    if (!ok) {
      ::unlink(path.c_str());
      return InternalError("cannot write the id secret '" + path + "': " + std::strerror(errno));
    }
    return secret;
  }
  if (errno != EEXIST) {
    return InternalError("cannot create the id secret '" + path + "': " + std::strerror(errno));
  }
  std::ifstream f(path);
  std::string hex;
  if (!(f >> hex)) return DataLossError("the id secret '" + path + "' is empty or unreadable");
  auto secret = HexDecode(hex, "id secret '" + path + "'");
  if (!secret.ok()) return secret.status();
  if (secret->size() != kBytes) {
    return DataLossError("the id secret '" + path + "' must hold 64 hex characters");
  }
  return secret;
}

}  // namespace ctxcache::auth
