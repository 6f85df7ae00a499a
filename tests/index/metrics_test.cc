#include "index/metrics.h"

#include <gtest/gtest.h>

#include <cmath>

namespace ctxcache::index {
namespace {

TEST(MetricsTest, ExactAttentionByHand) {
  // d = 4, so the scale is 1/2. q.k = {0, 2, 4}; softmax of {0, 1, 2}.
  const float q[4] = {1, 0, 0, 0};
  const float k[12] = {0, 1, 0, 0, 2, 0, 0, 0, 4, 0, 1, 1};
  const float v[12] = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0};
  auto a = ExactAttention::Compute(q, k, v, 3, 4);
  ASSERT_TRUE(a.ok());
  const double z = 1 + std::exp(1.0) + std::exp(2.0);
  EXPECT_NEAR(a->probs()[0], 1 / z, 1e-12);
  EXPECT_NEAR(a->probs()[2], std::exp(2.0) / z, 1e-12);
  EXPECT_EQ(a->TopK(2), (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(a->Mass({1, 2}), (std::exp(1.0) + std::exp(2.0)) / z, 1e-12);
  EXPECT_NEAR(a->Mass({0, 1, 2}), 1.0, 1e-12);
  // o = probs (values are one-hot); restricted to {2}: o_S = e3.
  const double p0 = 1 / z, p1 = std::exp(1.0) / z, p2 = std::exp(2.0) / z;
  const double num = std::sqrt(p0 * p0 + p1 * p1 + (1 - p2) * (1 - p2));
  const double den = std::sqrt(p0 * p0 + p1 * p1 + p2 * p2);
  EXPECT_NEAR(a->OutputError({2}), num / den, 1e-9);
  EXPECT_NEAR(a->OutputError({0, 1, 2}), 0.0, 1e-9);
  EXPECT_EQ(a->OutputError({}), -1.0);
}

TEST(MetricsTest, RecallAndSummary) {
  EXPECT_DOUBLE_EQ(RecallAtK({1, 2, 3, 9}, {2, 3, 4, 5}), 0.5);
  EXPECT_DOUBLE_EQ(RecallAtK({}, {1}), 0.0);
  FidelitySummary s;
  s.Add(1.0, 0.5, 0.1);
  s.Add(0.5, 1.0, 0.3);
  s.Finish();
  EXPECT_DOUBLE_EQ(s.recall, 0.75);
  EXPECT_DOUBLE_EQ(s.mass, 0.75);
  EXPECT_NEAR(s.output_error, 0.2, 1e-12);
  FidelitySummary t;
  t.Add(1.0, 1.0, -1.0);
  t.Finish();
  EXPECT_EQ(t.output_error, -1.0);
}

TEST(MetricsTest, RejectsBadInput) {
  const float q[2] = {NAN, 0};
  const float k[2] = {1, 1};
  EXPECT_EQ(ExactAttention::Compute(q, k, nullptr, 1, 2).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ExactAttention::Compute(k, k, nullptr, 0, 2).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(MetricsTest, LogSumExpIsStableAndExact) {
  const std::vector<float> x = {1000.0f, 1000.0f, 990.0f};
  const double want = 1000.0 * 0.5 + std::log(2.0 + std::exp(-5.0));
  EXPECT_NEAR(LogSumExp(x.data(), 3, 0.5f), want, 1e-4);
  EXPECT_TRUE(std::isinf(LogSumExp(x.data(), 0, 1.0f)));
}

TEST(MetricsTest, EstimatedMassFromExactLogitsIsTheExactMass) {
  // With exact logits for every token the estimate is the softmax mass; a
  // token without an estimate counts as the average unestimated token.
  const std::vector<float> all = {0.5f, 2.0f, -1.0f, 1.5f, 0.0f, 3.0f};
  const double lse = LogSumExp(all.data(), 6, 1.0f);
  auto p = [&](int i) { return std::exp(all[i] - lse); };
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5};
  EXPECT_NEAR(EstimateCapturedMass(ids, all, lse, 6, {1, 5}), p(1) + p(5), 1e-6);
  // Estimates for 1, 3, 5 only; attended 1 and 4 (4 unestimated): the rest's
  // mass (tokens 0, 2, 4) split evenly.
  const std::vector<int32_t> est = {1, 3, 5};
  const std::vector<float> lg = {all[1], all[3], all[5]};
  const double rest = p(0) + p(2) + p(4);
  EXPECT_NEAR(EstimateCapturedMass(est, lg, lse, 6, {1, 4}), p(1) + rest / 3, 1e-6);
  EXPECT_NEAR(EstimateCapturedMass(est, lg, lse, 6, ids), 1.0, 1e-6);
  EXPECT_EQ(EstimateCapturedMass(est, lg, lse, 6, {}), 0.0);
}

}  // namespace
}  // namespace ctxcache::index
