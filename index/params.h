// Typed access to MethodParams (selector.h) and shared input validation for
// Selector implementations.
//
// ParamReader: each method pulls its keys with Int/Double/Bool/String, then
// calls Finish(), which rejects keys nobody asked for. Every error is
// InvalidArgument naming the method, key and expected value.
// Thread-safety: plain values; not for concurrent use.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "common/status.h"
#include "index/selector.h"

namespace ctxcache::index {

class ParamReader {
 public:
  ParamReader(std::string_view method, const MethodParams& params)
      : method_(method), params_(params) {}

  // Value of `key` in [lo, hi], or `def` when absent.
  StatusOr<int64_t> Int(const std::string& key, int64_t def, int64_t lo, int64_t hi);
  // Value of `key` in [lo, hi] (both inclusive), or `def` when absent.
  StatusOr<double> Double(const std::string& key, double def, double lo, double hi);
  // Value of `key` in (0, 1] (keep ratios), or `def` when absent.
  StatusOr<double> Ratio(const std::string& key, double def);
  // "1/0/true/false", or `def`.
  StatusOr<bool> Bool(const std::string& key, bool def);
  // One of `allowed`, or `def`.
  StatusOr<std::string> Enum(const std::string& key, const std::string& def,
                             std::initializer_list<std::string_view> allowed);
  bool Has(const std::string& key) const { return params_.count(key) > 0; }

  // InvalidArgument if a key was never read.
  Status Finish() const;

 private:
  Status Bad(const std::string& key, std::string_view expected) const;

  std::string method_;
  const MethodParams& params_;
  std::set<std::string> seen_;
};

// Checks the shape, pointers and finiteness of prefill data. `need_queries`,
// `need_values` and `need_keys` say which arrays the method uses (an array
// it does not use may be null).
Status ValidatePrefill(std::string_view method, const HeadPrefill& prefill, bool need_queries,
                       bool need_values, bool need_keys = true);

// Checks a SelectInput against a selector of head_dim `d` (queries present,
// n_queries >= 1, budget >= 0, finite), and that a KeySource, when
// `need_keys`, covers `n_tokens` tokens of dimension d.
Status ValidateSelectInput(std::string_view method, const SelectInput& in, int d, int64_t n_tokens,
                           bool need_keys);

}  // namespace ctxcache::index
