#include "client/cli/health_command.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "client/cli/cli_util.h"
#include "client/sdk/channel.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace ctxcache::cli {

void HealthCommand::Configure(CLI::App* sub) {
  sub->add_option("--service", service_, "Service name to check (default: the whole server)");
}

int HealthCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  client::ClientOptions o;
  o.server = global.server;
  if (Status s = ApplyCredentials(global, &o); !s.ok()) {
    err << "ctxcache: " << s.message() << "\n";
    return kExitUsage;
  }
  auto channel = client::internal::MakeChannel(o);
  if (!channel.ok()) {
    err << "ctxcache: " << channel.status().message() << "\n";
    return kExitUsage;
  }
  auto stub = grpc::health::v1::Health::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(global.timeout_s * 1000)));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service_);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      err << "ctxcache: cannot reach ctxcached at " << global.server << " (" << s.error_message()
          << "); is it running? pass --server HOST:PORT\n";
      return kExitUnreachable;
    }
    err << "ctxcache: health check failed: " << s.error_message() << "\n";
    return kExitFailed;
  }
  bool serving = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  std::string status = serving ? "SERVING"
                       : resp.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING
                           ? "NOT_SERVING"
                           : "UNKNOWN";
  if (global.json) {
    out << nlohmann::json{{"server", global.server}, {"service", service_}, {"status", status}}
               .dump()
        << "\n";
  } else {
    out << status << "\n";
  }
  return serving ? kExitOk : kExitFailed;
}

}  // namespace ctxcache::cli
