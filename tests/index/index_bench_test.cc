// Runs `ctxcache-bench index` on a small synthetic head and checks the
// page-level fields (csa_pages): every method's page set has the same budget,
// and none captures more attention mass than the oracle's pages, which are
// the most massive pages by construction.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/common/bench_json.h"

namespace {

TEST(IndexBenchTest, PageLevelMassIsReportedAndBoundedByTheOracle) {
  const char* bin_dir = std::getenv("CTXCACHE_BIN_DIR");
  ASSERT_NE(bin_dir, nullptr) << "CTXCACHE_BIN_DIR not set (run through ctest)";
  const auto bench = ctxcache::testing::RunBench(
      std::string(bin_dir) + "/ctxcache-bench index --n 4096 --queries 4 --no-faiss 2>/dev/null");
  ASSERT_EQ(bench.status, 0) << bench.output;
  const std::string& last = bench.last_line;
  const nlohmann::json& j = bench.json;
  ASSERT_TRUE(j.is_object()) << last;
  const auto& run = j["runs"][0];
  ASSERT_TRUE(run.contains("csa_pages")) << last;
  const auto& pages = run["csa_pages"];
  EXPECT_EQ(pages["page_tokens"].get<int>(), 16);
  EXPECT_EQ(pages["n_pages"].get<int>(), 256);
  EXPECT_EQ(pages["page_budget"].get<int>(), 13);  // ceil(5% of 256)
  const double oracle = pages["oracle_pages_mass"].get<double>();
  EXPECT_GT(oracle, 0.0);
  EXPECT_LE(oracle, 1.0 + 1e-9);
  for (const char* f : {"token_then_pages_mass", "page_bins_mass", "page_bins_pooled_mass",
                        "page_softmax_bins_mass", "page_softmax_bins_pooled_mass",
                        "page_max_bins_mass", "page_max_bins_pooled_mass"}) {
    ASSERT_TRUE(pages.contains(f)) << f << " missing in " << last;
    const double m = pages[f].get<double>();
    EXPECT_GT(m, 0.0) << f;
    EXPECT_LE(m, oracle + 1e-9) << f;
  }
}

}  // namespace
