// Selectors of different (layer, kv head) are built concurrently by the
// service's build pipeline; building must be thread-safe.
#include <gtest/gtest.h>

#include <thread>

#include "index/selector.h"
#include "index/synthetic.h"

namespace ctxcache::index {
namespace {

TEST(ConcurrentBuildTest, CsaAndTacticBuildsInParallelThreads) {
  std::vector<SyntheticHead> heads;
  for (int i = 0; i < 4; ++i) {
    SyntheticOptions o;
    o.n_tokens = 512;
    o.head_dim = 64;
    o.n_prefill_queries = 512;
    o.n_decode_steps = 2;
    o.seed = 10 + i;
    auto h = GenerateSyntheticHead(o);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    heads.push_back(std::move(h).value());
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<std::thread> threads;
    std::vector<Status> results(heads.size() * 2);
    for (size_t i = 0; i < heads.size(); ++i) {
      threads.emplace_back([&, i] {
        for (int m = 0; m < 2; ++m) {
          auto sel = BuildSelector(m == 0 ? "csa" : "tactic", heads[i].Prefill(), {{"C", "64"}});
          if (m == 1) sel = BuildSelector("tactic", heads[i].Prefill(), {});
          results[i * 2 + m] = sel.status();
          if (sel.ok()) {
            std::string bytes;
            results[i * 2 + m] = (*sel)->Serialize(&bytes);
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& s : results) EXPECT_TRUE(s.ok()) << s.ToString();
  }
}

}  // namespace
}  // namespace ctxcache::index
