// Selector registry and the shared pieces of selector.h.
#include "index/selector.h"

#include <cstring>
#include <string>

#include "index/csa.h"
#include "index/lfps.h"
#include "index/oracle.h"
#include "index/quest.h"
#include "index/streaming.h"
#include "index/tactic.h"

namespace ctxcache::index {
namespace {

using BuildFn = StatusOr<std::unique_ptr<Selector>> (*)(const HeadPrefill&, const MethodParams&);
using LoadFn = StatusOr<std::unique_ptr<Selector>> (*)(std::string_view);

struct MethodEntry {
  const char* name;
  BuildFn build;
  LoadFn load;
};

// One line per method (DESIGN §5). Keep in sync with selector.h's list.
constexpr MethodEntry kMethods[] = {
    {"full", &BuildFullSelector, &LoadFullSelector},
    {"oracle", &BuildOracleSelector, &LoadOracleSelector},
    {"csa", &BuildCsaSelector, &LoadCsaSelector},
    {"tactic", &BuildTacticSelector, &LoadTacticSelector},
    {"lfps", &BuildLfpsSelector, &LoadLfpsSelector},
    {"quest", &BuildQuestSelector, &LoadQuestSelector},
    {"streaming", &BuildStreamingSelector, &LoadStreamingSelector},
};

const MethodEntry* FindMethod(std::string_view name) {
  for (const MethodEntry& e : kMethods) {
    if (name == e.name) return &e;
  }
  return nullptr;
}

Status UnknownMethod(std::string_view name) {
  std::string known;
  for (const MethodEntry& e : kMethods) known += (known.empty() ? "" : ", ") + std::string(e.name);
  return InvalidArgumentError("unknown selector method '" + std::string(name) +
                              "', expected one of: " + known);
}

}  // namespace

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
  const MethodEntry* e = FindMethod(method);
  if (e == nullptr) return UnknownMethod(method);
  return e->build(prefill, params);
}

StatusOr<std::unique_ptr<Selector>> LoadSelector(std::string_view method, std::string_view bytes) {
  const MethodEntry* e = FindMethod(method);
  if (e == nullptr) return UnknownMethod(method);
  return e->load(bytes);
}

std::vector<std::string> SelectorMethods() {
  std::vector<std::string> names;
  for (const MethodEntry& e : kMethods) names.emplace_back(e.name);
  return names;
}

}  // namespace ctxcache::index
