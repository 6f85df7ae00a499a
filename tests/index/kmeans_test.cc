#include "index/kmeans.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <utility>
#include <vector>

namespace ctxcache::index {
namespace {

// n points around k well-separated centers in d dims; labels returned.
std::vector<float> Blobs(int k, int per, int d, double spread, uint64_t seed,
                         std::vector<int>* labels, std::vector<float>* centers) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0, 1);
  centers->assign(static_cast<size_t>(k) * d, 0);
  for (int c = 0; c < k; ++c) {
    for (int j = 0; j < d; ++j) (*centers)[c * d + j] = 10.0f * g(rng);
  }
  std::vector<float> x;
  labels->clear();
  for (int i = 0; i < k * per; ++i) {
    const int c = i % k;
    labels->push_back(c);
    for (int j = 0; j < d; ++j) x.push_back((*centers)[c * d + j] + spread * g(rng));
  }
  return x;
}

// Every true cluster maps to exactly one found cluster and vice versa.
void ExpectSamePartition(const std::vector<int>& truth, const std::vector<int32_t>& found, int k) {
  std::vector<int> map(k, -1);
  std::set<int> used;
  for (size_t i = 0; i < truth.size(); ++i) {
    if (map[truth[i]] < 0) {
      map[truth[i]] = found[i];
      EXPECT_TRUE(used.insert(found[i]).second) << "two true clusters merged";
    }
    EXPECT_EQ(map[truth[i]], found[i]) << "point " << i;
  }
}

TEST(KMeansTest, L2RecoversSeparableClusters) {
  std::vector<int> labels;
  std::vector<float> centers;
  const int k = 8, d = 16;
  auto x = Blobs(k, 100, d, 0.5, 1, &labels, &centers);
  KMeansOptions o;
  o.k = k;
  o.max_iters = 50;
  auto r = KMeans(x.data(), k * 100, d, d, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectSamePartition(labels, r->assign, k);
  EXPECT_LT(r->objective, 0.5 * 0.5 * d * 1.5);  // ~ spread^2 * d
  EXPECT_GE(r->iterations, 1);
}

TEST(KMeansTest, CosineRecoversDirectionsWithUnitCentroids) {
  std::vector<int> labels;
  std::vector<float> centers;
  const int k = 6, d = 8;
  auto x = Blobs(k, 80, d, 0.3, 2, &labels, &centers);
  // Scale each point by a random positive factor: cosine must ignore it.
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(0.1f, 5.0f);
  for (size_t i = 0; i < x.size(); i += d) {
    const float s = u(rng);
    for (int j = 0; j < d; ++j) x[i + j] *= s;
  }
  KMeansOptions o;
  o.k = k;
  o.metric = KMeansMetric::kCosine;
  auto r = KMeans(x.data(), k * 80, d, d, o);
  ASSERT_TRUE(r.ok());
  ExpectSamePartition(labels, r->assign, k);
  for (int j = 0; j < k; ++j) EXPECT_NEAR(r->centroids.row(j).norm(), 1.0f, 1e-4);
}

TEST(KMeansTest, DeterministicForSeedAndStridedInput) {
  std::vector<int> labels;
  std::vector<float> centers;
  const int d = 8;
  auto x = Blobs(5, 50, d, 3.0, 4, &labels, &centers);  // overlapping: order matters
  // The same points embedded in a wider matrix (ld = 2d).
  std::vector<float> wide(x.size() * 2, 7.0f);
  for (int i = 0; i < 250; ++i) std::copy_n(x.data() + i * d, d, wide.data() + i * 2 * d);
  for (KMeansInit init : {KMeansInit::kPlusPlus, KMeansInit::kRandom}) {
    KMeansOptions o;
    o.k = 5;
    o.init = init;
    o.seed = 99;
    auto a = KMeans(x.data(), 250, d, d, o);
    auto b = KMeans(x.data(), 250, d, d, o);
    auto c = KMeans(wide.data(), 250, d, 2 * d, o);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_EQ(a->assign, b->assign);
    EXPECT_EQ(a->centroids, b->centroids);
    EXPECT_EQ(a->assign, c->assign);
    o.seed = 100;
    auto e = KMeans(x.data(), 250, d, d, o);
    ASSERT_TRUE(e.ok());
  }
}

TEST(KMeansTest, MiniBatchConvergesOnSeparableData) {
  std::vector<int> labels;
  std::vector<float> centers;
  const int k = 4, d = 8;
  auto x = Blobs(k, 500, d, 0.5, 5, &labels, &centers);
  KMeansOptions o;
  o.k = k;
  o.batch_size = 256;
  o.max_iters = 40;
  auto r = KMeans(x.data(), k * 500, d, d, o);
  ASSERT_TRUE(r.ok());
  ExpectSamePartition(labels, r->assign, k);
}

// kGiven starts from the given centroids: with no iterations they are the
// result, and the assignment is the nearest of them.
TEST(KMeansTest, GivenInitialCentroidsAreUsed) {
  const int64_t n = 300;
  const int d = 5, k = 7;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> x(n * d), init(k * d);
  for (auto& v : x) v = g(rng);
  for (auto& v : init) v = g(rng);
  KMeansOptions o;
  o.k = k;
  o.init = KMeansInit::kGiven;
  o.initial = init.data();
  o.max_iters = 0;
  auto r = KMeans(x.data(), n, d, d, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (int j = 0; j < k; ++j) {
    for (int t = 0; t < d; ++t) EXPECT_EQ(r->centroids(j, t), init[j * d + t]);
  }
  std::vector<int32_t> want(n);
  RowMatrixXf C = Eigen::Map<const RowMatrixXf>(init.data(), k, d);
  AssignNearest(x.data(), n, d, d, C, KMeansMetric::kL2, want.data(), nullptr);
  EXPECT_EQ(r->assign, want);
  o.initial = nullptr;
  EXPECT_EQ(KMeans(x.data(), n, d, d, o).status().code(), StatusCode::kInvalidArgument);
}

// d = 12 takes the GEMM-free small-d kernel, d = 40 the GEMM tiles; k = 7
// and 70 cover the scalar and the SIMD argmax.
class AssignNearestTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(AssignNearestTest, MatchesBruteForce) {
  std::mt19937_64 rng(6);
  std::normal_distribution<float> g(0, 1);
  const int n = 3000, d = GetParam().first, k = GetParam().second;
  RowMatrixXf C(k, d);
  for (int j = 0; j < k; ++j) {
    for (int t = 0; t < d; ++t) C(j, t) = g(rng);
  }
  std::vector<float> x(n * d);
  for (auto& v : x) v = g(rng);
  std::vector<int32_t> a(n);
  std::vector<float> best(n);
  AssignNearest(x.data(), n, d, d, C, KMeansMetric::kL2, a.data(), best.data());
  for (int i = 0; i < n; ++i) {
    int arg = 0;
    double bd = std::numeric_limits<double>::infinity();
    for (int j = 0; j < k; ++j) {
      double dist = 0;
      for (int t = 0; t < d; ++t) dist += (x[i * d + t] - C(j, t)) * (x[i * d + t] - C(j, t));
      if (dist < bd) {
        bd = dist;
        arg = j;
      }
    }
    EXPECT_EQ(a[i], arg);
    EXPECT_NEAR(best[i], bd, 1e-3 * (1 + bd));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AssignNearestTest,
                         ::testing::Values(std::pair<int, int>{12, 7}, std::pair<int, int>{12, 70},
                                           std::pair<int, int>{40, 7},
                                           std::pair<int, int>{40, 70}));

TEST(KMeansTest, AssignNearestCosineMatchesBruteForce) {
  std::mt19937_64 rng(8);
  std::normal_distribution<float> g(0, 1);
  const int n = 300, d = 12, k = 7;
  RowMatrixXf C(k, d);
  for (int j = 0; j < k; ++j) {
    for (int t = 0; t < d; ++t) C(j, t) = g(rng);
    C.row(j).normalize();
  }
  // Unnormalized points, strided (ld = d + 3), one zero point.
  const int ld = d + 3;
  std::vector<float> x(n * ld, 5.0f);
  for (int i = 0; i < n; ++i) {
    for (int t = 0; t < d; ++t) x[i * ld + t] = i == 17 ? 0.0f : 3.0f * g(rng);
  }
  std::vector<int32_t> a(n);
  std::vector<float> best(n);
  AssignNearest(x.data(), n, d, ld, C, KMeansMetric::kCosine, a.data(), best.data());
  for (int i = 0; i < n; ++i) {
    double norm = 0;
    for (int t = 0; t < d; ++t) norm += double{x[i * ld + t]} * x[i * ld + t];
    norm = std::sqrt(norm);
    int arg = 0;
    double bc = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < k; ++j) {
      double dot = 0;
      for (int t = 0; t < d; ++t) dot += double{x[i * ld + t]} * C(j, t);
      if (dot > bc) {
        bc = dot;
        arg = j;
      }
    }
    EXPECT_EQ(a[i], arg) << "point " << i;
    EXPECT_NEAR(best[i], norm > 0 ? bc / norm : 0.0, 1e-4) << "point " << i;
  }
}

// KMeans' own assignment and objective and AssignNearest run the same search:
// against KMeans' final centroids they agree exactly (L2 and, on the unit
// points KMeans clusters, cosine), strided or not.
TEST(KMeansTest, AssignNearestReproducesKMeansAssignment) {
  std::vector<int> labels;
  std::vector<float> centers;
  const int d = 8, n = 250;
  auto x = Blobs(5, 50, d, 3.0, 4, &labels, &centers);  // overlapping clusters
  std::vector<float> wide(x.size() * 2, 7.0f);
  for (int i = 0; i < n; ++i) std::copy_n(x.data() + i * d, d, wide.data() + i * 2 * d);
  for (int64_t batch : {int64_t{0}, int64_t{64}}) {
    KMeansOptions o;
    o.k = 5;
    o.batch_size = batch;
    auto r = KMeans(x.data(), n, d, d, o);
    ASSERT_TRUE(r.ok());
    std::vector<int32_t> a(n), aw(n);
    std::vector<float> best(n);
    AssignNearest(x.data(), n, d, d, r->centroids, KMeansMetric::kL2, a.data(), best.data());
    AssignNearest(wide.data(), n, d, 2 * d, r->centroids, KMeansMetric::kL2, aw.data(), nullptr);
    EXPECT_EQ(a, r->assign);
    EXPECT_EQ(aw, r->assign);
    double obj = 0;
    for (float b : best) obj += b;
    EXPECT_NEAR(obj / n, r->objective, 1e-6 * (1 + r->objective));
  }
  // Cosine: KMeans normalizes the points; give AssignNearest the same unit rows.
  std::vector<float> unit = x;
  for (int i = 0; i < n; ++i) {
    Eigen::Map<Eigen::RowVectorXf> row(unit.data() + i * d, d);
    const float norm = row.norm();
    if (norm > 0) row /= norm;
  }
  KMeansOptions o;
  o.k = 5;
  o.metric = KMeansMetric::kCosine;
  auto r = KMeans(unit.data(), n, d, d, o);
  ASSERT_TRUE(r.ok());
  std::vector<int32_t> a(n);
  std::vector<float> best(n);
  AssignNearest(unit.data(), n, d, d, r->centroids, KMeansMetric::kCosine, a.data(), best.data());
  EXPECT_EQ(a, r->assign);
  double obj = 0;
  for (float b : best) obj += 1.0 - b;
  EXPECT_NEAR(obj / n, r->objective, 1e-5);
}

TEST(KMeansTest, BadParameters) {
  std::vector<float> x(40, 1.0f);
  KMeansOptions o;
  o.k = 11;
  EXPECT_EQ(KMeans(x.data(), 10, 4, 4, o).status().code(), StatusCode::kInvalidArgument);
  o.k = 2;
  EXPECT_EQ(KMeans(x.data(), 10, 4, 3, o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KMeans(nullptr, 10, 4, 4, o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KMeans(x.data(), 0, 4, 4, o).status().code(), StatusCode::kInvalidArgument);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  auto r = KMeans(x.data(), 10, 4, 4, o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("NaN"), std::string_view::npos);
  // Identical points: k-means++ still returns k centroids without crashing.
  std::vector<float> same(40, 2.0f);
  auto s = KMeans(same.data(), 10, 4, 4, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->centroids.rows(), 2);
}

}  // namespace
}  // namespace ctxcache::index
