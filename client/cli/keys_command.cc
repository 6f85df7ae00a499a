#include "client/cli/keys_command.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "auth/keys_file.h"
#include "client/cli/cli_util.h"

namespace ctxcache::cli {

namespace {

constexpr const char* kRoleHelp =
    "reader | builder | admin (its tenant only) | operator (server-wide: every tenant, the "
    "cluster service)";

}  // namespace

void KeysCommand::Configure(CLI::App* sub) {
  sub->require_subcommand(1);
  auto file_opt = [&](CLI::App* a) {
    a->add_option("--keys-file", keys_file_, "The keys file ctxcached --keys-file reads")
        ->required();
  };
  create_ = sub->add_subcommand("create", "Create a key for a tenant and role; prints it once");
  file_opt(create_);
  create_->add_option("--tenant", tenant_, "Tenant (required but for operator keys)");
  create_->add_option("--role", role_, kRoleHelp)->required();
  list_ = sub->add_subcommand("list", "List key ids, tenants and roles (never the keys)");
  file_opt(list_);
  revoke_ = sub->add_subcommand("revoke", "Remove a key (by id) or a cert mapping (by cn)");
  file_opt(revoke_);
  revoke_->add_option("--id", id_, "Key id (the 12 hex characters after ck_)");
  revoke_->add_option("--cn", cn_, "Certificate subject CN of a cert mapping");
  map_cert_ = sub->add_subcommand(
      "map-cert", "Map an mTLS client certificate's subject CN to a tenant and role");
  file_opt(map_cert_);
  map_cert_->add_option("--cn", cn_, "Subject common name")->required();
  map_cert_->add_option("--tenant", tenant_, "Tenant (required but for operator mappings)");
  map_cert_->add_option("--role", role_, kRoleHelp)->required();
  // The global flags (--json) may follow the nested subcommand.
  for (CLI::App* a : {create_, list_, revoke_, map_cert_}) a->fallthrough();
}

int KeysCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  auto fail = [&](const Status& s) {
    err << "ctxcache keys: " << s.message() << "\n";
    return kExitFailed;
  };
  // A missing file starts empty (create / map-cert make it).
  auth::KeysFile file;
  if (auto f = auth::KeysFile::Read(keys_file_); f.ok()) {
    file = std::move(f).value();
  } else if (f.status().code() != StatusCode::kNotFound || list_->parsed() || revoke_->parsed()) {
    return fail(f.status());
  }
  if (create_->parsed() || map_cert_->parsed()) {
    auto role = auth::ParseRole(role_);
    if (!role.ok()) return fail(role.status());
    if (create_->parsed()) {
      auto key = auth::GenerateKey(tenant_, *role);
      if (!key.ok()) return fail(key.status());
      file.keys.push_back(key->entry);
      if (Status s = file.Write(keys_file_); !s.ok()) return fail(s);
      if (global.json) {
        out << nlohmann::json{{"id", key->entry.id},
                              {"tenant", tenant_},
                              {"role", role_},
                              {"key", key->key}}
                   .dump()
            << "\n";
      } else {
        out << key->key << "\n";
        err << "created key " << key->entry.id << " (tenant " << (tenant_.empty() ? "-" : tenant_)
            << ", role " << role_ << "); it is shown only once: store it now\n";
      }
      return 0;
    }
    if (Status s = auth::ValidateEntryTenant(tenant_, *role, "--tenant"); !s.ok()) return fail(s);
    file.subjects.erase(std::remove_if(file.subjects.begin(), file.subjects.end(),
                                       [&](const auth::SubjectEntry& e) { return e.cn == cn_; }),
                        file.subjects.end());
    file.subjects.push_back(auth::SubjectEntry{cn_, tenant_, *role});
    if (Status s = file.Write(keys_file_); !s.ok()) return fail(s);
    out << "mapped certificate CN " << cn_ << " to tenant " << (tenant_.empty() ? "-" : tenant_)
        << ", role " << role_ << "\n";
    return 0;
  }
  if (list_->parsed()) {
    if (global.json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& k : file.keys) {
        arr.push_back({{"id", k.id},
                       {"tenant", k.tenant},
                       {"role", std::string(auth::RoleName(k.role))},
                       {"created_s", k.created_s}});
      }
      for (const auto& c : file.subjects) {
        arr.push_back(
            {{"cn", c.cn}, {"tenant", c.tenant}, {"role", std::string(auth::RoleName(c.role))}});
      }
      out << arr.dump() << "\n";
    } else {
      for (const auto& k : file.keys) {
        out << "key  " << k.id << "  tenant=" << (k.tenant.empty() ? "-" : k.tenant)
            << "  role=" << auth::RoleName(k.role) << "  created=" << HumanTime(k.created_s * 1000)
            << "\n";
      }
      for (const auto& c : file.subjects) {
        out << "cert cn=" << c.cn << "  tenant=" << (c.tenant.empty() ? "-" : c.tenant)
            << "  role=" << auth::RoleName(c.role) << "\n";
      }
    }
    return 0;
  }
  // revoke
  if (id_.empty() == cn_.empty()) {
    return fail(InvalidArgumentError("revoke needs exactly one of --id or --cn"));
  }
  const size_t before = file.keys.size() + file.subjects.size();
  file.keys.erase(
      std::remove_if(file.keys.begin(), file.keys.end(),
                     [&](const auth::KeyEntry& k) { return !id_.empty() && k.id == id_; }),
      file.keys.end());
  file.subjects.erase(
      std::remove_if(file.subjects.begin(), file.subjects.end(),
                     [&](const auth::SubjectEntry& e) { return !cn_.empty() && e.cn == cn_; }),
      file.subjects.end());
  if (file.keys.size() + file.subjects.size() == before) {
    return fail(NotFoundError("no " + (id_.empty() ? "cert mapping cn=" + cn_ : "key " + id_) +
                              " in " + keys_file_));
  }
  if (Status s = file.Write(keys_file_); !s.ok()) return fail(s);
  out << "revoked " << (id_.empty() ? "cert mapping cn=" + cn_ : "key " + id_) << "\n";
  return 0;
}

}  // namespace ctxcache::cli
