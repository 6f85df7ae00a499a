// Runs `ctxcache-bench storage --quick` and checks that its JSON line holds
// every field the storage issues (#3, #16) ask for.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/common/bench_json.h"
#include "tests/storage/test_util.h"

namespace {

TEST(StorageBenchTest, QuickRunReportsEveryField) {
  const char* bin_dir = std::getenv("CTXCACHE_BIN_DIR");
  ASSERT_NE(bin_dir, nullptr) << "CTXCACHE_BIN_DIR not set (run through ctest)";
  ctxcache::storage::testing::TempDir dir;
  const auto run = ctxcache::testing::RunBench(std::string(bin_dir) +
                                               "/ctxcache-bench storage --quick --dir " +
                                               dir.path());
  ASSERT_EQ(run.status, 0) << run.output;
  const std::string& last = run.last_line;
  const nlohmann::json& j = run.json;
  ASSERT_TRUE(j.is_object()) << last;
  for (const char* f :
       {"write_gbps", "read_warm_gbps", "read_cold_gbps", "read_p50_us", "read_p99_us",
        "fio_randread_gbps", "read_vs_fio", "fio_seqwrite_gbps", "write_vs_fio",
        // issue #16
        "read_vs_fio_qd1", "read_vs_fio_qd32", "fio_randread_qd32_gbps", "write_vs_fio_seq",
        "block_cache_hit_ratio", "warm_working_set_bytes", "warm_block_cache_bytes",
        "read_warm_gbps_at_p50"}) {
    ASSERT_TRUE(j.contains(f)) << f << " missing in " << last;
    EXPECT_TRUE(j[f].is_number()) << f;
    EXPECT_GT(j[f].get<double>(), 0.0) << f;
  }
  // The warm working set fits the block cache, and the timed warm passes
  // hit it (the tables repeat exactly).
  EXPECT_TRUE(j["warm_working_set_fits"].get<bool>());
  EXPECT_GT(j["block_cache_hit_ratio"].get<double>(), 0.99);
  // Cold reads by read_io_depth, and fio by queue depth, for the plot.
  ASSERT_TRUE(j["read_cold_by_depth"].is_array());
  ASSERT_FALSE(j["read_cold_by_depth"].empty());
  for (const auto& row : j["read_cold_by_depth"]) {
    EXPECT_GT(row["read_io_depth"].get<double>(), 0.0);
    EXPECT_GT(row["stored_gbps"].get<double>(), 0.0);
    EXPECT_GT(row["p99_us"].get<double>(), 0.0);
  }
  ASSERT_TRUE(j["fio_randread_by_qd"].contains("32"));
  ASSERT_TRUE(j["variants"].contains("default"));
  ASSERT_TRUE(j.contains("compression_ratio")) << last;
  for (const char* codec : {"none", "zstd", "zstd_shuffle"}) {
    ASSERT_TRUE(j["compression_ratio"].contains(codec)) << codec;
    EXPECT_GT(j["compression_ratio"][codec].get<double>(), 0.9);  // none: header overhead
  }
  ASSERT_TRUE(j.contains("cold_read_method"));
}

}  // namespace
