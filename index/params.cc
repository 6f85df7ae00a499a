#include "index/params.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "common/dtype.h"

namespace ctxcache::index {

Status ParamReader::Bad(const std::string& key, std::string_view expected) const {
  return InvalidArgumentError(method_ + ": parameter '" + key + "'='" + params_.at(key) +
                              "', expected " + std::string(expected));
}

StatusOr<int64_t> ParamReader::Int(const std::string& key, int64_t def, int64_t lo, int64_t hi) {
  seen_.insert(key);
  auto it = params_.find(key);
  if (it == params_.end()) return def;
  const std::string& s = it->second;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  const std::string range =
      "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi) return Bad(key, range);
  return v;
}

StatusOr<double> ParamReader::Double(const std::string& key, double def, double lo, double hi) {
  seen_.insert(key);
  auto it = params_.find(key);
  if (it == params_.end()) return def;
  const std::string& s = it->second;
  char* end = nullptr;
  const double v = s.empty() ? NAN : std::strtod(s.c_str(), &end);
  const std::string range = "a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v < lo || v > hi) {
    return Bad(key, range);
  }
  return v;
}

StatusOr<double> ParamReader::Ratio(const std::string& key, double def) {
  ASSIGN_OR_RETURN(double v, Double(key, def, 0.0, 1.0));
  if (v <= 0.0) return Bad(key, "a number in (0, 1]");
  return v;
}

StatusOr<bool> ParamReader::Bool(const std::string& key, bool def) {
  seen_.insert(key);
  auto it = params_.find(key);
  if (it == params_.end()) return def;
  if (it->second == "1" || it->second == "true") return true;
  if (it->second == "0" || it->second == "false") return false;
  return Bad(key, "one of 1, 0, true, false");
}

StatusOr<std::string> ParamReader::Enum(const std::string& key, const std::string& def,
                                        std::initializer_list<std::string_view> allowed) {
  seen_.insert(key);
  auto it = params_.find(key);
  if (it == params_.end()) return def;
  std::string list;
  for (std::string_view a : allowed) {
    if (it->second == a) return it->second;
    if (!list.empty()) list += ", ";
    list += a;
  }
  return Bad(key, "one of " + list);
}

Status ParamReader::Finish() const {
  for (const auto& [key, value] : params_) {
    if (seen_.count(key) == 0) {
      std::string known;
      for (const auto& k : seen_) known += (known.empty() ? "" : ", ") + k;
      return InvalidArgumentError(method_ + ": unknown parameter '" + key + "' (known: " + known +
                                  ")");
    }
  }
  return Status::OK();
}

Status ValidatePrefill(std::string_view method, const HeadPrefill& p, bool need_queries,
                       bool need_values, bool need_keys) {
  const std::string m(method);
  if (p.n_tokens < 1 || p.n_tokens > INT32_MAX) {
    return InvalidArgumentError(m + ": prefill.n_tokens=" + std::to_string(p.n_tokens) +
                                ", expected 1..2^31-1");
  }
  if (p.head_dim < 1 || p.head_dim > 4096) {
    return InvalidArgumentError(m + ": prefill.head_dim=" + std::to_string(p.head_dim) +
                                ", expected 1..4096");
  }
  const size_t nk = static_cast<size_t>(p.n_tokens) * p.head_dim;
  if (need_keys) {
    if (p.keys == nullptr) return InvalidArgumentError(m + ": prefill.keys is null");
    if (HasNonFinite(p.keys, nk)) return InvalidArgumentError(m + ": prefill.keys has NaN/Inf");
  }
  if (need_values) {
    if (p.values == nullptr) return InvalidArgumentError(m + ": prefill.values is null");
    if (HasNonFinite(p.values, nk)) {
      return InvalidArgumentError(m + ": prefill.values has NaN/Inf");
    }
  }
  if (need_queries) {
    if (p.group_size < 1) {
      return InvalidArgumentError(m + ": prefill.group_size=" + std::to_string(p.group_size) +
                                  ", expected >= 1");
    }
    if (p.n_queries == 0) {
      return InvalidArgumentError(m + ": prefill.n_queries=0, expected 1..n_tokens (" +
                                  std::to_string(p.n_tokens) + "): " + m +
                                  " is built from the tokens' post-RoPE queries (an ingest "
                                  "sends them as chunk.q)");
    }
    if (p.n_queries < 1 || p.n_queries > p.n_tokens) {
      return InvalidArgumentError(m + ": prefill.n_queries=" + std::to_string(p.n_queries) +
                                  ", expected 1..n_tokens (" + std::to_string(p.n_tokens) + ")");
    }
    if (p.queries == nullptr) return InvalidArgumentError(m + ": prefill.queries is null");
    if (HasNonFinite(p.queries, static_cast<size_t>(p.group_size) * p.n_queries * p.head_dim)) {
      return InvalidArgumentError(m + ": prefill.queries has NaN/Inf");
    }
    if (p.query_positions != nullptr) {
      for (int64_t i = 0; i < p.n_queries; ++i) {
        const int64_t pos = p.query_positions[i];
        if (pos < 0 || pos >= p.n_tokens || (i > 0 && pos <= p.query_positions[i - 1])) {
          return InvalidArgumentError(m + ": prefill.query_positions[" + std::to_string(i) +
                                      "]=" + std::to_string(pos) +
                                      ", expected strictly ascending in [0, n_tokens)");
        }
      }
    }
  }
  return Status::OK();
}

Status ValidateSelectInput(std::string_view method, const SelectInput& in, int d, int64_t n_tokens,
                           bool need_keys) {
  const std::string m(method);
  if (in.queries == nullptr) return InvalidArgumentError(m + ": SelectInput.queries is null");
  if (in.n_queries < 1 || in.n_queries > 1024) {
    return InvalidArgumentError(m + ": SelectInput.n_queries=" + std::to_string(in.n_queries) +
                                ", expected 1..1024");
  }
  if (in.budget < 0) {
    return InvalidArgumentError(m + ": SelectInput.budget=" + std::to_string(in.budget) +
                                ", expected >= 0 (0 = method default)");
  }
  if (HasNonFinite(in.queries, static_cast<size_t>(in.n_queries) * d)) {
    return InvalidArgumentError(m + ": SelectInput.queries has NaN/Inf");
  }
  if (need_keys) {
    if (in.keys == nullptr) return InvalidArgumentError(m + ": SelectInput.keys is required");
    if (in.keys->head_dim() != d || in.keys->n_tokens() < n_tokens) {
      return InvalidArgumentError(
          m + ": SelectInput.keys covers " + std::to_string(in.keys->n_tokens()) + " x " +
          std::to_string(in.keys->head_dim()) + ", expected >= " + std::to_string(n_tokens) +
          " tokens of head_dim " + std::to_string(d));
    }
  }
  return Status::OK();
}

}  // namespace ctxcache::index
