#include "model/kv_cache.h"

#include <algorithm>
#include <cstring>

namespace ctxcache::model {

KvCache::KvCache(int n_layers, int n_kv_heads, int head_dim, DType dtype)
    : n_layers_(n_layers),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      dtype_(dtype),
      elem_(DTypeSize(dtype)),
      len_(n_layers, 0),
      k_(static_cast<size_t>(n_layers) * n_kv_heads),
      v_(static_cast<size_t>(n_layers) * n_kv_heads) {}

int64_t KvCache::n_tokens() const {
  if (len_.empty()) return 0;
  return *std::min_element(len_.begin(), len_.end());
}

void KvCache::Reserve(int64_t n_tokens) {
  const size_t bytes = static_cast<size_t>(n_tokens) * head_dim_ * elem_;
  for (auto& b : k_) b.reserve(bytes);
  for (auto& b : v_) b.reserve(bytes);
}

void KvCache::Append(int layer, int n, const float* k, const float* v, int64_t row_stride) {
  const int d = head_dim_;
  const size_t row_bytes = static_cast<size_t>(d) * elem_;
  for (int h = 0; h < n_kv_heads_; ++h) {
    auto& kb = k_[Slot(layer, h)];
    auto& vb = v_[Slot(layer, h)];
    const size_t off = static_cast<size_t>(len_[layer]) * row_bytes;
    kb.resize(off + n * row_bytes);
    vb.resize(off + n * row_bytes);
    for (int t = 0; t < n; ++t) {
      const float* ks = k + t * row_stride + h * d;
      const float* vs = v + t * row_stride + h * d;
      ConvertFromFloat(dtype_, ks, kb.data() + off + t * row_bytes, d);
      ConvertFromFloat(dtype_, vs, vb.data() + off + t * row_bytes, d);
    }
  }
  len_[layer] += n;
}

void KvCache::ReadRows(const std::vector<uint8_t>& buf, int64_t row, int64_t n, float* out) const {
  const size_t row_bytes = static_cast<size_t>(head_dim_) * elem_;
  ConvertToFloat(dtype_, buf.data() + row * row_bytes, out, static_cast<size_t>(n) * head_dim_);
}

void KvCache::Read(int layer, int kv_head, int64_t begin, int64_t end, float* k_out,
                   float* v_out) const {
  if (end <= begin) return;
  if (k_out) ReadRows(k_[Slot(layer, kv_head)], begin, end - begin, k_out);
  if (v_out) ReadRows(v_[Slot(layer, kv_head)], begin, end - begin, v_out);
}

void KvCache::Gather(int layer, int kv_head, const int32_t* ids, int64_t n, float* k_out,
                     float* v_out) const {
  const auto& kb = k_[Slot(layer, kv_head)];
  const auto& vb = v_[Slot(layer, kv_head)];
  for (int64_t i = 0; i < n; ++i) {
    if (k_out) ReadRows(kb, ids[i], 1, k_out + i * head_dim_);
    if (v_out) ReadRows(vb, ids[i], 1, v_out + i * head_dim_);
  }
}

const float* KvCache::KeysF32(int layer, int kv_head) const {
  return reinterpret_cast<const float*>(k_[Slot(layer, kv_head)].data());
}
const float* KvCache::ValuesF32(int layer, int kv_head) const {
  return reinterpret_cast<const float*>(v_[Slot(layer, kv_head)].data());
}

void KvCache::Truncate(int64_t n_tokens) {
  const size_t row_bytes = static_cast<size_t>(head_dim_) * elem_;
  for (int l = 0; l < n_layers_; ++l) {
    if (len_[l] <= n_tokens) continue;
    len_[l] = n_tokens;
    for (int h = 0; h < n_kv_heads_; ++h) {
      k_[Slot(l, h)].resize(n_tokens * row_bytes);
      v_[Slot(l, h)].resize(n_tokens * row_bytes);
    }
  }
}

uint64_t KvCache::MemoryBytes() const {
  uint64_t n = 0;
  for (const auto& b : k_) n += b.capacity();
  for (const auto& b : v_) n += b.capacity();
  return n;
}

}  // namespace ctxcache::model
