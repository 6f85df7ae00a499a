// StreamingLLM baseline (DESIGN §5.5): the first `n_sink` tokens (attention
// sinks) plus the most recent tokens, up to the budget. It reads no keys and
// keeps no per-token tables; all q heads get the same selection.
//
// Params (MethodParams keys): "sink" (int >= 0, default 4), "rho" (budget
// fraction in (0, 1], default 0.05, used when SelectInput::budget is 0).
// Unknown keys -> InvalidArgument.
//
// Thread-safety: as Selector (selector.h); Select() does not mutate.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "index/selector.h"

namespace ctxcache::index {

struct StreamingOptions {
  // Attention-sink tokens always selected. Default: 4.
  int n_sink = 4;
  // Default budget as a fraction of N when SelectInput::budget == 0. Default: 0.05.
  double rho = 0.05;
};

class StreamingSelector final : public Selector {
 public:
  static constexpr uint32_t kFormatVersion = 1;

  // InvalidArgument on n_tokens < 0, head_dim <= 0 or bad options.
  static StatusOr<std::unique_ptr<StreamingSelector>> Create(int64_t n_tokens, int head_dim,
                                                             const StreamingOptions& options);
  static StatusOr<std::unique_ptr<StreamingSelector>> Load(std::string_view bytes);

  std::string_view method() const override { return "streaming"; }
  int64_t n_tokens() const override { return n_tokens_; }
  int head_dim() const override { return head_dim_; }
  Status Select(const SelectInput& in, Selection* out, WorkStats* stats) override;
  Status Append(const float* key, const float* value, const float* queries) override;
  Status Serialize(std::string* out) const override;
  std::unique_ptr<Selector> Clone() const override;
  uint64_t MemoryBytes() const override { return sizeof(*this); }

  const StreamingOptions& options() const { return options_; }

 private:
  StreamingSelector(int64_t n_tokens, int head_dim, const StreamingOptions& options)
      : n_tokens_(n_tokens), head_dim_(head_dim), options_(options) {}

  int64_t n_tokens_;
  int head_dim_;
  StreamingOptions options_;
};

// Parses "sink", "rho"; InvalidArgument naming the key on bad values.
StatusOr<StreamingOptions> ParseStreamingParams(const MethodParams& params);

// Registry entry points (index/selector.cc).
StatusOr<std::unique_ptr<Selector>> BuildStreamingSelector(const HeadPrefill& prefill,
                                                           const MethodParams& params);
StatusOr<std::unique_ptr<Selector>> LoadStreamingSelector(std::string_view bytes);

}  // namespace ctxcache::index
