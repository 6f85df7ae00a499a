#include "index/synthetic.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <random>
#include <string>

namespace ctxcache::index {
namespace {

using Mat = Eigen::MatrixXf;  // column-major; small projection matrices

// HF rotate_half RoPE of one vector at position pos.
void ApplyRope(float* x, int d, double pos, const std::vector<double>& inv_freq) {
  const int half = d / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = pos * inv_freq[i];
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const float a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

Mat Gaussian(int rows, int cols, double scale, std::mt19937_64* rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  Mat m(rows, cols);
  for (int c = 0; c < cols; ++c) {
    for (int r = 0; r < rows; ++r) m(r, c) = g(*rng) * static_cast<float>(scale);
  }
  return m;
}

}  // namespace

HeadPrefill SyntheticHead::Prefill() const {
  HeadPrefill p;
  p.n_tokens = n_tokens;
  p.head_dim = head_dim;
  p.group_size = group_size;
  p.keys = keys.data();
  p.values = values.data();
  p.n_queries = n_prefill();
  p.query_positions = prefill_positions.data();
  p.queries = prefill_queries.data();
  return p;
}

StatusOr<SyntheticHead> GenerateSyntheticHead(const SyntheticOptions& o) {
  auto bad = [](const std::string& what) { return InvalidArgumentError("synthetic: " + what); };
  if (o.n_tokens < 16 || o.n_tokens > (int64_t{1} << 24))
    return bad("n_tokens must be in [16, 2^24]");
  if (o.head_dim < 4 || o.head_dim % 2 != 0) return bad("head_dim must be even and >= 4");
  if (o.group_size < 1 || o.group_size > 64) return bad("group_size must be in [1, 64]");
  if (o.n_prefill_queries < 1) return bad("n_prefill_queries must be >= 1");
  if (o.n_decode_steps < 0) return bad("n_decode_steps must be >= 0");
  if (o.latent_dim < 2 || o.latent_dim > o.head_dim / 2) {
    return bad("latent_dim must be in [2, head_dim/2]");
  }
  if (!(o.local_std >= 0)) return bad("local_std must be >= 0");
  if (!(o.latent_noise >= 0)) return bad("latent_noise must be >= 0");
  if (o.vocab_size < 0) return bad("vocab_size must be >= 0");
  if (!(o.heavy_hitter_std >= 0)) return bad("heavy_hitter_std must be >= 0");
  if (o.n_topics < 1 || o.mean_segment < 1) return bad("n_topics and mean_segment must be >= 1");
  if (!(o.retrieval_prob >= 0 && o.retrieval_prob <= 1))
    return bad("retrieval_prob must be in [0, 1]");
  if (!(o.spectrum_decay >= 0 && o.spectrum_decay <= 4))
    return bad("spectrum_decay must be in [0, 4]");
  if (!(o.logit_std > 0) || !(o.salience_sigma >= 0) || !(o.rope_theta >= 0)) {
    return bad("logit_std > 0, salience_sigma >= 0, rope_theta >= 0 required");
  }
  if (o.n_sinks < 0 || o.n_sinks >= o.n_tokens) return bad("n_sinks must be in [0, n_tokens)");

  const int d = o.head_dim, r = o.latent_dim, G = o.group_size, half = d / 2;
  const int64_t N = o.n_tokens, T = N + o.n_decode_steps;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_real_distribution<double> unif(0.0, 1.0);

  // RoPE frequencies; semantic energy sits in the low-frequency pairs, as in
  // trained models (high-frequency pairs carry little, mostly positional).
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    inv_freq[i] = o.rope_theta > 0 ? std::pow(o.rope_theta, -2.0 * i / d) : 0.0;
  }
  Eigen::VectorXf dim_weight(d);
  for (int j = 0; j < d; ++j) {
    const double x = static_cast<double>(j % half) / std::max(1, half - 1);
    dim_weight[j] = static_cast<float>(o.rope_theta > 0 ? 0.15 + x * x : 1.0);
  }

  // Key projection B (d x r); query projections A_h = B (B^T B)^-1 M_h so that
  // q.k = y^T M_h^T z (pre-RoPE), plus O_h: energy outside the key span.
  Mat B = dim_weight.asDiagonal() * Gaussian(d, r, 1.0 / std::sqrt(r), &rng);
  Mat BtB_inv = (B.transpose() * B).inverse();
  Mat P_perp = Mat::Identity(d, d) - B * BtB_inv * B.transpose();
  std::vector<Mat> Wq(G);
  // Per 16-dim block of rows, A_b = B_b (B_b^T B_b + lambda)^-1 M_h: every block
  // then scores y^T M_h^T P_b z with P_b PSD, so a matching q/k pair agrees in
  // each subspace ("collision" across subspaces, seed 004 §C), not only in sum.
  const int block = std::min(16, d);
  for (int h = 0; h < G; ++h) {
    Mat M = Mat::Identity(r, r) + Gaussian(r, r, 0.35 / std::sqrt(r), &rng);
    Mat A(d, r);
    for (int b0 = 0; b0 < d; b0 += block) {
      const int rows = std::min(block, d - b0);
      Mat Bb = B.middleRows(b0, rows);
      Mat gram = Bb.transpose() * Bb;
      const float lambda = 0.1f * gram.trace() / r + 1e-6f;
      gram.diagonal().array() += lambda;
      A.middleRows(b0, rows) = Bb * gram.inverse() * M;
    }
    Mat O = P_perp * dim_weight.asDiagonal() * Gaussian(d, r, 1.0 / std::sqrt(r), &rng);
    O *= A.norm() / std::max(1e-6f, O.norm());
    Wq[h] = A + O;
  }
  Mat Bv = Gaussian(d, r, 1.0 / std::sqrt(r), &rng);

  // Topics, segments (Zipf popularity) and the local AR(1) term.
  Mat mu = Gaussian(r, o.n_topics, 1.0, &rng);  // column c = topic c
  std::vector<double> zipf_cdf(o.n_topics);
  double acc = 0;
  for (int c = 0; c < o.n_topics; ++c) zipf_cdf[c] = (acc += std::pow(c + 1.0, -0.7));
  auto draw_topic = [&]() {
    const double u = unif(rng) * acc;
    return static_cast<int>(std::lower_bound(zipf_cdf.begin(), zipf_cdf.end(), u) -
                            zipf_cdf.begin());
  };
  std::vector<int> seg_topic;      // per segment
  std::vector<int32_t> seg_of(T);  // per position
  Mat local(r, T);
  Eigen::VectorXf a = Eigen::VectorXf::Zero(r);
  const float phi = 0.98f, sigma_a = static_cast<float>(o.local_std);
  for (int64_t t = 0; t < T; ++t) {
    if (t == 0 || unif(rng) < 1.0 / o.mean_segment) seg_topic.push_back(draw_topic());
    seg_of[t] = static_cast<int32_t>(seg_topic.size() - 1);
    for (int i = 0; i < r; ++i) {
      a[i] = phi * a[i] + std::sqrt(1 - phi * phi) * sigma_a * gauss(rng);
    }
    local.col(t) = a;
  }
  Eigen::VectorXf spectrum(r);
  for (int i = 0; i < r; ++i)
    spectrum[i] = static_cast<float>(std::pow(1.0 + i, -o.spectrum_decay));
  // Token types: Zipf over the vocabulary; the query of position t carries
  // the type of token t, like a real query carries its token's identity.
  const int vocab = std::max(1, o.vocab_size);
  const float free_noise = static_cast<float>(o.latent_noise);
  Mat type_emb = Gaussian(r, vocab, o.vocab_size > 0 ? 0.5 : 0.0, &rng);
  std::vector<double> type_cdf(vocab);
  double type_acc = 0;
  for (int v = 0; v < vocab; ++v) type_cdf[v] = (type_acc += 1.0 / (v + 1.0));
  std::vector<int32_t> token_type(T, 0);
  for (int64_t t = 0; t < T && o.vocab_size > 0; ++t) {
    const double u = unif(rng) * type_acc;
    token_type[t] = static_cast<int32_t>(std::min<int64_t>(
        vocab - 1, std::lower_bound(type_cdf.begin(), type_cdf.end(), u) - type_cdf.begin()));
  }
  auto token_latent = [&](int64_t t) {
    Eigen::VectorXf z = mu.col(seg_topic[seg_of[t]]) + local.col(t) + type_emb.col(token_type[t]);
    for (int i = 0; i < r; ++i) z[i] = (z[i] + free_noise * gauss(rng)) * spectrum[i];
    return z;
  };
  auto query_latent = [&](int64_t t) {
    int topic = seg_topic[seg_of[t]];
    if (seg_of[t] > 0 && unif(rng) < o.retrieval_prob) {
      std::uniform_int_distribution<int> pick(0, seg_of[t] - 1);
      topic = seg_topic[pick(rng)];
    }
    Eigen::VectorXf y = mu.col(topic) + local.col(t) + type_emb.col(token_type[t]);
    for (int i = 0; i < r; ++i) y[i] = (y[i] + free_noise * gauss(rng)) * spectrum[i];
    return y;
  };

  SyntheticHead out;
  out.n_tokens = N;
  out.head_dim = d;
  out.group_size = G;
  out.n_decode = o.n_decode_steps;
  // Keys and values for all T positions (decode tokens are the tail).
  std::vector<float> all_keys(static_cast<size_t>(T) * d), all_values(static_cast<size_t>(T) * d);
  Eigen::VectorXf k_bias = Eigen::VectorXf::Zero(d);
  for (int j = 0; j < d; ++j) k_bias[j] = gauss(rng);
  double key_rms = 0;
  for (int64_t t = 0; t < T; ++t) {
    const Eigen::VectorXf z = token_latent(t);
    const float salience = std::exp(static_cast<float>(o.salience_sigma) * gauss(rng) -
                                    static_cast<float>(o.salience_sigma * o.salience_sigma / 2));
    Eigen::Map<Eigen::VectorXf> k(all_keys.data() + t * d, d), v(all_values.data() + t * d, d);
    k = salience * (B * z);
    v = Bv * z;
    for (int j = 0; j < d; ++j) v[j] += 0.3f * gauss(rng);
    key_rms += k.squaredNorm();
  }
  key_rms = std::sqrt(key_rms / T);
  k_bias *= static_cast<float>(key_rms / k_bias.norm());  // keys share a large offset
  for (int64_t t = 0; t < T; ++t) {
    Eigen::Map<Eigen::VectorXf> k(all_keys.data() + t * d, d);
    k += k_bias;
    for (int j = 0; j < d; ++j)
      k[j] += 0.05f * static_cast<float>(key_rms / std::sqrt(d)) * gauss(rng);
  }

  // Queries: prefill rows at evenly spaced positions, decode rows at N + t.
  const int64_t P = std::min(o.n_prefill_queries, N);
  out.prefill_positions.resize(P);
  for (int64_t i = 0; i < P; ++i) {
    out.prefill_positions[i] = static_cast<int64_t>((static_cast<double>(i) + 0.5) * N / P);
  }
  out.prefill_queries.resize(static_cast<size_t>(G) * P * d);
  out.decode_queries.resize(static_cast<size_t>(o.n_decode_steps) * G * d);
  // Query bias in the lowest-frequency pairs: RoPE barely moves it, so it
  // gives every query a common direction (the one sinks align with).
  Eigen::VectorXf q_bias = Eigen::VectorXf::Zero(d);
  for (int i = std::max(0, half - 4); i < half; ++i) {
    q_bias[i] = gauss(rng);
    q_bias[i + half] = gauss(rng);
  }
  double q_rms = 0;
  int64_t q_count = 0;
  auto make_query = [&](int64_t pos, int h, float* dst) {
    Eigen::Map<Eigen::VectorXf> q(dst, d);
    q = Wq[h] * query_latent(pos);
    q_rms += q.squaredNorm();
    ++q_count;
  };
  for (int h = 0; h < G; ++h) {
    for (int64_t i = 0; i < P; ++i) {
      make_query(out.prefill_positions[i], h, out.prefill_queries.data() + (h * P + i) * d);
    }
  }
  for (int t = 0; t < o.n_decode_steps; ++t) {
    for (int h = 0; h < G; ++h) {
      make_query(N + t, h, out.decode_queries.data() + (static_cast<size_t>(t) * G + h) * d);
    }
  }
  q_bias *= static_cast<float>(std::sqrt(q_rms / std::max<int64_t>(1, q_count)) / q_bias.norm());
  auto finish_query = [&](float* q, int64_t pos) {
    Eigen::Map<Eigen::VectorXf>(q, d) += q_bias;
    if (o.rope_theta > 0) ApplyRope(q, d, static_cast<double>(pos), inv_freq);
  };
  for (int h = 0; h < G; ++h) {
    for (int64_t i = 0; i < P; ++i) {
      finish_query(out.prefill_queries.data() + (h * P + i) * d, out.prefill_positions[i]);
    }
  }
  for (int t = 0; t < o.n_decode_steps; ++t) {
    for (int h = 0; h < G; ++h) {
      finish_query(out.decode_queries.data() + (static_cast<size_t>(t) * G + h) * d, N + t);
    }
  }
  if (o.rope_theta > 0) {
    for (int64_t t = 0; t < T; ++t) ApplyRope(all_keys.data() + t * d, d, t, inv_freq);
  }

  // Calibrate the logit scale on a sample of queries and non-sink keys.
  const int64_t n_sample_keys = std::min<int64_t>(2048, N - o.n_sinks);
  std::vector<int64_t> sample_keys(n_sample_keys);
  for (auto& k : sample_keys) {
    k = o.n_sinks + static_cast<int64_t>(unif(rng) * (N - o.n_sinks));
    k = std::min(k, N - 1);
  }
  const int n_sample_q = 32;
  std::vector<const float*> sample_q;
  for (int i = 0; i < n_sample_q; ++i) {
    const int h = i % G;
    const int64_t row = static_cast<int64_t>(unif(rng) * P) % P;
    sample_q.push_back(out.prefill_queries.data() + (h * P + row) * d);
  }
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  auto logit = [&](const float* q, const float* k) {
    return Eigen::Map<const Eigen::VectorXf>(q, d).dot(Eigen::Map<const Eigen::VectorXf>(k, d)) *
           inv_sqrt_d;
  };
  double std_sum = 0;
  for (const float* q : sample_q) {
    double s = 0, s2 = 0;
    for (int64_t k : sample_keys) {
      const double l = logit(q, all_keys.data() + k * d);
      s += l;
      s2 += l * l;
    }
    const double mean = s / n_sample_keys;
    std_sum += std::sqrt(std::max(1e-12, s2 / n_sample_keys - mean * mean));
  }
  const float scale = static_cast<float>(o.logit_std / (std_sum / n_sample_q));
  for (float& x : out.prefill_queries) x *= scale;
  for (float& x : out.decode_queries) x *= scale;

  // The common query direction u (the query bias; RoPE barely rotates it).
  const Eigen::VectorXf u = q_bias.normalized();
  double along = 0;
  for (const float* q : sample_q) along += logit(q, u.data());
  along /= n_sample_q;
  // Heavy hitters: a query-independent key term h_t * u, h_t ~ Exp(1) - 1,
  // giving logit std heavy_hitter_std for the average query.
  if (o.heavy_hitter_std > 0 && along > 1e-6) {
    std::exponential_distribution<float> expo(1.0f);
    Eigen::VectorXf u_rot(d);
    for (int64_t t = o.n_sinks; t < T; ++t) {
      u_rot = u;
      if (o.rope_theta > 0) ApplyRope(u_rot.data(), d, static_cast<double>(t), inv_freq);
      const float h = static_cast<float>(o.heavy_hitter_std / along) * (expo(rng) - 1.0f);
      Eigen::Map<Eigen::VectorXf>(all_keys.data() + t * d, d) += h * u_rot;
    }
  }
  // Sinks: keys along u, sized for logit = mean + sink_boost.
  if (o.n_sinks > 0) {
    double mean_logit = 0;
    for (const float* q : sample_q) {
      double s = 0;
      for (int64_t k : sample_keys) s += logit(q, all_keys.data() + k * d);
      mean_logit += s / n_sample_keys;
    }
    mean_logit /= n_sample_q;
    const float kappa = along > 1e-6 ? static_cast<float>((mean_logit + o.sink_boost) / along)
                                     : static_cast<float>(key_rms);
    for (int t = 0; t < o.n_sinks; ++t) {
      Eigen::Map<Eigen::VectorXf> k(all_keys.data() + static_cast<int64_t>(t) * d, d);
      k = kappa * u;
      for (int j = 0; j < d; ++j)
        k[j] += 0.02f * kappa * gauss(rng) / std::sqrt(static_cast<float>(d));
      if (o.rope_theta > 0) ApplyRope(k.data(), d, t, inv_freq);
    }
  }

  out.keys.assign(all_keys.begin(), all_keys.begin() + N * d);
  out.values.assign(all_values.begin(), all_values.begin() + N * d);
  out.decode_keys.assign(all_keys.begin() + N * d, all_keys.end());
  out.decode_values.assign(all_values.begin() + N * d, all_values.end());
  return out;
}

}  // namespace ctxcache::index
