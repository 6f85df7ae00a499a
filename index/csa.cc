// CsaOptions (parse, check, to params), the subspace rule and the registry
// hooks. The selector itself: csa_build.cc, csa_search.cc, csa_format.cc.
#include "index/csa.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "common/dtype.h"
#include "common/thread_pool.h"
#include "index/byte_io.h"
#include "index/csa_internal.h"
#include "index/metrics.h"
#include "index/oracle.h"
#include "index/params.h"

namespace ctxcache::index {

namespace csa_internal {

Status CheckOptions(const CsaOptions& o) {
  auto bad = [](const std::string& field, const std::string& msg) {
    return InvalidArgumentError("csa: " + field + " " + msg);
  };
  if (o.m < 0) return bad("m=" + std::to_string(o.m), "expected >= 0 (0 = by head_dim)");
  if (o.C < 1) return bad("C=" + std::to_string(o.C), "expected >= 1");
  if (!(o.alpha > 0 && o.alpha <= 1))
    return bad("alpha=" + std::to_string(o.alpha), "expected in (0, 1]");
  if (o.fixed_L < 0) return bad("L=" + std::to_string(o.fixed_L), "expected >= 0");
  if (o.kmeans_iters < 1) return bad("iters=" + std::to_string(o.kmeans_iters), "expected >= 1");
  if (!(o.rho > 0 && o.rho <= 1)) return bad("rho=" + std::to_string(o.rho), "expected in (0, 1]");
  if (o.recent < 0) return bad("R=" + std::to_string(o.recent), "expected >= 0");
  if (o.sinks < 0) return bad("sinks=" + std::to_string(o.sinks), "expected >= 0");
  if (o.tau < 1 || o.tau > o.C) {
    return bad("tau=" + std::to_string(o.tau), "expected in [1, C=" + std::to_string(o.C) + "]");
  }
  if (!(o.backoff_cos >= -1 && o.backoff_cos <= 1)) {
    return bad("backoff_cos=" + std::to_string(o.backoff_cos), "expected in [-1, 1]");
  }
  if (o.period < 1) return bad("period=" + std::to_string(o.period), "expected >= 1");
  if (!IsValidCsaRerank(o.rerank)) {
    return bad("rerank=" + std::to_string(o.rerank), "expected 0 or in [1, 64]");
  }
  return Status::OK();
}

}  // namespace csa_internal

bool IsValidCsaRerank(double rerank) { return rerank == 0 || (rerank >= 1 && rerank <= 64); }

StatusOr<CsaOptions> ParseCsaOptions(const MethodParams& params) {
  CsaOptions o;
  ParamReader pr("csa", params);
  ASSIGN_OR_RETURN(int64_t m, pr.Int("m", o.m, 0, 4096));
  ASSIGN_OR_RETURN(int64_t C, pr.Int("C", o.C, 1, 1 << 20));
  ASSIGN_OR_RETURN(o.alpha, pr.Ratio("alpha", o.alpha));
  ASSIGN_OR_RETURN(o.fixed_L, pr.Int("L", o.fixed_L, 0, INT32_MAX));
  ASSIGN_OR_RETURN(o.query_cap, pr.Int("query_cap", o.query_cap, 1, INT64_MAX));
  ASSIGN_OR_RETURN(int64_t iters, pr.Int("iters", o.kmeans_iters, 1, 1000));
  ASSIGN_OR_RETURN(int64_t seed, pr.Int("seed", static_cast<int64_t>(o.seed), 0, INT64_MAX));
  ASSIGN_OR_RETURN(o.center_keys, pr.Bool("center", o.center_keys));
  ASSIGN_OR_RETURN(o.rho, pr.Ratio("rho", o.rho));
  ASSIGN_OR_RETURN(int64_t R, pr.Int("R", o.recent, 0, INT32_MAX));
  ASSIGN_OR_RETURN(int64_t sinks, pr.Int("sinks", o.sinks, 0, INT32_MAX));
  ASSIGN_OR_RETURN(int64_t tau, pr.Int("tau", o.tau, 1, 1 << 20));
  ASSIGN_OR_RETURN(o.backoff_cos, pr.Double("backoff_cos", o.backoff_cos, -1.0, 1.0));
  ASSIGN_OR_RETURN(std::string weights, pr.Enum("weights",
                                                o.proj_weights   ? "proj"
                                                : o.norm_weights ? "norm"
                                                                 : "uniform",
                                                {"uniform", "norm", "proj"}));
  ASSIGN_OR_RETURN(std::string missing, pr.Enum("missing", "zero", {"zero", "min", "mean"}));
  o.impute_min = missing == "min";
  o.impute_tail_mean = missing == "mean";
  ASSIGN_OR_RETURN(int64_t period, pr.Int("period", o.period, 1, 1 << 20));
  ASSIGN_OR_RETURN(o.rerank, pr.Double("rerank", o.rerank, 0.0, 64.0));
  ASSIGN_OR_RETURN(std::string format,
                   pr.Enum("format", o.compact ? "compact" : "plain", {"plain", "compact"}));
  if (pr.Has("schedule")) {
    ASSIGN_OR_RETURN(std::string schedule,
                     pr.Enum("schedule", "", {"0.05/1", "0.15/4", "0.20/8", "0.2/8"}));
    const size_t slash = schedule.find('/');
    o.rho = std::stod(schedule.substr(0, slash));
    period = std::stoi(schedule.substr(slash + 1));
  }
  RETURN_IF_ERROR(pr.Finish());
  o.m = static_cast<int>(m);
  o.C = static_cast<int>(C);
  o.kmeans_iters = static_cast<int>(iters);
  o.seed = static_cast<uint64_t>(seed);
  o.recent = static_cast<int>(R);
  o.sinks = static_cast<int>(sinks);
  o.tau = static_cast<int>(tau);
  o.norm_weights = weights == "norm";
  o.proj_weights = weights == "proj";
  o.period = static_cast<int>(period);
  o.compact = format == "compact";
  return o;
}

int CsaSubspaces(int m, int head_dim) {
  if (m > 0) return m;
  int best = 1;
  for (int s = 1; s <= std::min(16, head_dim / 4); ++s) {
    if (head_dim % s == 0) best = s;
  }
  return best;
}

MethodParams CsaOptionsToParams(const CsaOptions& o) {
  auto num = [](double v) {
    char buf[32];
    auto r = std::to_chars(buf, buf + sizeof(buf), v);
    return std::string(buf, r.ptr);
  };
  MethodParams p;
  p["m"] = std::to_string(o.m);
  p["C"] = std::to_string(o.C);
  p["alpha"] = num(o.alpha);
  p["L"] = std::to_string(o.fixed_L);
  p["query_cap"] = std::to_string(o.query_cap);
  p["iters"] = std::to_string(o.kmeans_iters);
  p["seed"] = std::to_string(o.seed);
  p["center"] = o.center_keys ? "true" : "false";
  p["rho"] = num(o.rho);
  p["R"] = std::to_string(o.recent);
  p["sinks"] = std::to_string(o.sinks);
  p["tau"] = std::to_string(o.tau);
  p["backoff_cos"] = num(o.backoff_cos);
  p["weights"] = o.proj_weights ? "proj" : o.norm_weights ? "norm" : "uniform";
  p["missing"] = o.impute_tail_mean ? "mean" : o.impute_min ? "min" : "zero";
  p["period"] = std::to_string(o.period);
  p["format"] = o.compact ? "compact" : "plain";
  p["rerank"] = num(o.rerank);
  return p;
}

StatusOr<std::unique_ptr<Selector>> BuildCsaSelector(const HeadPrefill& prefill,
                                                     const MethodParams& params) {
  ASSIGN_OR_RETURN(CsaOptions o, ParseCsaOptions(params));
  ASSIGN_OR_RETURN(std::unique_ptr<CsaSelector> s, CsaSelector::Build(prefill, o));
  return std::unique_ptr<Selector>(std::move(s));
}

StatusOr<std::unique_ptr<Selector>> LoadCsaSelector(std::string_view bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<CsaSelector> s, CsaSelector::Load(bytes));
  return std::unique_ptr<Selector>(std::move(s));
}

}  // namespace ctxcache::index
