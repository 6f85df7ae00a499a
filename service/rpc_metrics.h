// The scope of every RPC handler: authentication and authorization
// (service/access.h), per-RPC accounting (count, latency and errors per
// method, one debug log line per RPC) and the audit log. Every ContextAdmin,
// DecodeService and ClusterService handler runs its body through HandleRpc
// (below), which opens the scope, refuses what it must and finishes the
// scope with the body's status:
//   const RpcSpec spec{"GetContext", auth::Action::kRead};
//   return HandleRpc(ctx_, context, spec, [&](RpcScope& rpc) -> grpc::Status {
//     ... rpc.principal() ..., rpc.set_context_id(hex) ...
//     return status;
//   });
// The audit log gets one JSON line per call that changes state (actions
// build, share and cluster) and per call refused for its credentials or role: who
// (key id / cert subject, never the key), tenant, role, rpc, context id,
// peer and result. Never a key, never a prompt.
#pragma once

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>

#include "auth/principal.h"
#include "service/access.h"
#include "service/connection_streams.h"
#include "service/grpc_status.h"
#include "service/metrics.h"
#include "service/service_context.h"

namespace ctxcache::service {

class RpcScope {
 public:
  RpcScope(ServiceContext* ctx, const grpc::ServerContext* context, const char* method,
           auth::Action action)
      : ctx_(ctx),
        context_(context),
        method_(method),
        action_(action),
        start_(std::chrono::steady_clock::now()) {
    if (!ctx_->config.fault_throw_in_rpc.empty() && ctx_->config.fault_throw_in_rpc == method) {
      throw std::runtime_error("fault injected by --fault-throw-in-rpc-for-testing");
    }
    auto p = ctx_->access->Authenticate(context);
    if (p.ok()) {
      principal_ = std::move(p).value();
      authenticated_ = true;
      auth_status_ = ToGrpc(AccessControl::CheckRole(principal_, action, method));
      if (auth_status_.ok()) auth_status_ = ToGrpc(ctx_->quotas->AdmitMessage(principal_.tenant));
    } else {
      auth_status_ = ToGrpc(p.status());
    }
  }

  // False when the call may not run: bad credentials, a role without the
  // permission, or the tenant's message rate exceeded; auth_status() says.
  bool authorized() const { return auth_status_.ok(); }
  // Streaming calls: holds one of the connection's streams
  // (--max-streams-per-connection; calls forwarded by a cluster peer are not
  // counted) and one of the tenant's max_streams until the scope ends.
  grpc::Status AdmitStream() {
    if (!context_->client_metadata().count("ctxcache-forwarded")) {
      auto c = ctx_->connection_streams.Admit(context_->peer());
      if (!c.ok()) return ToGrpc(c.status());
      connection_stream_ = std::move(c).value();
    }
    auto g = ctx_->quotas->AdmitStream(principal_.tenant);
    if (!g.ok()) return ToGrpc(g.status());
    stream_ = std::move(g).value();
    return grpc::Status::OK;
  }
  const grpc::Status& auth_status() const { return auth_status_; }
  const auth::Principal& principal() const { return principal_; }
  // For the audit line: the context the call acted on, and its tenant.
  void set_context_id(std::string id) { context_id_ = std::move(id); }
  void set_tenant(std::string tenant) { tenant_ = std::move(tenant); }

  grpc::Status Finish(const grpc::Status& status) {
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    auto& m = ctx_->metrics;
    // Errors are ctxcache_rpc_total{code!="OK"}: no separate error counter.
    m.GetCounter("ctxcache_rpc_total", "RPCs handled, by method and status code",
                 {{"method", method_}, {"code", CodeName(status.error_code())}})
        ->Inc();
    m.GetHistogram("ctxcache_rpc_duration_seconds", "RPC handling time, by method",
                   {{"method", method_}})
        ->Observe(secs);
    spdlog::debug("rpc method={} code={} duration_us={:.0f} msg=\"{}\"", method_,
                  CodeName(status.error_code()), secs * 1e6, status.error_message());
    const bool refused = status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                         status.error_code() == grpc::StatusCode::PERMISSION_DENIED;
    if (ctx_->audit &&
        (action_ == auth::Action::kBuild || action_ == auth::Action::kShare ||
         action_ == auth::Action::kCluster || refused)) {
      Audit(status);
    }
    return status;
  }

 private:
  static std::string CodeName(grpc::StatusCode code) {
    return std::string(StatusCodeName(static_cast<StatusCode>(code)));
  }
  // JSON string escaping for the few fields we log (ids, names, peer).
  static std::string Json(const std::string& s) {
    std::string out = "\"";
    for (char c : s.substr(0, 256)) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        out += ' ';
      } else {
        out += c;
      }
    }
    return out + "\"";
  }
  void Audit(const grpc::Status& status) {
    const bool authenticated = authenticated_;
    ctx_->audit->info(
        "{{\"rpc\":{},\"who\":{},\"role\":{},\"tenant\":{},\"context\":{},\"peer\":{},"
        "\"code\":{},\"duration_ms\":{:.1f}}}",
        Json(method_), Json(authenticated ? principal_.id : "unauthenticated"),
        Json(authenticated ? std::string(auth::RoleName(principal_.role)) : ""),
        Json(tenant_.empty() && authenticated ? principal_.tenant : tenant_), Json(context_id_),
        Json(context_->peer()), Json(CodeName(status.error_code())),
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
            .count());
  }

  ServiceContext* ctx_;
  const grpc::ServerContext* context_;
  const char* method_;
  auth::Action action_;
  std::chrono::steady_clock::time_point start_;
  auth::Principal principal_;
  ConnectionStreams::Guard connection_stream_;
  QuotaGuard stream_;
  bool authenticated_ = false;
  grpc::Status auth_status_;
  std::string context_id_;
  std::string tenant_;
};

// Runs a handler body. An exception escaping it (a bug: handlers return
// Status) is logged with an incident number and becomes INTERNAL naming
// that number, never gRPC's UNKNOWN "Unexpected error in RPC handling";
// it is counted in ctxcache_rpc_total{code="INTERNAL"}.
template <typename Fn>
grpc::Status Guarded(ServiceContext* ctx, const char* method, Fn&& body) {
  std::string what;
  try {
    return body();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an exception of unknown type";
  }
  static std::atomic<uint64_t> incidents{0};
  const uint64_t n = ++incidents;
  spdlog::error("incident {}: {} threw: {}", n, method, what);
  ctx->metrics
      .GetCounter("ctxcache_rpc_total", "RPCs handled, by method and status code",
                  {{"method", method}, {"code", "INTERNAL"}})
      ->Inc();
  return grpc::Status(grpc::StatusCode::INTERNAL, std::string("internal error in ") + method +
                                                      " (incident " + std::to_string(n) +
                                                      "; the server log has the details)");
}

// What a handler admits before its body runs, after the credentials, the
// role and the tenant's message rate (RpcScope::authorized), in this order.
enum class Admission {
  kCall,               // nothing more
  kStream,             // one of the connection's and the tenant's streams
                       // (RpcScope::AdmitStream)
  kStreamNotDraining,  // kStream, then UNAVAILABLE "draining" while the server
                       // drains (calls that start new work)
};

// One RPC as its handler declares it.
struct RpcSpec {
  const char* method;   // the RPC's name: metrics, logs, the audit log
  auth::Action action;  // what the caller's role must allow
  Admission admission = Admission::kCall;
};

// The prologue every handler shares: Guarded (an escaping exception becomes
// INTERNAL), an RpcScope for spec.method and spec.action, the refusals of
// RpcScope::authorized and of spec.admission, each finished through the
// scope; then body(rpc), whose status finishes the scope and is returned.
template <typename Fn>
grpc::Status HandleRpc(ServiceContext* ctx, const grpc::ServerContext* context, const RpcSpec& spec,
                       Fn&& body) {
  return Guarded(ctx, spec.method, [&]() -> grpc::Status {
    RpcScope rpc(ctx, context, spec.method, spec.action);
    if (!rpc.authorized()) return rpc.Finish(rpc.auth_status());
    if (spec.admission != Admission::kCall) {
      if (grpc::Status s = rpc.AdmitStream(); !s.ok()) return rpc.Finish(s);
    }
    if (spec.admission == Admission::kStreamNotDraining && ctx->draining) {
      return rpc.Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining"));
    }
    return rpc.Finish(body(rpc));
  });
}

}  // namespace ctxcache::service
