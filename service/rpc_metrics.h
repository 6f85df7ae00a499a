// Per-RPC accounting: count, latency and errors per method, plus one debug
// log line per RPC. Use as a scope guard at the top of every handler:
//   RpcScope rpc(ctx_, "GetContext");
//   ...
//   return rpc.Finish(status);
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <string>

#include "service/metrics.h"
#include "service/service_context.h"

namespace ctxcache::service {

class RpcScope {
 public:
  RpcScope(ServiceContext* ctx, const char* method)
      : ctx_(ctx), method_(method), start_(std::chrono::steady_clock::now()) {}

  grpc::Status Finish(const grpc::Status& status) {
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    auto& m = ctx_->metrics;
    m.GetCounter("ctxcache_rpc_total", "RPCs handled, by method and status code",
                 {{"method", method_}, {"code", CodeName(status.error_code())}})
        ->Inc();
    m.GetHistogram("ctxcache_rpc_duration_seconds", "RPC handling time, by method",
                   {{"method", method_}})
        ->Observe(secs);
    if (!status.ok()) {
      m.GetCounter("ctxcache_rpc_errors_total", "RPCs that failed, by method",
                   {{"method", method_}})
          ->Inc();
    }
    spdlog::debug("rpc method={} code={} duration_us={:.0f} msg=\"{}\"", method_,
                  CodeName(status.error_code()), secs * 1e6, status.error_message());
    return status;
  }

 private:
  static std::string CodeName(grpc::StatusCode code) {
    return std::string(StatusCodeName(static_cast<StatusCode>(code)));
  }
  ServiceContext* ctx_;
  const char* method_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace ctxcache::service
