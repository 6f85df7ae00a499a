// API keys and mTLS subject mappings: the keys file, key generation and the
// server's key store.
//
// A key is "ck_<id>_<secret>": <id> is 12 hex characters (public, names the
// entry), <secret> 64 hex characters (32 random bytes). The file keeps only
// SHA-256(salt || secret) with a per-key random salt, never the key. Format
// (one entry per line, '#' comments; docs/security.md):
//   key <id> tenant=<T> role=<R> salt=<32 hex> sha256=<64 hex> [created=<unix s>]
//   cert cn=<certificate subject CN> tenant=<T> role=<R>
// role is reader, builder, admin (scoped to its tenant) or operator
// (server-wide); auth/principal.h says what each may do. tenant "-" stands
// for the default (no-tenant) namespace; only operator entries may use it.
// An admin entry with tenant "-" (the server-wide admin of files written
// before operators existed) is refused with a message naming the migration:
// role=operator, or a tenant (docs/security.md "Migrating admin keys").
//
// Thread-safety: KeysFile and GeneratedKey are values. KeyStore is safe for
// concurrent use; Authenticate* may run while another thread reloads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "auth/principal.h"
#include "common/status.h"

namespace ctxcache::auth {

struct KeyEntry {
  std::string id;
  std::string tenant;
  Role role = Role::kReader;
  std::string salt;    // raw bytes (16)
  std::string sha256;  // raw bytes (32): SHA-256(salt || secret)
  int64_t created_s = 0;
};

struct SubjectEntry {
  std::string cn;
  std::string tenant;
  Role role = Role::kReader;
};

struct KeysFile {
  std::vector<KeyEntry> keys;
  std::vector<SubjectEntry> subjects;

  // INVALID_ARGUMENT naming the line and field on any malformed entry, a
  // duplicate key id or CN, an unknown role (naming the expected values), or
  // an entry other than an operator without a tenant.
  static StatusOr<KeysFile> Parse(std::string_view text);
  std::string Serialize() const;

  // Reads `path` (NOT_FOUND if missing).
  static StatusOr<KeysFile> Read(const std::string& path);
  // Writes `path` atomically (temp file, fsync, rename), mode 0600.
  Status Write(const std::string& path) const;
};

struct GeneratedKey {
  std::string key;  // shown once: "ck_<id>_<secret>"
  KeyEntry entry;   // what the keys file stores
};

// A keys-file entry's tenant for `role`: "" (the default namespace) for an
// operator only, else a valid tenant name. INVALID_ARGUMENT naming `field`
// otherwise; for an admin without a tenant the message names the migration
// (role operator for a server-wide key).
Status ValidateEntryTenant(std::string_view tenant, Role role, std::string_view field);

// A fresh key for (tenant, role); tenant "" = the default namespace, for
// operator keys only (INVALID_ARGUMENT otherwise).
StatusOr<GeneratedKey> GenerateKey(const std::string& tenant, Role role);

// The server's view of the keys file.
class KeyStore {
 public:
  // Loads `path`; a missing or malformed file is an error (the server must
  // not start with credentials it cannot read).
  static StatusOr<std::unique_ptr<KeyStore>> Open(const std::string& path);

  // Re-reads the file if its mtime, size or inode changed (checked at most
  // once per `min_interval_ms`). A malformed new file is reported and the
  // previous keys stay in force. Returns true when new keys took effect.
  StatusOr<bool> ReloadIfChanged(int64_t min_interval_ms = 1000);
  // Re-reads the file now.
  Status Reload();

  // The principal for an "authorization" metadata value ("Bearer <key>");
  // UNAUTHENTICATED (saying nothing about which part was wrong) otherwise.
  StatusOr<Principal> AuthenticateBearer(std::string_view header) const;
  // The principal mapped to a verified client certificate's subject CN;
  // UNAUTHENTICATED if none.
  StatusOr<Principal> AuthenticateSubject(std::string_view cn) const;

  size_t n_keys() const;
  const std::string& path() const { return path_; }

 private:
  KeyStore() = default;
  struct FileStamp {
    int64_t mtime_ns = 0;
    int64_t size = -1;
    uint64_t inode = 0;
    bool operator==(const FileStamp&) const = default;
  };
  static StatusOr<FileStamp> Stamp(const std::string& path);

  std::string path_;
  mutable std::mutex mu_;
  std::shared_ptr<const KeysFile> file_;  // guarded by mu_
  std::map<std::string, size_t> by_id_;   // guarded by mu_
  FileStamp stamp_;                       // guarded by mu_
  int64_t last_check_ms_ = 0;             // guarded by mu_
};

}  // namespace ctxcache::auth
