#include "service/access.h"

#include <spdlog/spdlog.h>

#include <filesystem>

namespace ctxcache::service {

StatusOr<std::unique_ptr<AccessControl>> AccessControl::Create(const ServerConfig& config) {
  std::unique_ptr<AccessControl> ac(new AccessControl());
  ac->config_ = config;
  if (!config.keys_file.empty()) {
    ASSIGN_OR_RETURN(ac->keys_, auth::KeyStore::Open(config.keys_file));
  }
  auto tenants = std::make_shared<auth::TenantsConfig>();
  if (!config.tenants_file.empty()) {
    ASSIGN_OR_RETURN(*tenants, auth::TenantsConfig::Read(config.tenants_file));
  }
  ac->tenants_ = std::move(tenants);
  const std::string secret_path =
      config.id_secret_file.empty()
          ? (std::filesystem::path(config.data_dir) / "ID_SECRET").string()
          : config.id_secret_file;
  ASSIGN_OR_RETURN(ac->id_secret_, auth::LoadOrCreateIdSecret(secret_path));
  return ac;
}

StatusOr<auth::Principal> AccessControl::Authenticate(const grpc::ServerContext* context) {
  if (!keys_) return auth::Principal{};  // no authentication: the anonymous operator
  if (auto reloaded = keys_->ReloadIfChanged(); !reloaded.ok()) {
    spdlog::error("keys file: {}; the previous keys stay in force", reloaded.status().ToString());
  } else if (*reloaded) {
    spdlog::info("keys file {} reloaded: {} keys", keys_->path(), keys_->n_keys());
  }
  StatusOr<auth::Principal> p = UnauthenticatedError(
      "missing credentials: send metadata 'authorization: Bearer <key>' or a client "
      "certificate mapped in the keys file");
  const auto& md = context->client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) {
    p = keys_->AuthenticateBearer(std::string_view(it->second.data(), it->second.size()));
  } else if (auto ac = context->auth_context(); ac && ac->IsPeerAuthenticated()) {
    auto cn = ac->FindPropertyValues("x509_common_name");
    if (!cn.empty()) p = keys_->AuthenticateSubject(std::string_view(cn[0].data(), cn[0].size()));
  }
  return p;
}

Status AccessControl::Recheck(const grpc::ServerContext* context, const auth::Principal& p) {
  if (!keys_) return Status::OK();
  auto now = Authenticate(context);
  if (!now.ok()) {
    return UnauthenticatedError("the credentials of this stream were revoked (" +
                                std::string(now.status().message()) + "); the stream ends");
  }
  if (now->id != p.id || now->tenant != p.tenant || now->role != p.role) {
    return UnauthenticatedError("the credentials of this stream (" + p.id +
                                ") changed tenant or role; open a new stream");
  }
  return Status::OK();
}

Status AccessControl::CheckPeerKey(const std::string& key, const char* flag) const {
  if (!keys_) return Status::OK();
  auto p = keys_->AuthenticateBearer("Bearer " + key);
  if (!p.ok()) {
    spdlog::warn("{}: this node's keys file has no entry for the key; its peers must have one",
                 flag);
    return Status::OK();
  }
  if (auth::IsServerWide(p->role)) return Status::OK();
  return FailedPreconditionError(
      std::string(flag) + ": key " + p->id + " has role " + std::string(auth::RoleName(p->role)) +
      " (tenant '" + p->tenant + "'); nodes replicate every tenant's contexts and need an " +
      "operator key: `ctxcache keys create --role operator` (docs/security.md \"Migrating admin " +
      "keys\")");
}

Status AccessControl::CheckRole(const auth::Principal& p, auth::Action action, const char* rpc) {
  if (auth::RoleAllows(p.role, action)) return Status::OK();
  return PermissionDeniedError("role '" + std::string(auth::RoleName(p.role)) + "' may not call " +
                               rpc + " (it needs the " + std::string(auth::ActionName(action)) +
                               " permission; docs/security.md lists the roles)");
}

StatusOr<std::string> AccessControl::TenantFor(const auth::Principal& p,
                                               const std::string& requested) const {
  if (requested.empty()) return p.tenant;
  RETURN_IF_ERROR(auth::ValidateTenantName(requested, "tenant"));
  if (auth::IsServerWide(p.role) || requested == p.tenant) return requested;
  return PermissionDeniedError("tenant: the caller (role " + std::string(auth::RoleName(p.role)) +
                               ") belongs to tenant '" + p.tenant +
                               "' and may not act for tenant '" + requested +
                               "' (only an operator acts for other tenants)");
}

bool AccessControl::CanAccess(const auth::Principal& p, const std::string& tenant, bool shared,
                              auth::Action action) {
  if (auth::IsServerWide(p.role)) return true;
  if (tenant == p.tenant) return true;
  return shared && action == auth::Action::kRead;
}

StatusOr<std::unique_ptr<storage::ContextReader>> AccessControl::OpenReader(
    storage::Store* store, const auth::Principal& p, const storage::ContextId& id,
    auth::Action action) {
  ASSIGN_OR_RETURN(std::unique_ptr<storage::ContextReader> reader, store->OpenReader(id));
  const v1::ContextManifest& m = reader->manifest();
  if (!CanAccess(p, m.tenant(), m.shared(), action)) return storage::ContextNotFoundError(id);
  return reader;
}

StatusOr<v1::ContextManifest> AccessControl::GetManifest(storage::Store* store,
                                                         const auth::Principal& p,
                                                         const storage::ContextId& id,
                                                         auth::Action action) {
  ASSIGN_OR_RETURN(v1::ContextManifest m, store->GetManifest(id));
  if (!CanAccess(p, m.tenant(), m.shared(), action)) return storage::ContextNotFoundError(id);
  return m;
}

std::shared_ptr<const auth::TenantsConfig> AccessControl::tenants() const {
  std::lock_guard<std::mutex> l(mu_);
  return tenants_;
}

Status AccessControl::Reload() {
  Status result = Status::OK();
  if (keys_) {
    if (Status s = keys_->Reload(); !s.ok()) {
      result = s;
    } else {
      spdlog::info("keys file {} reloaded: {} keys", keys_->path(), keys_->n_keys());
    }
  }
  if (!config_.tenants_file.empty()) {
    auto t = auth::TenantsConfig::Read(config_.tenants_file);
    if (!t.ok()) {
      result = t.status();
    } else {
      std::lock_guard<std::mutex> l(mu_);
      tenants_ = std::make_shared<auth::TenantsConfig>(std::move(t).value());
      spdlog::info("tenants file {} reloaded", config_.tenants_file);
    }
  }
  return result;
}

}  // namespace ctxcache::service
