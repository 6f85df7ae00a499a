// DecodeSession: the server side of one Decode stream. It holds a lease on
// the context (via a ContextReader), one Selector per (layer, kv head)
// loaded from the context's artifacts, the KV the worker appended, and the
// session's parameters.
//
// The session's logical sequence is the stored context (n_stored tokens)
// followed by the appended tokens. Page b covers tokens [b*B, (b+1)*B) of
// that sequence: pages wholly inside the stored part come from the store,
// the others are assembled from stored and appended KV.
//
// Thread-safety: one Decode stream drives a session from one thread; not
// safe for concurrent use.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "ctxcache/v1/ctxcache_service.pb.h"
#include "index/page_table.h"
#include "index/selector.h"
#include "index/session_params.h"
#include "storage/context_reader.h"
#include "storage/store.h"

namespace ctxcache::service {

struct SessionOptions {
  // Max bytes of pages per PageBatch message. Default: 4 MiB.
  size_t max_batch_bytes = 4u << 20;
  // Testing only: flip a bit of each page after its crc is computed.
  bool corrupt_pages = false;
};

class DecodeSession {
 public:
  // Opens `method` on the context held by `reader`. params: see
  // index/session_params.h (rho, budget, page_fraction, whole_pages,
  // subgroup, recent_blocks).
  ~DecodeSession();
  static StatusOr<std::unique_ptr<DecodeSession>> Open(
      std::unique_ptr<storage::ContextReader> reader, const std::string& method,
      const std::map<std::string, std::string>& params, bool want_pages,
      const SessionOptions& options);

  const v1::ContextManifest& manifest() const { return reader_->manifest(); }
  const std::string& method() const { return method_; }
  int64_t n_tokens() const { return n_stored_ + n_appended_; }

  // One layer-step: selection, page tables and (with want_pages) pages.
  // Page batches are appended to *batches (each <= max_batch_bytes).
  Status Step(const v1::StepRequest& step, v1::StepResult* result,
              std::vector<v1::PageBatch>* batches);

  // Streaming update with the new token's K, V (and Q) for every layer.
  Status Append(const v1::AppendRequest& append);

  // Stored bytes of pages served so far.
  uint64_t bytes_served() const { return bytes_served_; }

 private:
  class SessionKeySource;
  DecodeSession() = default;
  Status ReadTokenKV(uint32_t layer, uint32_t kv_head, uint32_t block, v1::Page* page);

  std::unique_ptr<storage::ContextReader> reader_;
  std::string method_;
  bool want_pages_ = false;
  SessionOptions options_;
  uint32_t n_layers_ = 0, n_q_ = 0, n_kv_ = 0, d_ = 0, block_ = 16;
  int64_t n_stored_ = 0, n_appended_ = 0;
  index::SessionParams params_;
  // [layer * n_kv + head]
  std::vector<std::unique_ptr<index::Selector>> selectors_;
  std::vector<std::unique_ptr<SessionKeySource>> key_sources_;
  // Appended KV, fp32 as received (exact scoring sees what the worker
  // attends to), [layer * n_kv + head] -> [n_appended][d].
  std::vector<std::vector<float>> app_k_, app_v_;
  uint64_t bytes_served_ = 0;
  std::vector<float> qbuf_;
};

// Tensor helpers shared by the service: decode a Tensor to fp32, checking
// dtype, shape and finiteness. `what` names the field in errors.
Status TensorToFloat(const v1::Tensor& t, const std::vector<int64_t>& shape, const char* what,
                     std::vector<float>* out);

}  // namespace ctxcache::service
