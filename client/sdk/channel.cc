#include "client/sdk/channel.h"

#include <fstream>
#include <sstream>

namespace ctxcache::client::internal {

namespace {

StatusOr<std::string> ReadPem(const std::string& path, const char* option) {
  std::ifstream f(path);
  if (!f) return InvalidArgumentError(std::string(option) + ": cannot read '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  if (ss.str().find("-----BEGIN ") == std::string::npos) {
    return InvalidArgumentError(std::string(option) + ": '" + path + "' is not a PEM file");
  }
  return ss.str();
}

}  // namespace

StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& options,
                                                     int connection) {
  grpc::ChannelArguments args;
  if (connection >= 0) {
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("ctxcache.connection", connection);
  }
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.tls_ca.empty()) {
    if (!options.tls_cert.empty() || !options.tls_key.empty()) {
      return InvalidArgumentError("tls_cert/tls_key (mTLS) need tls_ca (the server's CA)");
    }
    return grpc::CreateCustomChannel(options.server, grpc::InsecureChannelCredentials(), args);
  }
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return InvalidArgumentError("tls_cert and tls_key go together: give both or neither");
  }
  grpc::SslCredentialsOptions ssl;
  ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem(options.tls_ca, "tls_ca"));
  if (!options.tls_cert.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem(options.tls_cert, "tls_cert"));
    ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem(options.tls_key, "tls_key"));
  }
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  return grpc::CreateCustomChannel(options.server, grpc::SslCredentials(ssl), args);
}

void AddCallCredentials(const ClientOptions& options, grpc::ClientContext* ctx) {
  if (!options.api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + options.api_key);
}

}  // namespace ctxcache::client::internal
