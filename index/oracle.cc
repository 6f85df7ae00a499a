#include "index/oracle.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "index/byte_io.h"
#include "index/metrics.h"
#include "index/params.h"
#include "index/topk.h"

namespace ctxcache::index {

int64_t BudgetFor(int64_t budget, double rho, int64_t n) {
  int64_t k = budget > 0 ? budget : static_cast<int64_t>(std::ceil(rho * static_cast<double>(n)));
  return std::clamp<int64_t>(k, 1, std::max<int64_t>(1, n));
}

Status ScoreAllKeys(const KeySource& keys, const float* q, int64_t n, float* out,
                    std::vector<float>* scratch) {
  const int d = keys.head_dim();
  if (const auto* array = dynamic_cast<const ArrayKeySource*>(&keys)) {
    ScoreKeys(q, array->data(), n, d, out);
    return Status::OK();
  }
  constexpr int64_t kChunk = 4096;
  std::vector<int32_t> ids(kChunk);
  scratch->resize(static_cast<size_t>(kChunk) * d);
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    std::iota(ids.begin(), ids.begin() + len, static_cast<int32_t>(start));
    RETURN_IF_ERROR(keys.GatherKeys(ids.data(), len, scratch->data()));
    ScoreKeys(q, scratch->data(), len, d, out + start);
  }
  return Status::OK();
}

namespace {

constexpr uint32_t kVersion = 1;

void MergeHeads(Selection* out) {
  out->merged.clear();
  for (const auto& h : out->per_head) out->merged = UnionSorted(out->merged, h);
}

class FullSelector final : public Selector {
 public:
  FullSelector(int64_t n, int d) : n_(n), d_(d) {}
  std::string_view method() const override { return "full"; }
  int64_t n_tokens() const override { return n_; }
  int head_dim() const override { return d_; }

  Status Select(const SelectInput& in, Selection* out, WorkStats* stats) override {
    RETURN_IF_ERROR(ValidateSelectInput("full", in, d_, n_, /*need_keys=*/false));
    std::vector<int32_t> all(n_);
    std::iota(all.begin(), all.end(), 0);
    out->per_head.assign(in.n_queries, all);
    out->merged = std::move(all);
    out->estimated_mass = 1.0;
    if (stats) *stats = WorkStats{};
    return Status::OK();
  }
  Status Append(const float* key, const float*, const float*) override {
    if (key == nullptr) return InvalidArgumentError("full: Append key is null");
    ++n_;
    return Status::OK();
  }
  Status Serialize(std::string* out) const override {
    out->clear();
    ByteWriter w(out);
    w.PutHeader("FULL", kVersion);
    w.Put<int64_t>(n_);
    w.Put<int32_t>(d_);
    return Status::OK();
  }
  std::unique_ptr<Selector> Clone() const override { return std::make_unique<FullSelector>(*this); }
  uint64_t MemoryBytes() const override { return sizeof(*this); }

 private:
  int64_t n_;
  int d_;
};

class OracleSelector final : public Selector {
 public:
  OracleSelector(int64_t n, int d, double rho) : n_(n), d_(d), rho_(rho) {}
  std::string_view method() const override { return "oracle"; }
  int64_t n_tokens() const override { return n_; }
  int head_dim() const override { return d_; }

  Status Select(const SelectInput& in, Selection* out, WorkStats* stats) override {
    RETURN_IF_ERROR(ValidateSelectInput("oracle", in, d_, n_, /*need_keys=*/true));
    const int64_t k = BudgetFor(in.budget, rho_, n_);
    scores_.resize(n_);
    out->per_head.resize(in.n_queries);
    out->per_head_logits.resize(in.n_queries);
    out->per_head_log_normalizer.resize(in.want_log_normalizer ? in.n_queries : 0);
    for (int h = 0; h < in.n_queries; ++h) {
      RETURN_IF_ERROR(ScoreAllKeys(*in.keys, in.queries + static_cast<int64_t>(h) * d_, n_,
                                   scores_.data(), &gather_));
      SelectTopK(scores_.data(), n_, k, TopKOrder::kById, &out->per_head[h], &topk_);
      const float inv = 1.0f / std::sqrt(static_cast<float>(d_));
      auto& lg = out->per_head_logits[h];
      lg.clear();
      for (int32_t id : out->per_head[h]) lg.push_back(scores_[id] * inv);
      if (in.want_log_normalizer) {
        out->per_head_log_normalizer[h] = LogSumExp(scores_.data(), n_, inv);
      }
    }
    MergeHeads(out);
    out->estimated_mass = -1.0;
    if (stats) {
      *stats = WorkStats{};
      stats->keys_scored = static_cast<uint64_t>(n_) * in.n_queries;
      stats->bytes_touched = static_cast<uint64_t>(n_) * d_ * sizeof(float) * in.n_queries;
    }
    return Status::OK();
  }
  Status Append(const float* key, const float*, const float*) override {
    if (key == nullptr) return InvalidArgumentError("oracle: Append key is null");
    ++n_;
    return Status::OK();
  }
  Status Serialize(std::string* out) const override {
    out->clear();
    ByteWriter w(out);
    w.PutHeader("ORCL", kVersion);
    w.Put<int64_t>(n_);
    w.Put<int32_t>(d_);
    w.Put<double>(rho_);
    return Status::OK();
  }
  std::unique_ptr<Selector> Clone() const override {
    return std::make_unique<OracleSelector>(n_, d_, rho_);
  }
  uint64_t MemoryBytes() const override { return sizeof(*this); }

 private:
  int64_t n_;
  int d_;
  double rho_;
  std::vector<float> scores_;  // scratch
  std::vector<float> gather_;  // scratch
  TopKScratch topk_;
};

Status ReadNd(ByteReader* r, std::string_view what, int64_t* n, int32_t* d) {
  if (!r->Get(n) || !r->Get(d)) return DataLossError(std::string(what) + ": truncated artifact");
  if (*n < 1 || *n > INT32_MAX || *d < 1 || *d > 4096) {
    return DataLossError(std::string(what) + ": corrupt n_tokens/head_dim");
  }
  return Status::OK();
}

}  // namespace

StatusOr<std::unique_ptr<Selector>> BuildFullSelector(const HeadPrefill& prefill,
                                                      const MethodParams& params) {
  ParamReader pr("full", params);
  RETURN_IF_ERROR(pr.Finish());
  RETURN_IF_ERROR(ValidatePrefill("full", prefill, false, false, /*need_keys=*/false));
  return std::unique_ptr<Selector>(new FullSelector(prefill.n_tokens, prefill.head_dim));
}

StatusOr<std::unique_ptr<Selector>> LoadFullSelector(std::string_view bytes) {
  ByteReader r(bytes);
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader("FULL", kVersion, &version, "full"));
  int64_t n = 0;
  int32_t d = 0;
  RETURN_IF_ERROR(ReadNd(&r, "full", &n, &d));
  return std::unique_ptr<Selector>(new FullSelector(n, d));
}

StatusOr<std::unique_ptr<Selector>> BuildOracleSelector(const HeadPrefill& prefill,
                                                        const MethodParams& params) {
  ParamReader pr("oracle", params);
  ASSIGN_OR_RETURN(double rho, pr.Ratio("rho", 0.05));
  RETURN_IF_ERROR(pr.Finish());
  RETURN_IF_ERROR(ValidatePrefill("oracle", prefill, false, false, /*need_keys=*/false));
  return std::unique_ptr<Selector>(new OracleSelector(prefill.n_tokens, prefill.head_dim, rho));
}

StatusOr<std::unique_ptr<Selector>> LoadOracleSelector(std::string_view bytes) {
  ByteReader r(bytes);
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader("ORCL", kVersion, &version, "oracle"));
  int64_t n = 0;
  int32_t d = 0;
  RETURN_IF_ERROR(ReadNd(&r, "oracle", &n, &d));
  double rho = 0;
  if (!r.Get(&rho) || !(rho > 0 && rho <= 1)) return DataLossError("oracle: corrupt rho");
  return std::unique_ptr<Selector>(new OracleSelector(n, d, rho));
}

}  // namespace ctxcache::index
