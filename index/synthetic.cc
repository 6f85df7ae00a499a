#include "index/synthetic.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "index/eigen_blocking.h"

namespace ctxcache::index {
namespace {

using Mat = Eigen::MatrixXf;  // column-major; small projection matrices
using Vec = Eigen::VectorXf;

// The single source of randomness of one head. The output is a pure function
// of the seed and of the ORDER of the draws, so GenerateSyntheticHead runs its
// steps in a fixed sequence and each step draws in a fixed loop order. `gauss`
// is one shared object on purpose: std::normal_distribution keeps the second
// value of each pair it generates, so re-creating it would change the stream.
struct Random {
  explicit Random(uint64_t seed) : engine(seed) {}
  float Gauss() { return gauss(engine); }
  double Unif() { return unif(engine); }

  std::mt19937_64 engine;
  std::normal_distribution<float> gauss{0.0f, 1.0f};
  std::uniform_real_distribution<double> unif{0.0, 1.0};
};

// rows x cols of N(0, scale^2), filled column by column. Uses its own normal
// distribution (never the shared Random::gauss), as the generator always has.
Mat Gaussian(int rows, int cols, double scale, std::mt19937_64& engine) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  Mat m(rows, cols);
  for (int c = 0; c < cols; ++c) {
    for (int r = 0; r < rows; ++r) m(r, c) = g(engine) * static_cast<float>(scale);
  }
  return m;
}

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

// Scaled dot product q.k / sqrt(d).
float Logit(const float* q, const float* k, int d) {
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  return Eigen::Map<const Vec>(q, d).dot(Eigen::Map<const Vec>(k, d)) * inv_sqrt_d;
}

// Inverse-CDF sampler over fixed, unnormalised weights (Zipf popularity).
class DiscreteSampler {
 public:
  void Add(double weight) { cdf_.push_back(total_ += weight); }
  // The index for u01 uniform in [0, 1).
  int Draw(double u01) const {
    const double u = u01 * total_;
    const int64_t i = std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin();
    return static_cast<int>(std::min<int64_t>(static_cast<int64_t>(cdf_.size()) - 1, i));
  }

 private:
  std::vector<double> cdf_;
  double total_ = 0;
};

Status ValidateOptions(const SyntheticOptions& o) {
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
  return Status::OK();
}

// ---- RoPE layout -------------------------------------------------------------

// Per-pair RoPE inverse frequencies (all zero when RoPE is off).
std::vector<double> RopeInvFreq(const SyntheticOptions& o) {
  const int d = o.head_dim, half = d / 2;
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    inv_freq[i] = o.rope_theta > 0 ? std::pow(o.rope_theta, -2.0 * i / d) : 0.0;
  }
  return inv_freq;
}

// Per-dim weight of the semantic (latent) energy. With RoPE it sits in the
// low-frequency pairs, as in trained models: the high-frequency pairs carry
// little and that little is mostly positional.
Vec SemanticDimWeight(const SyntheticOptions& o) {
  const int d = o.head_dim, half = d / 2;
  Vec dim_weight(d);
  for (int j = 0; j < d; ++j) {
    const double x = static_cast<double>(j % half) / std::max(1, half - 1);
    dim_weight[j] = static_cast<float>(o.rope_theta > 0 ? 0.15 + x * x : 1.0);
  }
  return dim_weight;
}

// ---- Projections of the latent -------------------------------------------------

struct Projections {
  Mat B;                // key projection, d x r: k = B z
  std::vector<Mat> Wq;  // query projection per q head, d x r: q = Wq[h] y
  Mat Bv;               // value projection, d x r
};

// The in-span part A of a query projection, built per 16-row block b as
// A_b = B_b (B_b^T B_b + lambda)^-1 M. Every block then scores y^T M^T P_b z
// with P_b PSD, so a matching q/k pair agrees in each subspace ("collision"
// across subspaces, seed 004 §C), not only in the sum.
Mat BlockwiseQueryMap(const Mat& B, const Mat& M) {
  const int d = static_cast<int>(B.rows()), r = static_cast<int>(B.cols());
  const int block = std::min(16, d);
  Mat A(d, r);
  for (int b0 = 0; b0 < d; b0 += block) {
    const int rows = std::min(block, d - b0);
    Mat Bb = B.middleRows(b0, rows);
    Mat gram = Bb.transpose() * Bb;
    const float lambda = 0.1f * gram.trace() / r + 1e-6f;
    gram.diagonal().array() += lambda;
    A.middleRows(b0, rows) = Bb * gram.inverse() * M;
  }
  return A;
}

// Keys and queries are DIFFERENT projections of the latent, so Q and K are
// distribution-shifted (CSAttention §2.4): Wq[h] = A_h + O_h, where A_h maps
// into the key span (q.k = y^T M_h^T z before RoPE, M_h = I + small noise) and
// O_h, of equal norm, lies outside it and so only adds query energy.
Projections SampleProjections(const SyntheticOptions& o, Random& rng) {
  const int d = o.head_dim, r = o.latent_dim;
  const Vec dim_weight = SemanticDimWeight(o);
  Projections p;
  p.B = dim_weight.asDiagonal() * Gaussian(d, r, 1.0 / std::sqrt(r), rng.engine);
  const Mat BtB_inv = (p.B.transpose() * p.B).inverse();
  const Mat P_perp = Mat::Identity(d, d) - p.B * BtB_inv * p.B.transpose();
  p.Wq.resize(o.group_size);
  for (int h = 0; h < o.group_size; ++h) {
    const Mat M = Mat::Identity(r, r) + Gaussian(r, r, 0.35 / std::sqrt(r), rng.engine);
    const Mat A = BlockwiseQueryMap(p.B, M);
    Mat O = P_perp * dim_weight.asDiagonal() * Gaussian(d, r, 1.0 / std::sqrt(r), rng.engine);
    O *= A.norm() / std::max(1e-6f, O.norm());
    p.Wq[h] = A + O;
  }
  p.Bv = Gaussian(d, r, 1.0 / std::sqrt(r), rng.engine);
  return p;
}

// ---- Latent model ----------------------------------------------------------------

// The shared latent behind the key, value and query of every position t:
// topic of t's segment + local AR(1) term + token-type embedding, plus free
// noise, scaled by a power-law spectrum (as in trained activations).
struct LatentModel {
  Mat mu;                           // r x n_topics: column c = topic c
  std::vector<int> seg_topic;       // topic per segment
  std::vector<int32_t> seg_of;      // segment per position
  Mat local;                        // r x T: local AR(1) term per position
  Vec spectrum;                     // scale per latent coordinate
  Mat type_emb;                     // r x vocab: token-type embeddings
  std::vector<int32_t> token_type;  // per position (all 0 when vocab_size == 0)
  float free_noise = 0;
  double retrieval_prob = 0;

  // The latent of the token at t; keys and values are projections of it.
  Vec TokenLatent(int64_t t, Random& rng) const {
    return AddNoiseAndScale(Mix(seg_topic[seg_of[t]], t), rng);
  }

  // What a query at t looks for: its own segment's topic or, with
  // retrieval_prob, the topic of a random earlier segment (long-range
  // retrieval). It shares t's local term and token type, as a real query
  // carries its own token's identity and context.
  Vec QueryLatent(int64_t t, Random& rng) const {
    int topic = seg_topic[seg_of[t]];
    if (seg_of[t] > 0 && rng.Unif() < retrieval_prob) {
      std::uniform_int_distribution<int> pick(0, seg_of[t] - 1);
      topic = seg_topic[pick(rng.engine)];
    }
    return AddNoiseAndScale(Mix(topic, t), rng);
  }

 private:
  Vec Mix(int topic, int64_t t) const {
    return mu.col(topic) + local.col(t) + type_emb.col(token_type[t]);
  }
  Vec AddNoiseAndScale(Vec z, Random& rng) const {
    for (int i = 0; i < z.size(); ++i) z[i] = (z[i] + free_noise * rng.Gauss()) * spectrum[i];
    return z;
  }
};

// Segments of geometric length (mean mean_segment) with Zipf-popular topics,
// and the slowly varying local AR(0.98) term (content locality, so neighbours
// are similar). One loop: the two interleave their draws position by position.
void SampleSegmentsAndLocalTerm(const SyntheticOptions& o, int64_t T, Random& rng, LatentModel* m) {
  const int r = o.latent_dim;
  DiscreteSampler topics;
  for (int c = 0; c < o.n_topics; ++c) topics.Add(std::pow(c + 1.0, -0.7));
  m->seg_of.resize(T);
  m->local.resize(r, T);
  Vec a = Vec::Zero(r);
  const float phi = 0.98f, sigma_a = static_cast<float>(o.local_std);
  for (int64_t t = 0; t < T; ++t) {
    if (t == 0 || rng.Unif() < 1.0 / o.mean_segment)
      m->seg_topic.push_back(topics.Draw(rng.Unif()));
    m->seg_of[t] = static_cast<int32_t>(m->seg_topic.size() - 1);
    for (int i = 0; i < r; ++i) {
      a[i] = phi * a[i] + std::sqrt(1 - phi * phi) * sigma_a * rng.Gauss();
    }
    m->local.col(t) = a;
  }
}

// Token types, Zipf over the vocabulary (token identity joins the latent).
// The embedding is drawn even when vocab_size == 0 (then it is all zero):
// those draws are part of the stream every later step depends on.
void SampleTokenTypes(const SyntheticOptions& o, int64_t T, Random& rng, LatentModel* m) {
  const int vocab = std::max(1, o.vocab_size);
  m->type_emb = Gaussian(o.latent_dim, vocab, o.vocab_size > 0 ? 0.5 : 0.0, rng.engine);
  m->token_type.assign(T, 0);
  if (o.vocab_size == 0) return;
  DiscreteSampler types;
  for (int v = 0; v < vocab; ++v) types.Add(1.0 / (v + 1.0));
  for (int64_t t = 0; t < T; ++t) m->token_type[t] = types.Draw(rng.Unif());
}

LatentModel SampleLatentModel(const SyntheticOptions& o, int64_t T, Random& rng) {
  const int r = o.latent_dim;
  LatentModel m;
  m.free_noise = static_cast<float>(o.latent_noise);
  m.retrieval_prob = o.retrieval_prob;
  m.mu = Gaussian(r, o.n_topics, 1.0, rng.engine);
  SampleSegmentsAndLocalTerm(o, T, rng, &m);
  m.spectrum.resize(r);
  for (int i = 0; i < r; ++i)
    m.spectrum[i] = static_cast<float>(std::pow(1.0 + i, -o.spectrum_decay));
  SampleTokenTypes(o, T, rng, &m);
  return m;
}

// ---- Keys and values -------------------------------------------------------------

struct KeyValues {
  std::vector<float> keys;    // T x d, every position (decode tokens are the tail)
  std::vector<float> values;  // T x d
  double key_rms = 0;         // rms key norm before the shared offset
};

// k = salience * B z with log-normal salience (a heavy tail of strong keys),
// v = Bv z + noise; then every key gets the same large offset, as real keys
// do, sized to the rms key norm, plus a little isotropic noise. The offset's
// direction is drawn before the keys, its size only once they are known.
KeyValues SampleKeysAndValues(const SyntheticOptions& o, int64_t T, const Projections& proj,
                              const LatentModel& latent, Random& rng) {
  const int d = o.head_dim;
  KeyValues kv;
  kv.keys.resize(static_cast<size_t>(T) * d);
  kv.values.resize(static_cast<size_t>(T) * d);
  Vec k_bias = Vec::Zero(d);
  for (int j = 0; j < d; ++j) k_bias[j] = rng.Gauss();
  double key_rms = 0;
  for (int64_t t = 0; t < T; ++t) {
    const Vec z = latent.TokenLatent(t, rng);
    const float salience = std::exp(static_cast<float>(o.salience_sigma) * rng.Gauss() -
                                    static_cast<float>(o.salience_sigma * o.salience_sigma / 2));
    Eigen::Map<Vec> k(kv.keys.data() + t * d, d), v(kv.values.data() + t * d, d);
    k = salience * (proj.B * z);
    v = proj.Bv * z;
    for (int j = 0; j < d; ++j) v[j] += 0.3f * rng.Gauss();
    key_rms += k.squaredNorm();
  }
  key_rms = std::sqrt(key_rms / T);
  k_bias *= static_cast<float>(key_rms / k_bias.norm());
  for (int64_t t = 0; t < T; ++t) {
    Eigen::Map<Vec> k(kv.keys.data() + t * d, d);
    k += k_bias;
    for (int j = 0; j < d; ++j)
      k[j] += 0.05f * static_cast<float>(key_rms / std::sqrt(d)) * rng.Gauss();
  }
  kv.key_rms = key_rms;
  return kv;
}

// RoPE every key at its own position.
void RotateKeys(const std::vector<double>& inv_freq, int d, std::vector<float>* keys) {
  const int64_t T = static_cast<int64_t>(keys->size()) / d;
  for (int64_t t = 0; t < T; ++t) ApplyRope(keys->data() + t * d, d, t, inv_freq);
}

// ---- Queries --------------------------------------------------------------------

float* PrefillQuery(SyntheticHead* out, int h, int64_t i) {
  return out->prefill_queries.data() + (h * out->n_prefill() + i) * out->head_dim;
}
const float* PrefillQuery(const SyntheticHead& out, int h, int64_t i) {
  return out.prefill_queries.data() + (h * out.n_prefill() + i) * out.head_dim;
}
float* DecodeQuery(SyntheticHead* out, int t, int h) {
  return out->decode_queries.data() +
         (static_cast<size_t>(t) * out->group_size + h) * out->head_dim;
}

// P prefill rows at the centres of P equal bins of [0, N).
std::vector<int64_t> PrefillPositions(int64_t N, int64_t P) {
  std::vector<int64_t> positions(P);
  for (int64_t i = 0; i < P; ++i) {
    positions[i] = static_cast<int64_t>((static_cast<double>(i) + 0.5) * N / P);
  }
  return positions;
}

// Direction of the query bias, in the lowest-frequency pairs: RoPE barely
// moves it, so it gives every query a common direction (the one sinks and
// heavy hitters align with). Unscaled.
Vec SampleQueryBiasDirection(int d, Random& rng) {
  const int half = d / 2;
  Vec q_bias = Vec::Zero(d);
  for (int i = std::max(0, half - 4); i < half; ++i) {
    q_bias[i] = rng.Gauss();
    q_bias[i + half] = rng.Gauss();
  }
  return q_bias;
}

// q = Wq[h] y for every prefill row (head-major), then every decode step
// (step-major, as stored). Returns the rms query norm.
double SampleRawQueries(const SyntheticOptions& o, const std::vector<Mat>& Wq,
                        const LatentModel& latent, Random& rng, SyntheticHead* out) {
  const int d = o.head_dim, G = o.group_size;
  double q_rms = 0;
  int64_t q_count = 0;
  auto make_query = [&](int64_t pos, int h, float* dst) {
    Eigen::Map<Vec> q(dst, d);
    q = Wq[h] * latent.QueryLatent(pos, rng);
    q_rms += q.squaredNorm();
    ++q_count;
  };
  for (int h = 0; h < G; ++h) {
    for (int64_t i = 0; i < out->n_prefill(); ++i) {
      make_query(out->prefill_positions[i], h, PrefillQuery(out, h, i));
    }
  }
  for (int t = 0; t < o.n_decode_steps; ++t) {
    for (int h = 0; h < G; ++h) make_query(o.n_tokens + t, h, DecodeQuery(out, t, h));
  }
  return std::sqrt(q_rms / std::max<int64_t>(1, q_count));
}

// Adds the query bias and applies RoPE at each query's position.
void FinishQueries(const SyntheticOptions& o, const Vec& q_bias,
                   const std::vector<double>& inv_freq, SyntheticHead* out) {
  const int d = o.head_dim;
  auto finish_query = [&](float* q, int64_t pos) {
    Eigen::Map<Vec>(q, d) += q_bias;
    if (o.rope_theta > 0) ApplyRope(q, d, static_cast<double>(pos), inv_freq);
  };
  for (int h = 0; h < o.group_size; ++h) {
    for (int64_t i = 0; i < out->n_prefill(); ++i) {
      finish_query(PrefillQuery(out, h, i), out->prefill_positions[i]);
    }
  }
  for (int t = 0; t < o.n_decode_steps; ++t) {
    for (int h = 0; h < o.group_size; ++h) finish_query(DecodeQuery(out, t, h), o.n_tokens + t);
  }
}

// Fills out's prefill rows (evenly spaced positions) and decode rows (at
// N + t, never seen by the builder). Returns the query bias, scaled to the
// rms query norm so the common direction is as strong as the content.
Vec SampleQueries(const SyntheticOptions& o, const std::vector<Mat>& Wq, const LatentModel& latent,
                  const std::vector<double>& inv_freq, Random& rng, SyntheticHead* out) {
  const int d = o.head_dim, G = o.group_size;
  const int64_t P = std::min(o.n_prefill_queries, o.n_tokens);
  out->prefill_positions = PrefillPositions(o.n_tokens, P);
  out->prefill_queries.resize(static_cast<size_t>(G) * P * d);
  out->decode_queries.resize(static_cast<size_t>(o.n_decode_steps) * G * d);
  Vec q_bias = SampleQueryBiasDirection(d, rng);
  const double q_rms = SampleRawQueries(o, Wq, latent, rng, out);
  q_bias *= static_cast<float>(q_rms / q_bias.norm());
  FinishQueries(o, q_bias, inv_freq, out);
  return q_bias;
}

// ---- Logit scale, heavy hitters and sinks -------------------------------------------

// Prefill queries and non-sink keys on which the logit statistics are
// measured (sampling keeps this O(1) in N).
struct LogitProbe {
  std::vector<int64_t> keys;          // key positions in [n_sinks, N)
  std::vector<const float*> queries;  // rows of out.prefill_queries
};

LogitProbe SampleLogitProbe(const SyntheticOptions& o, const SyntheticHead& out, Random& rng) {
  const int64_t N = o.n_tokens, P = out.n_prefill();
  LogitProbe probe;
  probe.keys.resize(std::min<int64_t>(2048, N - o.n_sinks));
  for (auto& k : probe.keys) {
    k = o.n_sinks + static_cast<int64_t>(rng.Unif() * (N - o.n_sinks));
    k = std::min(k, N - 1);
  }
  const int n_sample_q = 32;
  for (int i = 0; i < n_sample_q; ++i) {
    const int h = i % o.group_size;
    const int64_t row = static_cast<int64_t>(rng.Unif() * P) % P;
    probe.queries.push_back(PrefillQuery(out, h, row));
  }
  return probe;
}

// Scales every query so the std of q.k/sqrt(d) over keys, averaged over the
// probe queries, is logit_std: the content term alone sets the temperature.
void CalibrateLogitScale(const SyntheticOptions& o, const LogitProbe& probe,
                         const std::vector<float>& keys, SyntheticHead* out) {
  const int d = o.head_dim;
  const int64_t n_sample_keys = static_cast<int64_t>(probe.keys.size());
  const int n_sample_q = static_cast<int>(probe.queries.size());
  double std_sum = 0;
  for (const float* q : probe.queries) {
    double s = 0, s2 = 0;
    for (int64_t k : probe.keys) {
      const double l = Logit(q, keys.data() + k * d, d);
      s += l;
      s2 += l * l;
    }
    const double mean = s / n_sample_keys;
    std_sum += std::sqrt(std::max(1e-12, s2 / n_sample_keys - mean * mean));
  }
  const float scale = static_cast<float>(o.logit_std / (std_sum / n_sample_q));
  for (float& x : out->prefill_queries) x *= scale;
  for (float& x : out->decode_queries) x *= scale;
}

// The average probe query's logit against the unit vector u: the logit a key
// gains per unit of u (u is the query bias, which RoPE barely rotates).
double MeanLogitAlong(const Vec& u, const LogitProbe& probe, int d) {
  double along = 0;
  for (const float* q : probe.queries) along += Logit(q, u.data(), d);
  along /= static_cast<int>(probe.queries.size());
  return along;
}

// Heavy hitters (as H2O observes): a query-independent key term h_t * u with
// h_t ~ Exp(1) - 1, giving logit std heavy_hitter_std for the average query.
// Sinks are skipped: PlantSinks overwrites them.
void AddHeavyHitters(const SyntheticOptions& o, const Vec& u, double along,
                     const std::vector<double>& inv_freq, Random& rng, std::vector<float>* keys) {
  if (!(o.heavy_hitter_std > 0 && along > 1e-6)) return;
  const int d = o.head_dim;
  const int64_t T = o.n_tokens + o.n_decode_steps;
  std::exponential_distribution<float> expo(1.0f);
  Vec u_rot(d);
  for (int64_t t = o.n_sinks; t < T; ++t) {
    u_rot = u;
    if (o.rope_theta > 0) ApplyRope(u_rot.data(), d, static_cast<double>(t), inv_freq);
    const float h = static_cast<float>(o.heavy_hitter_std / along) * (expo(rng.engine) - 1.0f);
    Eigen::Map<Vec>(keys->data() + t * d, d) += h * u_rot;
  }
}

// Attention sinks: keys 0..n_sinks-1 become (nearly) kappa * u, sized so their
// logit is sink_boost above the mean logit of the probe (heavy hitters
// included); without a usable common direction, kappa falls back to key_rms.
void PlantSinks(const SyntheticOptions& o, const Vec& u, double along, double key_rms,
                const LogitProbe& probe, const std::vector<double>& inv_freq, Random& rng,
                std::vector<float>* keys) {
  if (o.n_sinks == 0) return;
  const int d = o.head_dim;
  const int64_t n_sample_keys = static_cast<int64_t>(probe.keys.size());
  const int n_sample_q = static_cast<int>(probe.queries.size());
  double mean_logit = 0;
  for (const float* q : probe.queries) {
    double s = 0;
    for (int64_t k : probe.keys) s += Logit(q, keys->data() + k * d, d);
    mean_logit += s / n_sample_keys;
  }
  mean_logit /= n_sample_q;
  const float kappa = along > 1e-6 ? static_cast<float>((mean_logit + o.sink_boost) / along)
                                   : static_cast<float>(key_rms);
  for (int t = 0; t < o.n_sinks; ++t) {
    Eigen::Map<Vec> k(keys->data() + static_cast<int64_t>(t) * d, d);
    k = kappa * u;
    for (int j = 0; j < d; ++j)
      k[j] += 0.02f * kappa * rng.Gauss() / std::sqrt(static_cast<float>(d));
    if (o.rope_theta > 0) ApplyRope(k.data(), d, t, inv_freq);
  }
}

// The first N positions are the context; the tail is appended during decode.
void SplitContextAndDecode(const KeyValues& kv, SyntheticHead* out) {
  const int64_t n = out->n_tokens * out->head_dim;
  out->keys.assign(kv.keys.begin(), kv.keys.begin() + n);
  out->values.assign(kv.values.begin(), kv.values.begin() + n);
  out->decode_keys.assign(kv.keys.begin() + n, kv.keys.end());
  out->decode_values.assign(kv.values.begin() + n, kv.values.end());
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
  RETURN_IF_ERROR(ValidateOptions(o));
  const int d = o.head_dim;
  const int64_t T = o.n_tokens + o.n_decode_steps;  // context + decode tokens
  const std::vector<double> inv_freq = RopeInvFreq(o);
  SyntheticHead out;
  out.n_tokens = o.n_tokens;
  out.head_dim = d;
  out.group_size = o.group_size;
  out.n_decode = o.n_decode_steps;

  // Every step below draws from rng: their order is part of the output.
  Random rng(o.seed);
  const Projections proj = SampleProjections(o, rng);
  const LatentModel latent = SampleLatentModel(o, T, rng);
  KeyValues kv = SampleKeysAndValues(o, T, proj, latent, rng);
  const Vec q_bias = SampleQueries(o, proj.Wq, latent, inv_freq, rng, &out);
  if (o.rope_theta > 0) RotateKeys(inv_freq, d, &kv.keys);

  const LogitProbe probe = SampleLogitProbe(o, out, rng);
  CalibrateLogitScale(o, probe, kv.keys, &out);
  const Vec u = q_bias.normalized();  // the common query direction
  const double along = MeanLogitAlong(u, probe, d);
  AddHeavyHitters(o, u, along, inv_freq, rng, &kv.keys);
  PlantSinks(o, u, along, kv.key_rms, probe, inv_freq, rng, &kv.keys);

  SplitContextAndDecode(kv, &out);
  return out;
}

}  // namespace ctxcache::index
