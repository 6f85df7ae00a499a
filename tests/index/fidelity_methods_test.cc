// Fidelity of the methods on synthetic data at N = 8K (issue 5 acceptance):
//  - Tactic at P = 0.9 reaches attention mass >= 0.85 on average;
//  - Quest and CSA both beat StreamingLLM on recall at a 5% budget (by a
//    margin, and a random selector of the same size too);
//  - a random selector of the same size fails both checks (shown here), so
//    neither passes by construction.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "index/metrics.h"
#include "index/selector.h"
#include "index/synthetic.h"

namespace ctxcache::index {
namespace {

class FidelityMethodsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    SyntheticOptions o;
    o.n_tokens = 8192;
    o.head_dim = 64;
    o.group_size = 2;
    o.n_prefill_queries = 512;
    o.n_decode_steps = 16;
    auto h = GenerateSyntheticHead(o);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    head_ = new SyntheticHead(std::move(*h));
  }
  static void TearDownTestSuite() {
    delete head_;
    head_ = nullptr;
  }

  struct Result {
    double recall = 0, mass = 0, tokens = 0;
  };
  // Runs `sel` over the decode queries (no appends); budget 0 = the method's own.
  Result Run(Selector* sel, int64_t budget) {
    const int d = head_->head_dim, G = head_->group_size;
    const int64_t n = head_->n_tokens;
    ArrayKeySource ks(head_->keys.data(), n, d);
    const int64_t k = static_cast<int64_t>(std::ceil(0.05 * n));
    Result r;
    int count = 0;
    for (int t = 0; t < head_->n_decode; ++t) {
      SelectInput in;
      in.queries = head_->DecodeQueries(t);
      in.n_queries = G;
      in.budget = budget;
      in.keys = &ks;
      Selection out;
      EXPECT_TRUE(sel->Select(in, &out, nullptr).ok());
      for (int h = 0; h < G; ++h) {
        auto exact = ExactAttention::Compute(in.queries + h * d, head_->keys.data(), nullptr, n, d);
        EXPECT_TRUE(exact.ok());
        r.recall += RecallAtK(out.per_head[h], exact->TopK(k));
        r.mass += exact->Mass(out.per_head[h]);
        r.tokens += static_cast<double>(out.per_head[h].size());
        ++count;
      }
    }
    r.recall /= count;
    r.mass /= count;
    r.tokens /= count;
    return r;
  }
  // Uniformly random `size` tokens per q head.
  Result RunRandom(int64_t size, uint32_t seed) {
    const int d = head_->head_dim, G = head_->group_size;
    const int64_t n = head_->n_tokens;
    const int64_t k = static_cast<int64_t>(std::ceil(0.05 * n));
    std::mt19937 rng(seed);
    std::vector<int32_t> ids(n);
    Result r;
    int count = 0;
    for (int t = 0; t < head_->n_decode; ++t) {
      for (int h = 0; h < G; ++h) {
        for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(i);
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<int32_t> sel(ids.begin(), ids.begin() + size);
        std::sort(sel.begin(), sel.end());
        auto exact = ExactAttention::Compute(head_->DecodeQueries(t) + h * d, head_->keys.data(),
                                             nullptr, n, d);
        EXPECT_TRUE(exact.ok());
        r.recall += RecallAtK(sel, exact->TopK(k));
        r.mass += exact->Mass(sel);
        ++count;
      }
    }
    r.recall /= count;
    r.mass /= count;
    r.tokens = static_cast<double>(size);
    return r;
  }

  static SyntheticHead* head_;
};

SyntheticHead* FidelityMethodsTest::head_ = nullptr;

TEST_F(FidelityMethodsTest, TacticReachesTargetMass) {
  auto sel = BuildSelector("tactic", head_->Prefill(), {{"P", "0.9"}});
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  const Result tactic = Run(sel->get(), 0);
  EXPECT_GE(tactic.mass, 0.85) << "tokens " << tactic.tokens;
  EXPECT_LT(tactic.tokens, 0.7 * head_->n_tokens);  // not "select everything"
  // The same number of random tokens falls far short of the target.
  const Result random = RunRandom(static_cast<int64_t>(tactic.tokens), 1);
  EXPECT_LT(random.mass, 0.85) << "random mass " << random.mass;
  EXPECT_LT(random.mass, tactic.mass - 0.1);
}

TEST_F(FidelityMethodsTest, QuestAndCsaBeatStreamingOnRecall) {
  const int64_t budget = static_cast<int64_t>(std::ceil(0.05 * head_->n_tokens));
  auto quest = BuildSelector("quest", head_->Prefill(), {});
  auto csa = BuildSelector("csa", head_->Prefill(), {});
  auto streaming = BuildSelector("streaming", head_->Prefill(), {});
  ASSERT_TRUE(quest.ok()) << quest.status().ToString();
  ASSERT_TRUE(csa.ok()) << csa.status().ToString();
  ASSERT_TRUE(streaming.ok()) << streaming.status().ToString();
  const Result q = Run(quest->get(), budget);
  const Result c = Run(csa->get(), budget);
  const Result s = Run(streaming->get(), budget);
  const Result random = RunRandom(budget, 2);
  // "Beats" means by a margin over StreamingLLM and over a random selector of
  // the same size, so a random selector cannot pass the check itself; its
  // recall is about the budget fraction (5%).
  const double bar = std::max(s.recall, random.recall) + 0.05;
  EXPECT_GT(q.recall, bar) << "quest " << q.recall << " streaming " << s.recall << " random "
                           << random.recall;
  EXPECT_GT(c.recall, bar) << "csa " << c.recall << " streaming " << s.recall << " random "
                           << random.recall;
  EXPECT_NEAR(random.recall, 0.05, 0.02);
  EXPECT_LT(random.recall, bar);
  EXPECT_LE(q.tokens, budget);
  EXPECT_LE(c.tokens, budget);
}

}  // namespace
}  // namespace ctxcache::index
