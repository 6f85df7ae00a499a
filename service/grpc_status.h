// Conversion from ctxcache::Status to grpc::Status (codes map 1:1).
#pragma once

#include <grpcpp/support/status.h>

#include "common/status.h"

namespace ctxcache::service {

inline grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace ctxcache::service
