// The method registry: every fact about an index method lives here, and
// nowhere else (DESIGN §5). One entry per method holds its name, the kind
// byte that names its artifact in the store's key schema
// (docs/storage-format.md), whether every context builds it, whether its
// selections depend on the queries, and its build / load / param-resolution
// functions. The service, the SDK and the benches ask this registry instead
// of listing methods themselves.
//
// Thread-safety: immutable after static initialization; safe for concurrent
// use.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "index/selector.h"

namespace ctxcache::index {

struct MethodInfo {
  using BuildFn = StatusOr<std::unique_ptr<Selector>> (*)(const HeadPrefill&, const MethodParams&);
  using LoadFn = StatusOr<std::unique_ptr<Selector>> (*)(std::string_view);
  // The parameters a build over n_keys keys with n_query_rows pooled query
  // rows (all q heads of the group) of a model with head_dim actually uses,
  // from the requested ones: defaults that depend on the context or the
  // model filled in (csa's C and m; head_dim 0 = unknown, m left as
  // requested). InvalidArgument for bad requested params.
  using ResolveFn = StatusOr<MethodParams> (*)(const MethodParams& requested, int64_t n_keys,
                                              int64_t n_query_rows, int head_dim);

  std::string_view name;
  // Kind byte of the method's artifact in the `index` column family key.
  uint8_t artifact_kind = 0;
  // Built for every context (reference methods with a tiny artifact), so a
  // session can open it on any context.
  bool always_built = false;
  // Selections do not depend on the queries: a client can fetch layer l+1's
  // pages while layer l runs.
  bool query_independent = false;
  BuildFn build = nullptr;
  LoadFn load = nullptr;
  ResolveFn resolve = nullptr;
  // Resolved params derived from the context's size; dropped when an
  // extended context re-resolves its parent's params.
  std::span<const std::string_view> context_dependent_params;
  // The build reads HeadPrefill::keys (false: keys may be null, only the
  // shape is used). A builder converts the stored keys to fp32 for a
  // context's build only when some method reads them. Default: true.
  bool reads_keys = true;
  // The build reads HeadPrefill::values when they are given (null is
  // accepted either way). Default: false.
  bool reads_values = false;
};

// The method a context is built with and a session opens when none is named.
inline constexpr std::string_view kDefaultMethod = "csa";

// Every registered method, in a fixed order.
std::span<const MethodInfo> Methods();

// The entry of `name`; InvalidArgument naming the known methods otherwise.
StatusOr<const MethodInfo*> FindMethodInfo(std::string_view name);

// "full, oracle, csa, ..." for messages.
std::string MethodNamesForMessages();

// Requested params of an extended context from its parent's resolved ones:
// drops the method's context_dependent_params.
MethodParams ParamsForExtend(const MethodInfo& method, const MethodParams& parent_resolved);

}  // namespace ctxcache::index
