// TraceSink: a PrefillSink that collects a Trace (model/trace.h) for chosen
// layers, kv heads and query positions during a prefill.
//
// Memory: the stored slices in fp32 (the Trace's in-memory form).
// Thread-safety: like every PrefillSink, driven by one Prefill at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "model/prefill.h"
#include "model/trace.h"

namespace ctxcache::model {

struct TraceSinkOptions {
  // Model layers to keep; empty = all. Default: all.
  std::vector<int> layers;
  // kv heads to keep (with their GQA q heads); empty = all. Default: all.
  std::vector<int> kv_heads;
  // Keep the queries of only the last `q_last` positions; 0 = all. Default: 0.
  int64_t q_last = 0;
};

class TraceSink final : public PrefillSink {
 public:
  explicit TraceSink(const TraceSinkOptions& options) : options_(options) {}

  // Token ids are not seen by sinks: pass them here before or after the
  // prefill (all T of them, starting at the prefill's first position).
  void SetTokens(std::vector<int32_t> tokens) { trace_.tokens = std::move(tokens); }
  void SetModelFingerprint(std::string fp) { trace_.model_fingerprint = std::move(fp); }

  Status OnBegin(const ModelSpec& spec, int64_t pos0, int64_t n_tokens) override;
  Status OnChunk(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                 const float* v) override;

  // The collected trace (valid after the prefill; tokens as set).
  Trace& trace() { return trace_; }

 private:
  TraceSinkOptions options_;
  Trace trace_;
  int64_t pos0_ = 0, n_ = 0, q_first_ = 0;
};

}  // namespace ctxcache::model
