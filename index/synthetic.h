// Deterministic synthetic Q/K/V for one (layer, kv head) with the structure
// sparse-attention indexes meet in real models (CSAttention §2, DESIGN §9):
//   - a shared latent per token: a topic (segments of ~mean_segment tokens,
//     Zipf topic popularity) + a token-type embedding (Zipf vocabulary) + a
//     little noise + a slowly varying local AR term,
//     so keys are clustered and neighbours are similar (recency/locality);
//   - keys and queries are DIFFERENT projections of that latent (the query
//     projection has extra energy outside the key span and its own bias), so
//     Q and K are distribution-shifted (CSAttention §2.4);
//   - queries look for their own topic or, with retrieval_prob, for the topic
//     of a random earlier segment (long-range retrieval);
//   - per-token salience (log-normal key scale) and a query-independent
//     heavy-hitter term along the common query direction give heavy-tailed
//     attention; query-specific logits are scaled to a target std;
//   - the first n_sinks tokens are attention sinks with huge scores;
//   - optional RoPE (HF rotate_half) at the token positions, with semantic
//     energy concentrated in the low-frequency dims.
// Prefill queries (for building) and decode queries (for evaluation, at
// positions n_tokens + t, never seen by the builder) come from the same
// process; decode_keys/values are the tokens appended during decode, so a
// streaming user appends decode_keys[t] after step t. Decode queries are
// temporally correlated (shared local term, segment structure).
//
// Thread-safety: GenerateSyntheticHead is reentrant; results are values.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "index/selector.h"

namespace ctxcache::index {

struct SyntheticOptions {
  // Context length N. Default: 8192.
  int64_t n_tokens = 8192;
  // Head dimension d (even when rope_theta > 0). Default: 128.
  int head_dim = 128;
  // q heads per kv head (GQA group). Default: 4.
  int group_size = 4;
  // Prefill query rows per q head (evenly spaced positions, <= N). Default: 16384.
  int64_t n_prefill_queries = 16384;
  // Decode steps (queries at positions N..N+steps-1). Default: 64.
  int n_decode_steps = 64;
  // Everything is a function of this seed. Default: 1.
  uint64_t seed = 1;

  // --- structure ---
  int latent_dim = 32;          // shared latent size. Default: 32.
  double spectrum_decay = 1.0;  // latent coordinate i is scaled by (1+i)^-decay
                                // (power-law spectrum, as in trained activations). Default: 1.
  int n_topics = 128;           // topic clusters. Default: 128.
  double latent_noise = 0.5;    // per-token free latent noise. Default: 0.5.
  double local_std = 0.7;       // std of the slowly varying local AR(0.98) latent term
                                // (content locality). Default: 0.7.
  int vocab_size = 0;           // >0: token types (Zipf) whose embedding joins the latent
                                // (token identity), with less free noise. Default: 0 (off).
  double mean_segment = 64;     // mean tokens per topic segment. Default: 64.
  double retrieval_prob = 0.5;  // P(query targets an earlier segment's topic). Default: 0.5.
  double logit_std = 2.5;       // target std of q.k/sqrt(d) over keys. Default: 2.5.
  double salience_sigma = 0.4;  // log-normal key-scale sigma (heavy tail). Default: 0.4.
  double heavy_hitter_std =
      0.0;          // std of a query-independent, exponentially distributed
                    // per-key logit term (heavy hitters, as H2O observes). Default: 0 (off).
  int n_sinks = 4;  // sink tokens at positions 0..n_sinks-1. Default: 4.
  double sink_boost = 10.0;      // sink logit above the mean logit. Default: 10.
  double rope_theta = 500000.0;  // RoPE base; 0 disables. Default: 500000 (Llama 3).
};

struct SyntheticHead {
  int64_t n_tokens = 0;
  int head_dim = 0;
  int group_size = 0;
  std::vector<float> keys;                 // n_tokens x d
  std::vector<float> values;               // n_tokens x d
  std::vector<int64_t> prefill_positions;  // n_prefill, ascending
  std::vector<float> prefill_queries;      // [G][n_prefill][d]
  int n_decode = 0;
  std::vector<float> decode_queries;  // [step][G][d]
  std::vector<float> decode_keys;     // [step][d]: token appended after step t
  std::vector<float> decode_values;   // [step][d]

  int64_t n_prefill() const { return static_cast<int64_t>(prefill_positions.size()); }
  // A HeadPrefill view (pointers into this object).
  HeadPrefill Prefill() const;
  // The G query vectors of decode step t (G * d floats).
  const float* DecodeQueries(int t) const {
    return decode_queries.data() + static_cast<size_t>(t) * group_size * head_dim;
  }
};

StatusOr<SyntheticHead> GenerateSyntheticHead(const SyntheticOptions& options);

}  // namespace ctxcache::index
