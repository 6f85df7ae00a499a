#include "bench/workload.h"

#include <utility>

#include "model/trace.h"

namespace ctxcache::bench {

index::HeadPrefill Workload::Prefill() const {
  index::HeadPrefill p;
  p.n_tokens = n;
  p.head_dim = d;
  p.group_size = G;
  p.keys = keys.data();
  p.values = values.data();
  p.n_queries = static_cast<int64_t>(prefill_pos.size());
  p.query_positions = prefill_pos.data();
  p.queries = prefill_q.data();
  return p;
}

Workload FromSynthetic(index::SyntheticHead h) {
  Workload w;
  w.source = "synthetic";
  w.n = h.n_tokens;
  w.d = h.head_dim;
  w.G = h.group_size;
  w.keys = std::move(h.keys);
  w.keys.insert(w.keys.end(), h.decode_keys.begin(), h.decode_keys.end());
  w.values = std::move(h.values);
  w.values.insert(w.values.end(), h.decode_values.begin(), h.decode_values.end());
  w.n_all = w.n + h.n_decode;
  w.prefill_pos = std::move(h.prefill_positions);
  w.prefill_q = std::move(h.prefill_queries);
  for (int t = 0; t < h.n_decode; ++t) w.eval_pos.push_back(w.n + t);
  w.eval_q = std::move(h.decode_queries);
  return w;
}

StatusOr<Workload> FromTrace(const std::string& path, int layer_slot, int kv_slot, int eval_rows,
                             int min_prefill_rows, const std::string& eval_flag) {
  ASSIGN_OR_RETURN(model::Trace tr, model::ReadTrace(path));
  RETURN_IF_ERROR(tr.Validate());
  if (layer_slot < 0 || layer_slot >= static_cast<int>(tr.layers.size())) {
    return InvalidArgumentError("--layer-slot out of range: trace stores " +
                                std::to_string(tr.layers.size()) + " layers");
  }
  if (kv_slot < 0 || kv_slot >= tr.n_stored_kv_heads()) {
    return InvalidArgumentError("--kv-slot out of range: trace stores " +
                                std::to_string(tr.n_stored_kv_heads()) + " kv heads");
  }
  const int64_t rows = tr.n_q_rows();
  if (rows < static_cast<int64_t>(eval_rows) + min_prefill_rows) {
    return InvalidArgumentError("trace has " + std::to_string(rows) + " query rows; needs >= " +
                                eval_flag + " + " + std::to_string(min_prefill_rows) + " (" +
                                eval_flag + "=" + std::to_string(eval_rows) + ")");
  }
  Workload w;
  w.source = path;
  w.d = tr.head_dim;
  w.G = tr.group_size();
  w.n_all = tr.n_tokens();
  const float* k = tr.K(layer_slot, kv_slot);
  const float* v = tr.V(layer_slot, kv_slot);
  w.keys.assign(k, k + w.n_all * w.d);
  w.values.assign(v, v + w.n_all * w.d);
  const int64_t first_eval = rows - eval_rows;
  w.n = tr.q_positions[first_eval];
  if (w.n < 64) return InvalidArgumentError("trace: too few context tokens before the eval rows");
  for (int64_t r = 0; r < first_eval; ++r) w.prefill_pos.push_back(tr.q_positions[r]);
  for (int g = 0; g < w.G; ++g) {
    const float* q = tr.Q(layer_slot, kv_slot * w.G + g);
    w.prefill_q.insert(w.prefill_q.end(), q, q + first_eval * w.d);
  }
  for (int64_t r = first_eval; r < rows; ++r) {
    w.eval_pos.push_back(tr.q_positions[r]);
    for (int g = 0; g < w.G; ++g) {
      const float* q = tr.Q(layer_slot, kv_slot * w.G + g) + r * w.d;
      w.eval_q.insert(w.eval_q.end(), q, q + w.d);
    }
  }
  return w;
}

}  // namespace ctxcache::bench
