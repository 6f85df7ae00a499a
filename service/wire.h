// The one place that converts between the wire API (ctxcache/v1 protos) and
// the service's domain types: context ids, manifests -> ContextInfo, tensors
// -> fp32, stored and assembled pages -> v1::Page, and page batching under
// the message-size limit. Handlers validate, convert here, call the domain
// code and map Status to gRPC (service/grpc_status.h).
//
// Thread-safety: free functions are reentrant; a PageBatcher is used by one
// thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "ctxcache/v1/ctxcache_service.pb.h"
#include "service/build_pipeline.h"
#include "session/page_fetcher.h"
#include "storage/context_reader.h"
#include "storage/keys.h"

namespace ctxcache::service {

// Max page payload bytes per PageBatch message (below gRPC's message limit).
inline constexpr size_t kMaxPageBatchBytes = 4u << 20;

// Request metadata limits (docs/api.md "Limits"): bounded so that every
// response carrying them fits a message and nothing grows without bound.
inline constexpr size_t kMaxNameBytes = 256;
inline constexpr size_t kMaxModelNameBytes = 128;
inline constexpr size_t kMaxLabels = 64;
inline constexpr size_t kMaxLabelKeyBytes = 128;
inline constexpr size_t kMaxLabelValueBytes = 1024;
// TTLs above 100 years are refused (ttl_seconds * 1000 must not overflow).
inline constexpr int64_t kMaxTtlSeconds = int64_t{100} * 365 * 86400;

// A string field: at most max_bytes, no NUL or other control characters.
// InvalidArgument naming `field` (and never echoing more than 64 bytes).
Status ValidateText(std::string_view value, const char* field, size_t max_bytes);
// Labels: count, key and value sizes and content as above.
Status ValidateLabels(const google::protobuf::Map<std::string, std::string>& labels,
                      const char* field);
// 0 <= ttl_seconds <= kMaxTtlSeconds.
Status ValidateTtl(int64_t ttl_seconds, const char* field);
// `s` cut to `max_bytes` (with "..." when cut), for echoing inputs in errors.
std::string Clip(std::string_view s, size_t max_bytes = 64);

// A 32-hex-character context id; InvalidArgument naming `field` otherwise.
StatusOr<storage::ContextId> ParseContextId(const std::string& hex,
                                            const char* field = "context_id");

// A stored manifest in its API form.
v1::ContextInfo ManifestToInfo(const v1::ContextManifest& m);

// A build's progress in its API form.
v1::BuildProgress ProgressToProto(const BuildProgress& p);

// Decodes a Tensor to fp32, checking dtype, shape and finiteness. `what`
// names the field in errors (InvalidArgument).
Status TensorToFloat(const v1::Tensor& t, const std::vector<int64_t>& shape, const char* what,
                     std::vector<float>* out);
// Checks a Tensor meant to be used as it is on the wire: its shape, that its
// dtype is `dtype`, its byte count and finiteness (InvalidArgument naming
// `what`). No conversion.
Status CheckStoredTensor(const v1::Tensor& t, const std::vector<int64_t>& shape, DType dtype,
                         const char* what);

// Page i of a stored batch of (layer, kv_head), bytes as stored, with its
// stored crc32c (over K then V; the read verified it).
v1::Page StoredPageToProto(const storage::PageBatch& batch, size_t i, uint32_t layer,
                           uint32_t kv_head);

// A decoded (fp32) page as a bf16 wire page with its crc32c.
v1::Page DecodedPageToProto(const session::DecodedPage& page, uint32_t head_dim, uint32_t layer,
                            uint32_t kv_head, uint32_t block);

// Packs pages into PageBatch messages of at most max_bytes of payload (a
// page larger than that goes alone). Each full batch goes to `sink`; a sink
// returning false (the client went away) makes Add/Finish return false.
class PageBatcher {
 public:
  using Sink = std::function<bool(v1::PageBatch&&)>;
  PageBatcher(size_t max_bytes, Sink sink, bool corrupt_for_testing = false)
      : max_bytes_(max_bytes), sink_(std::move(sink)), corrupt_(corrupt_for_testing) {}
  bool Add(v1::Page&& page);
  // Sends the last batch (marked `last`, possibly empty).
  bool Finish();

 private:
  size_t max_bytes_;
  Sink sink_;
  bool corrupt_;
  v1::PageBatch current_;
  size_t current_bytes_ = 0;
};

}  // namespace ctxcache::service
