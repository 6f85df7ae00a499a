// Authentication, authorization and tenancy for the gRPC handlers
// (docs/security.md).
//
// Every ContextAdmin and DecodeService handler calls Authorize() (through
// RpcScope) first. With a keys file, a call authenticates with an API key
// ("authorization: Bearer <key>") or, over mTLS, with a client certificate
// whose subject CN the keys file maps (a mapped certificate gets the role
// and tenant of its `cert` line, an unmapped one UNAUTHENTICATED: there is
// no default role); without one, every caller is the anonymous operator
// (and ctxcached only listens on loopback unless --insecure). Only the
// operator role reaches across tenants: an admin, like a builder or reader,
// acts within its own tenant. A context that the caller's tenant may not see
// is reported exactly like a context that does not exist (NOT_FOUND with the
// same message), so no error reveals whether another tenant stores a prompt.
//
// Thread-safety: safe for concurrent use; Reload() may run at any time.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <string>

#include "auth/keys_file.h"
#include "auth/principal.h"
#include "auth/tenants.h"
#include "common/status.h"
#include "ctxcache/v1/ctxcache_service.pb.h"
#include "service/config.h"
#include "storage/context_reader.h"
#include "storage/keys.h"
#include "storage/store.h"

namespace ctxcache::service {

class AccessControl {
 public:
  // Loads the keys file, the tenants file and the id secret named by the
  // config (each optional but the secret, which is created if missing).
  static StatusOr<std::unique_ptr<AccessControl>> Create(const ServerConfig& config);

  // True when callers must authenticate (a keys file is configured).
  bool enabled() const { return keys_ != nullptr; }

  // The caller, if its credentials are valid (UNAUTHENTICATED otherwise).
  StatusOr<auth::Principal> Authenticate(const grpc::ServerContext* context);
  // For a stream already open as `p`: whether the call's credentials still
  // authenticate as `p` under the keys file in force now (it may have been
  // reloaded since). UNAUTHENTICATED when the key or certificate mapping was
  // revoked or now names another tenant or role; the stream must end.
  Status Recheck(const grpc::ServerContext* context, const auth::Principal& p);
  // For --cluster-key-file: the key the nodes present to each other must be
  // an operator's (the ClusterService needs that role). FAILED_PRECONDITION
  // naming `flag`, the key id and its role when this keys file gives the key
  // another role; OK when it has no entry for the key (another node's keys
  // file may) or when authentication is off.
  Status CheckPeerKey(const std::string& key, const char* flag) const;
  // PERMISSION_DENIED (naming `rpc` and the permission) unless p's role may
  // perform `action`.
  static Status CheckRole(const auth::Principal& p, auth::Action action, const char* rpc);

  // The tenant a new context of this caller belongs to: an operator may
  // name any tenant (default: its own); every other role only its own
  // (PERMISSION_DENIED naming the field otherwise).
  StatusOr<std::string> TenantFor(const auth::Principal& p, const std::string& requested) const;

  // Whether `p` may perform `action` on a context of `tenant`: an operator
  // on every context, the other roles on their own tenant's, and a `shared`
  // context is readable (kRead) by every tenant. The role's own permission
  // is CheckRole's business.
  static bool CanAccess(const auth::Principal& p, const std::string& tenant, bool shared,
                        auth::Action action);
  // The context's reader (lease) or manifest if `p` may perform `action` on
  // it; the store's error if it does not exist, and the same
  // storage::ContextNotFoundError if `p` may not see it.
  static StatusOr<std::unique_ptr<storage::ContextReader>> OpenReader(storage::Store* store,
                                                                      const auth::Principal& p,
                                                                      const storage::ContextId& id,
                                                                      auth::Action action);
  static StatusOr<v1::ContextManifest> GetManifest(storage::Store* store, const auth::Principal& p,
                                                   const storage::ContextId& id,
                                                   auth::Action action);

  // ContextManifest.id_namespace for contexts of `tenant`.
  std::string IdNamespace(const std::string& tenant, bool ingested) const {
    return auth::IdNamespace(id_secret_, tenant, ingested);
  }

  std::shared_ptr<const auth::TenantsConfig> tenants() const;

  // Re-reads the keys and tenants files (SIGHUP). On error the previous
  // ones stay in force.
  Status Reload();

 private:
  AccessControl() = default;

  ServerConfig config_;
  std::unique_ptr<auth::KeyStore> keys_;
  std::string id_secret_;
  mutable std::mutex mu_;
  std::shared_ptr<const auth::TenantsConfig> tenants_;  // guarded by mu_
};

}  // namespace ctxcache::service
