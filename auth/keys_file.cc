#include "auth/keys_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>

#include "auth/crypto.h"
#include "common/clock.h"

namespace ctxcache::auth {

namespace {

constexpr size_t kIdBytes = 6;
constexpr size_t kSecretBytes = 32;
constexpr size_t kSaltBytes = 16;

std::string TenantField(const std::string& tenant) { return tenant.empty() ? "-" : tenant; }

std::string HashSecret(std::string_view salt, std::string_view secret) {
  Sha256 h;
  h.Update(salt);
  h.Update(secret);
  Sha256::Digest d = h.Finish();
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

Status ParseTenantRole(const std::map<std::string, std::string>& kv, const std::string& where,
                       std::string* tenant, Role* role) {
  auto t = kv.find("tenant");
  auto r = kv.find("role");
  if (t == kv.end() || r == kv.end()) {
    return InvalidArgumentError(where + ": tenant= and role= are required");
  }
  auto parsed = ParseRole(r->second);
  if (!parsed.ok()) return parsed.status().WithContext(where);
  *role = *parsed;
  if (t->second == "-") {
    RETURN_IF_ERROR(ValidateEntryTenant("", *role, "tenant '-'").WithContext(where));
    tenant->clear();
  } else {
    RETURN_IF_ERROR(ValidateEntryTenant(t->second, *role, "tenant").WithContext(where));
    *tenant = t->second;
  }
  return Status::OK();
}

}  // namespace

Status ValidateEntryTenant(std::string_view tenant, Role role, std::string_view field) {
  if (!tenant.empty()) return ValidateTenantName(tenant, field);
  if (role == Role::kOperator) return Status::OK();
  // An admin without a tenant was the server-wide role before admins were
  // scoped to their tenant: say how to migrate rather than quietly narrowing
  // it to the default namespace.
  if (role == Role::kAdmin) {
    return InvalidArgumentError(std::string(field) +
                                ": role admin is scoped to one tenant and needs one; a "
                                "server-wide key has role operator (docs/security.md "
                                "\"Migrating admin keys\")");
  }
  return InvalidArgumentError(std::string(field) + ": role " + std::string(RoleName(role)) +
                              " needs a tenant; only operator entries may have none (the "
                              "default namespace)");
}

StatusOr<KeysFile> KeysFile::Parse(std::string_view text) {
  KeysFile out;
  std::set<std::string> ids, cns;
  std::istringstream in{std::string(text)};
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream ls(line);
    std::string kind;
    if (!(ls >> kind)) continue;
    const std::string where = "keys file line " + std::to_string(lineno);
    std::vector<std::string> words;
    for (std::string w; ls >> w;) words.push_back(w);
    std::map<std::string, std::string> kv;
    std::string bare;
    for (const auto& w : words) {
      auto eq = w.find('=');
      if (eq == std::string::npos) {
        if (!bare.empty()) return InvalidArgumentError(where + ": unexpected word '" + w + "'");
        bare = w;
      } else {
        kv[w.substr(0, eq)] = w.substr(eq + 1);
      }
    }
    if (kind == "key") {
      KeyEntry e;
      e.id = bare;
      if (e.id.size() != 2 * kIdBytes || !HexDecode(e.id, "id").ok()) {
        return InvalidArgumentError(where + ": key id must be " + std::to_string(2 * kIdBytes) +
                                    " hex characters");
      }
      if (!ids.insert(e.id).second) {
        return InvalidArgumentError(where + ": duplicate key id " + e.id);
      }
      RETURN_IF_ERROR(ParseTenantRole(kv, where, &e.tenant, &e.role));
      auto salt = HexDecode(kv["salt"], where + ": salt");
      auto sha = HexDecode(kv["sha256"], where + ": sha256");
      if (!salt.ok()) return salt.status();
      if (!sha.ok()) return sha.status();
      if (salt->size() != kSaltBytes || sha->size() != 32) {
        return InvalidArgumentError(where + ": salt must be 32 and sha256 64 hex characters");
      }
      e.salt = *salt;
      e.sha256 = *sha;
      if (kv.count("created")) e.created_s = std::atoll(kv["created"].c_str());
      out.keys.push_back(std::move(e));
    } else if (kind == "cert") {
      SubjectEntry e;
      auto cn = kv.find("cn");
      if (cn == kv.end() || cn->second.empty()) {
        return InvalidArgumentError(where + ": cert entries need cn=<subject common name>");
      }
      e.cn = cn->second;
      if (!cns.insert(e.cn).second) {
        return InvalidArgumentError(where + ": duplicate cert cn " + e.cn);
      }
      RETURN_IF_ERROR(ParseTenantRole(kv, where, &e.tenant, &e.role));
      out.subjects.push_back(std::move(e));
    } else {
      return InvalidArgumentError(where + ": expected 'key' or 'cert', got '" + kind.substr(0, 32) +
                                  "'");
    }
  }
  return out;
}

std::string KeysFile::Serialize() const {
  std::ostringstream o;
  o << "# ctxcache keys file (docs/security.md). Written by `ctxcache keys`; ctxcached\n"
       "# re-reads it when it changes. Holds salted hashes only, never a key.\n";
  for (const auto& k : keys) {
    o << "key " << k.id << " tenant=" << TenantField(k.tenant) << " role=" << RoleName(k.role)
      << " salt=" << HexEncode(k.salt) << " sha256=" << HexEncode(k.sha256);
    if (k.created_s) o << " created=" << k.created_s;
    o << "\n";
  }
  for (const auto& s : subjects) {
    o << "cert cn=" << s.cn << " tenant=" << TenantField(s.tenant) << " role=" << RoleName(s.role)
      << "\n";
  }
  return o.str();
}

StatusOr<KeysFile> KeysFile::Read(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFoundError("keys file '" + path + "' cannot be read: " + std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  auto parsed = Parse(ss.str());
  if (!parsed.ok()) return parsed.status().WithContext(path);
  return parsed;
}

Status KeysFile::Write(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return InternalError("cannot write '" + tmp + "': " + std::strerror(errno));
  const std::string text = Serialize();
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return InternalError("cannot write '" + tmp + "': " + std::strerror(errno));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    return InternalError("cannot sync '" + tmp + "': " + std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return InternalError("cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(errno));
  }
  return Status::OK();
}

StatusOr<GeneratedKey> GenerateKey(const std::string& tenant, Role role) {
  RETURN_IF_ERROR(ValidateEntryTenant(tenant, role, "--tenant"));
  ASSIGN_OR_RETURN(std::string id, RandomBytes(kIdBytes));
  ASSIGN_OR_RETURN(std::string secret, RandomBytes(kSecretBytes));
  ASSIGN_OR_RETURN(std::string salt, RandomBytes(kSaltBytes));
  GeneratedKey g;
  g.entry.id = HexEncode(id);
  g.entry.tenant = tenant;
  g.entry.role = role;
  g.entry.salt = salt;
  const std::string secret_hex = HexEncode(secret);
  g.entry.sha256 = HashSecret(salt, secret_hex);
  g.entry.created_s = static_cast<int64_t>(std::time(nullptr));
  g.key = "ck_" + g.entry.id + "_" + secret_hex;
  return g;
}

StatusOr<KeyStore::FileStamp> KeyStore::Stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return NotFoundError("keys file '" + path + "': " + std::strerror(errno));
  }
  FileStamp s;
  s.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  s.size = st.st_size;
  s.inode = st.st_ino;
  return s;
}

StatusOr<std::unique_ptr<KeyStore>> KeyStore::Open(const std::string& path) {
  std::unique_ptr<KeyStore> ks(new KeyStore());
  ks->path_ = path;
  RETURN_IF_ERROR(ks->Reload());
  return ks;
}

Status KeyStore::Reload() {
  auto stamp = Stamp(path_);
  if (!stamp.ok()) return stamp.status();
  ASSIGN_OR_RETURN(KeysFile f, KeysFile::Read(path_));
  auto file = std::make_shared<const KeysFile>(std::move(f));
  std::map<std::string, size_t> by_id;
  for (size_t i = 0; i < file->keys.size(); ++i) by_id[file->keys[i].id] = i;
  std::lock_guard<std::mutex> l(mu_);
  file_ = std::move(file);
  by_id_ = std::move(by_id);
  stamp_ = *stamp;
  last_check_ms_ = SteadyNowMs();
  return Status::OK();
}

StatusOr<bool> KeyStore::ReloadIfChanged(int64_t min_interval_ms) {
  {
    std::lock_guard<std::mutex> l(mu_);
    const int64_t now = SteadyNowMs();
    if (now - last_check_ms_ < min_interval_ms) return false;
    last_check_ms_ = now;
  }
  auto stamp = Stamp(path_);
  if (!stamp.ok()) return stamp.status();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (*stamp == stamp_) return false;
  }
  RETURN_IF_ERROR(Reload());
  return true;
}

StatusOr<Principal> KeyStore::AuthenticateBearer(std::string_view header) const {
  const Status denied = UnauthenticatedError(
      "missing or invalid API key: send metadata 'authorization: Bearer <key>'");
  constexpr std::string_view kBearer = "Bearer ";
  if (header.substr(0, kBearer.size()) != kBearer) return denied;
  std::string_view key = header.substr(kBearer.size());
  // ck_<12 hex>_<64 hex>
  if (key.size() != 3 + 2 * kIdBytes + 1 + 2 * kSecretBytes || key.substr(0, 3) != "ck_" ||
      key[3 + 2 * kIdBytes] != '_') {
    return denied;
  }
  const std::string id(key.substr(3, 2 * kIdBytes));
  const std::string_view secret = key.substr(3 + 2 * kIdBytes + 1);
  std::shared_ptr<const KeysFile> file;
  size_t index = 0;
  bool found = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    file = file_;
    auto it = by_id_.find(id);
    if (it != by_id_.end()) {
      index = it->second;
      found = true;
    }
  }
  // Hash even for an unknown id, so both paths cost the same.
  static const std::string kNoSalt(kSaltBytes, '\0');
  const KeyEntry* e = found ? &file->keys[index] : nullptr;
  const std::string h = HashSecret(e ? e->salt : kNoSalt, secret);
  if (!e || !ConstantTimeEqual(h, e->sha256)) return denied;
  Principal p;
  p.id = e->id;
  p.tenant = e->tenant;
  p.role = e->role;
  return p;
}

StatusOr<Principal> KeyStore::AuthenticateSubject(std::string_view cn) const {
  std::shared_ptr<const KeysFile> file;
  {
    std::lock_guard<std::mutex> l(mu_);
    file = file_;
  }
  for (const auto& s : file->subjects) {
    if (s.cn == cn) {
      Principal p;
      p.id = "cert:" + s.cn;
      p.tenant = s.tenant;
      p.role = s.role;
      return p;
    }
  }
  return UnauthenticatedError("the client certificate's subject is not mapped to a tenant");
}

size_t KeyStore::n_keys() const {
  std::lock_guard<std::mutex> l(mu_);
  return file_ ? file_->keys.size() : 0;
}

}  // namespace ctxcache::auth
