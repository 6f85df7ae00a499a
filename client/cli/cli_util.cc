#include "client/cli/cli_util.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>

#include "client/sdk/channel.h"

namespace ctxcache::cli {

namespace {

bool IsUnreachable(StatusCode code) {
  return code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded;
}

}  // namespace

Status ApplyCredentials(const GlobalOptions& global, client::ClientOptions* o) {
  o->tls_ca = global.tls_ca;
  o->tls_cert = global.tls_cert;
  o->tls_key = global.tls_key;
  o->tls_server_name = global.tls_server_name;
  if (!global.api_key_file.empty()) {
    std::ifstream f(global.api_key_file);
    if (!(f >> o->api_key)) {
      return InvalidArgumentError("--api-key-file: cannot read a key from '" +
                                  global.api_key_file + "'");
    }
  } else if (const char* env = std::getenv("CTXCACHE_API_KEY"); env && *env) {
    o->api_key = env;
  } else {
    o->api_key = global.api_key;
  }
  return Status::OK();
}

std::unique_ptr<client::Client> ConnectOrExplain(const GlobalOptions& global, std::ostream& err,
                                                 int* exit_code) {
  client::ClientOptions o;
  o.server = global.server;
  o.timeout_s = global.timeout_s;
  o.max_attempts = 2;
  *exit_code = kExitUsage;
  if (Status creds = ApplyCredentials(global, &o); !creds.ok()) {
    err << "ctxcache: " << creds.message() << "\n";
    return nullptr;
  }
  if (global.dial_timeout_s <= 0) {
    err << "ctxcache: --dial-timeout must be > 0 seconds\n";
    return nullptr;
  }
  if (global.server.rfind("etcd://", 0) != 0) {
    auto channel = client::internal::MakeChannel(o);
    if (!channel.ok()) {
      err << "ctxcache: " << channel.status().message() << "\n";
      return nullptr;
    }
    const auto dial = std::chrono::milliseconds(static_cast<int64_t>(global.dial_timeout_s * 1000));
    const auto deadline = std::chrono::system_clock::now() + dial;
    if (!(*channel)->WaitForConnected(deadline)) {
      err << "ctxcache: cannot reach ctxcached at " << global.server << " within "
          << global.dial_timeout_s
          << " s (--dial-timeout); is it running? pass --server HOST:PORT\n";
      *exit_code = kExitUnreachable;
      return nullptr;
    }
  }
  auto c = client::Client::Connect(o);
  if (!c.ok()) {
    err << "ctxcache: " << c.status().message() << "\n";
    *exit_code = IsUnreachable(c.status().code()) ? kExitUnreachable : kExitUsage;
    return nullptr;
  }
  *exit_code = kExitOk;
  return std::move(c).value();
}

int Fail(const Status& s, const GlobalOptions& global, std::ostream& err) {
  if (s.code() == StatusCode::kUnavailable) {
    err << "ctxcache: cannot reach ctxcached at " << global.server
        << "; is it running? pass --server HOST:PORT\n";
    return kExitUnreachable;
  }
  if (s.code() == StatusCode::kDeadlineExceeded) {
    err << "ctxcache: no answer from ctxcached at " << global.server << " within "
        << global.timeout_s << " s (--timeout): " << s.message() << "\n";
    return kExitUnreachable;
  }
  std::string msg(s.message());
  if (s.code() == StatusCode::kNotFound) {
    err << "ctxcache: not found: " << msg << "; `ctxcache ls` lists the contexts\n";
  } else {
    err << "ctxcache: " << StatusCodeName(s.code()) << ": " << msg << "\n";
  }
  return kExitFailed;
}

std::string HumanBytes(uint64_t b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1000 && u < 4) {
    v /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::string HumanTime(int64_t ms) {
  if (ms <= 0) return "-";
  std::time_t t = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string StateName(v1::ContextState s) {
  switch (s) {
    case v1::CONTEXT_STATE_BUILDING:
      return "BUILDING";
    case v1::CONTEXT_STATE_READY:
      return "READY";
    case v1::CONTEXT_STATE_FAILED:
      return "FAILED";
    default:
      return "UNSPECIFIED";
  }
}

nlohmann::json InfoToJson(const v1::ContextInfo& info) {
  nlohmann::json j;
  j["context_id"] = info.context_id();
  j["name"] = info.name();
  j["state"] = StateName(info.state());
  j["model"] = info.model_name();
  j["n_tokens"] = info.n_tokens();
  j["block_tokens"] = info.block_tokens();
  j["stored_bytes"] = info.stored_bytes();
  j["raw_kv_bytes"] = info.raw_kv_bytes();
  j["bytes_by_kind"] = nlohmann::json::object();
  for (const auto& [k, v] : info.bytes_by_kind()) j["bytes_by_kind"][k] = v;
  j["indexes"] = nlohmann::json::array();
  for (const auto& ip : info.indexes()) {
    nlohmann::json p = nlohmann::json::object();
    for (const auto& [k, v] : ip.params()) p[k] = v;
    j["indexes"].push_back({{"method", ip.method()}, {"params", p}});
  }
  j["created_at_ms"] = info.created_at_ms();
  j["last_access_ms"] = info.last_access_ms();
  j["expires_at_ms"] = info.expires_at_ms();
  j["pinned"] = info.pinned();
  j["shared"] = info.shared();
  j["provenance"] = info.provenance() == v1::PROVENANCE_INGESTED ? "ingested" : "built";
  j["labels"] = nlohmann::json::object();
  for (const auto& [k, v] : info.labels()) j["labels"][k] = v;
  if (!info.parent_id().empty()) {
    j["parent_id"] = info.parent_id();
    j["prefix_tokens"] = info.prefix_tokens();
  }
  return j;
}

}  // namespace ctxcache::cli
