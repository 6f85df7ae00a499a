// Shared helpers for the model tests: fixture paths and comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace ctxcache::model::testing {

inline std::string SourceDir() {
  const char* env = std::getenv("CTXCACHE_SOURCE_DIR");
  if (env != nullptr && *env != '\0') return env;
  return CTXCACHE_SOURCE_DIR_DEFAULT;
}

inline std::string GoldenDir() { return SourceDir() + "/tests/data/golden"; }
inline std::string RefModelDir() { return SourceDir() + "/models/ctxcache-ref"; }

// Max |a - b| over equal-length arrays (returns +inf on a length mismatch).
inline double MaxAbsDiff(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (!(d <= m)) m = d;  // also catches NaN
  }
  return m;
}
inline double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  return MaxAbsDiff(a.data(), b.data(), a.size());
}

// A fresh empty directory under the system temp dir, removed by the caller.
inline std::string MakeTempDir(const std::string& tag) {
  std::string tmpl =
      (std::filesystem::temp_directory_path() / ("ctxcache-model-" + tag + "-XXXXXX")).string();
  char* p = mkdtemp(tmpl.data());
  return p ? std::string(p) : std::string();
}

}  // namespace ctxcache::model::testing
