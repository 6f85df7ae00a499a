// The SDK's one way to reach ctxcached: the channel (plaintext or TLS /
// mTLS from ClientOptions) and the per-call credentials (the API key as
// "authorization: Bearer <key>" metadata). The CLI's health check uses it
// too.
//
// Thread-safety: stateless.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "common/status.h"
#include "ctxcache/client.h"

namespace ctxcache::client::internal {

// INVALID_ARGUMENT naming the option when a TLS file cannot be read, or
// tls_cert/tls_key are given without each other or without tls_ca.
// connection >= 0: a channel on a TCP connection of its own (numbered; two
// channels with the same number may share one), for bulk streams that
// should not queue behind each other. -1 (default): gRPC's shared one.
StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& options,
                                                     int connection = -1);

// Adds the API key (if any) to a call's metadata. Every call the SDK makes
// goes through it.
void AddCallCredentials(const ClientOptions& options, grpc::ClientContext* ctx);

}  // namespace ctxcache::client::internal
