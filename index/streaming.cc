#include "index/streaming.h"

#include <algorithm>
#include <cmath>

#include "index/byte_io.h"
#include "index/params.h"

namespace ctxcache::index {

StatusOr<StreamingOptions> ParseStreamingParams(const MethodParams& params) {
  ParamReader r("streaming", params);
  StreamingOptions o;
  ASSIGN_OR_RETURN(int64_t sink, r.Int("sink", o.n_sink, 0, 1 << 20));
  o.n_sink = static_cast<int>(sink);
  ASSIGN_OR_RETURN(o.rho, r.Double("rho", o.rho, 1e-9, 1.0));
  RETURN_IF_ERROR(r.Finish());
  return o;
}

StatusOr<std::unique_ptr<StreamingSelector>> StreamingSelector::Create(
    int64_t n_tokens, int head_dim, const StreamingOptions& options) {
  if (n_tokens < 0) return InvalidArgumentError("streaming: n_tokens must be >= 0");
  if (head_dim <= 0) return InvalidArgumentError("streaming: head_dim must be > 0");
  if (options.n_sink < 0) return InvalidArgumentError("streaming: n_sink must be >= 0");
  if (!(options.rho > 0 && options.rho <= 1)) {
    return InvalidArgumentError("streaming: rho must be in (0, 1]");
  }
  return std::unique_ptr<StreamingSelector>(new StreamingSelector(n_tokens, head_dim, options));
}

Status StreamingSelector::Select(const SelectInput& in, Selection* out, WorkStats* stats) {
  if (out == nullptr) return InvalidArgumentError("streaming: out must not be null");
  RETURN_IF_ERROR(ValidateSelectInput("streaming", in, head_dim_, n_tokens_, /*need_keys=*/false));
  const int64_t n = n_tokens_;
  int64_t budget = in.budget > 0 ? in.budget : static_cast<int64_t>(std::ceil(options_.rho * n));
  budget = std::min(budget, n);
  const int64_t n_sink = std::min<int64_t>(options_.n_sink, budget);
  const int64_t n_recent = budget - n_sink;
  std::vector<int32_t> ids;
  ids.reserve(budget);
  for (int64_t i = 0; i < n_sink; ++i) ids.push_back(static_cast<int32_t>(i));
  for (int64_t i = std::max(n_sink, n - n_recent); i < n; ++i)
    ids.push_back(static_cast<int32_t>(i));
  out->per_head.assign(in.n_queries, ids);
  out->merged = std::move(ids);
  out->estimated_mass = -1.0;
  if (stats != nullptr) *stats = WorkStats{};
  return Status::OK();
}

Status StreamingSelector::Append(const float*, const float*, const float*) {
  if (n_tokens_ >= INT32_MAX) return OutOfRangeError("streaming: too many tokens");
  ++n_tokens_;
  return Status::OK();
}

Status StreamingSelector::Serialize(std::string* out) const {
  out->clear();
  ByteWriter w(out);
  w.PutHeader("STR1", kFormatVersion);
  w.Put<int64_t>(n_tokens_);
  w.Put<int32_t>(head_dim_);
  w.Put<int32_t>(options_.n_sink);
  w.Put<double>(options_.rho);
  return Status::OK();
}

StatusOr<std::unique_ptr<StreamingSelector>> StreamingSelector::Load(std::string_view bytes) {
  ByteReader r(bytes);
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader("STR1", kFormatVersion, &version, "streaming"));
  int64_t n = 0;
  int32_t d = 0, sink = 0;
  StreamingOptions o;
  if (!r.Get(&n) || !r.Get(&d) || !r.Get(&sink) || !r.Get(&o.rho) || r.remaining() != 0) {
    return DataLossError("streaming: truncated or oversized artifact");
  }
  o.n_sink = sink;
  return Create(n, d, o);
}

std::unique_ptr<Selector> StreamingSelector::Clone() const {
  return std::unique_ptr<Selector>(new StreamingSelector(*this));
}

StatusOr<std::unique_ptr<Selector>> BuildStreamingSelector(const HeadPrefill& prefill,
                                                           const MethodParams& params) {
  ASSIGN_OR_RETURN(StreamingOptions o, ParseStreamingParams(params));
  RETURN_IF_ERROR(ValidatePrefill("streaming", prefill, /*need_queries=*/false,
                                  /*need_values=*/false, /*need_keys=*/false));
  ASSIGN_OR_RETURN(auto sel, StreamingSelector::Create(prefill.n_tokens, prefill.head_dim, o));
  return std::unique_ptr<Selector>(std::move(sel));
}

StatusOr<std::unique_ptr<Selector>> LoadStreamingSelector(std::string_view bytes) {
  ASSIGN_OR_RETURN(auto sel, StreamingSelector::Load(bytes));
  return std::unique_ptr<Selector>(std::move(sel));
}

}  // namespace ctxcache::index
