// The method registry (index/methods.h) and the shared pieces of selector.h.
#include "index/selector.h"

#include <algorithm>

#include <cstring>
#include <string>

#include "index/csa.h"
#include "index/lfps.h"
#include "index/methods.h"
#include "index/oracle.h"
#include "index/quest.h"
#include "index/streaming.h"
#include "index/tactic.h"

namespace ctxcache::index {
namespace {

StatusOr<MethodParams> ResolveAsRequested(const MethodParams& requested, int64_t, int64_t, int) {
  return requested;
}

// CSA: every option spelled out (so the manifest records what was built),
// with C clamped to the keys and query rows when not requested, and m = 0
// resolved for head_dim (CsaSubspaces) when it is known.
StatusOr<MethodParams> ResolveCsa(const MethodParams& requested, int64_t n_keys,
                                  int64_t n_query_rows, int head_dim) {
  ASSIGN_OR_RETURN(CsaOptions o, ParseCsaOptions(requested));
  if (head_dim > 0) o.m = CsaSubspaces(o.m, head_dim);
  if (requested.find("C") == requested.end()) {
    o.C = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>({o.C, n_keys, n_query_rows})));
  }
  return CsaOptionsToParams(o);
}

constexpr std::string_view kCsaContextDependent[] = {"C"};

// One entry per method (DESIGN §5). Kind bytes are on disk: never reuse or
// renumber one (docs/storage-format.md).
const MethodInfo kMethods[] = {
    {"csa", 1, false, false, &BuildCsaSelector, &LoadCsaSelector, &ResolveCsa,
     kCsaContextDependent},
    {"tactic", 2, false, false, &BuildTacticSelector, &LoadTacticSelector, &ResolveAsRequested,
     {}},
    {"lfps", 3, false, false, &BuildLfpsSelector, &LoadLfpsSelector, &ResolveAsRequested, {},
     /*reads_keys=*/true, /*reads_values=*/true},
    {"quest", 4, false, false, &BuildQuestSelector, &LoadQuestSelector, &ResolveAsRequested, {}},
    {"full", 5, true, true, &BuildFullSelector, &LoadFullSelector, &ResolveAsRequested, {},
     /*reads_keys=*/false},
    {"oracle", 6, true, false, &BuildOracleSelector, &LoadOracleSelector, &ResolveAsRequested,
     {}, /*reads_keys=*/false},
    {"streaming", 7, true, true, &BuildStreamingSelector, &LoadStreamingSelector,
     &ResolveAsRequested, {}, /*reads_keys=*/false},
};

}  // namespace

std::span<const MethodInfo> Methods() { return kMethods; }

std::string MethodNamesForMessages() {
  std::string known;
  for (const MethodInfo& e : kMethods) {
    known += (known.empty() ? "" : ", ") + std::string(e.name);
  }
  return known;
}

StatusOr<const MethodInfo*> FindMethodInfo(std::string_view name) {
  for (const MethodInfo& e : kMethods) {
    if (name == e.name) return &e;
  }
  return InvalidArgumentError("unknown method '" + std::string(name) +
                              "', expected one of: " + MethodNamesForMessages());
}

MethodParams ParamsForExtend(const MethodInfo& method, const MethodParams& parent_resolved) {
  MethodParams p = parent_resolved;
  for (std::string_view key : method.context_dependent_params) p.erase(std::string(key));
  return p;
}

Status ArrayKeySource::GatherKeys(const int32_t* ids, int64_t n, float* out) const {
  if (n < 0 || (n > 0 && (ids == nullptr || out == nullptr))) {
    return InvalidArgumentError("GatherKeys: null ids/out or negative n");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= n_) {
      return InvalidArgumentError("GatherKeys: id " + std::to_string(ids[i]) +
                                  " out of range [0, " + std::to_string(n_) + ")");
    }
    std::memcpy(out + i * d_, keys_ + static_cast<int64_t>(ids[i]) * d_, sizeof(float) * d_);
  }
  return Status::OK();
}

Status Selector::ApplySessionOverrides(const MethodParams& overrides) {
  if (overrides.empty()) return Status::OK();
  return InvalidArgumentError("method " + std::string(method()) +
                              " takes no per-session index param; got '" +
                              overrides.begin()->first + "'");
}

StatusOr<MethodParams> ParseParams(std::string_view text) {
  MethodParams params;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(pos, end - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty()) {
      const size_t eq = item.find('=');
      if (eq == std::string_view::npos || eq == 0) {
        return InvalidArgumentError("method params: '" + std::string(item) +
                                    "' is not key=value (expected e.g. \"m=8,C=128\")");
      }
      std::string key(item.substr(0, eq));
      if (params.count(key)) {
        return InvalidArgumentError("method params: duplicate key '" + key + "'");
      }
      params[key] = std::string(item.substr(eq + 1));
    }
    pos = end + 1;
  }
  return params;
}

StatusOr<std::unique_ptr<Selector>> BuildSelector(std::string_view method,
                                                  const HeadPrefill& prefill,
                                                  const MethodParams& params) {
  ASSIGN_OR_RETURN(const MethodInfo* e, FindMethodInfo(method));
  return e->build(prefill, params);
}

StatusOr<std::unique_ptr<Selector>> LoadSelector(std::string_view method, std::string_view bytes) {
  ASSIGN_OR_RETURN(const MethodInfo* e, FindMethodInfo(method));
  return e->load(bytes);
}

std::vector<std::string> SelectorMethods() {
  std::vector<std::string> names;
  for (const MethodInfo& e : kMethods) names.emplace_back(e.name);
  return names;
}

}  // namespace ctxcache::index
