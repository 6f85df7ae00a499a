#include "model/trace.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/crc32c.h"

namespace ctxcache::model {

namespace {

constexpr char kMagic[8] = {'C', 'T', 'X', 'T', 'R', 'A', 'C', 'E'};

bool Ascending(const std::vector<int>& v, int limit) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] >= limit) return false;
    if (i > 0 && v[i] <= v[i - 1]) return false;
  }
  return true;
}

class CrcWriter {
 public:
  explicit CrcWriter(std::ofstream* out) : out_(out) {}
  void Write(const void* p, size_t n) {
    crc_ = crc32c::Extend(crc_, p, n);
    out_->write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
  }
  void WriteFloats(const float* x, size_t n, DType dtype) {
    if (dtype == DType::kF32) {
      Write(x, n * 4);
      return;
    }
    constexpr size_t kBlock = 1 << 16;
    std::vector<uint8_t> buf(kBlock * 2);
    for (size_t i = 0; i < n; i += kBlock) {
      const size_t m = std::min(kBlock, n - i);
      ConvertFromFloat(dtype, x + i, buf.data(), m);
      Write(buf.data(), m * 2);
    }
  }
  uint32_t crc() const { return crc_; }

 private:
  std::ofstream* out_;
  uint32_t crc_ = 0;
};

}  // namespace

int Trace::LayerSlot(int layer) const {
  auto it = std::find(layers.begin(), layers.end(), layer);
  return it == layers.end() ? -1 : static_cast<int>(it - layers.begin());
}

int Trace::KvHeadSlot(int kv_head) const {
  auto it = std::find(kv_heads.begin(), kv_heads.end(), kv_head);
  return it == kv_heads.end() ? -1 : static_cast<int>(it - kv_heads.begin());
}

Status Trace::Validate() const {
  if (n_layers_total <= 0) return InvalidArgumentError("trace: n_layers_total must be > 0");
  if (n_q_heads <= 0 || n_kv_heads <= 0 || n_q_heads % n_kv_heads != 0) {
    return InvalidArgumentError("trace: n_q_heads must be a positive multiple of n_kv_heads");
  }
  if (head_dim <= 0) return InvalidArgumentError("trace: head_dim must be > 0");
  if (!Ascending(layers, n_layers_total)) {
    return InvalidArgumentError(
        "trace: 'layers' must be ascending, unique, in [0, n_layers_total)");
  }
  if (kv_heads.empty() || !Ascending(kv_heads, n_kv_heads)) {
    return InvalidArgumentError(
        "trace: 'kv_heads' must be non-empty, ascending, in [0, n_kv_heads)");
  }
  for (size_t i = 0; i < q_positions.size(); ++i) {
    if (q_positions[i] < 0 || q_positions[i] >= n_tokens() ||
        (i > 0 && q_positions[i] <= q_positions[i - 1])) {
      return InvalidArgumentError("trace: 'q_positions' must be ascending, unique, in [0, T)");
    }
  }
  if (q.size() != layers.size() || k.size() != layers.size() || v.size() != layers.size()) {
    return InvalidArgumentError("trace: q/k/v need one array per stored layer");
  }
  const size_t qn = static_cast<size_t>(n_stored_q_heads()) * n_q_rows() * head_dim;
  const size_t kn = static_cast<size_t>(n_stored_kv_heads()) * n_tokens() * head_dim;
  for (size_t s = 0; s < layers.size(); ++s) {
    if (q[s].size() != qn) {
      return InvalidArgumentError("trace: q[" + std::to_string(s) + "] has " +
                                  std::to_string(q[s].size()) + " floats, expected " +
                                  std::to_string(qn));
    }
    if (k[s].size() != kn || v[s].size() != kn) {
      return InvalidArgumentError("trace: k/v[" + std::to_string(s) + "] must have " +
                                  std::to_string(kn) + " floats");
    }
  }
  return Status::OK();
}

Status WriteTrace(const std::string& path, const Trace& trace, DType dtype) {
  RETURN_IF_ERROR(trace.Validate());
  nlohmann::json h = {{"n_tokens", trace.n_tokens()},
                      {"n_layers_total", trace.n_layers_total},
                      {"n_q_heads", trace.n_q_heads},
                      {"n_kv_heads", trace.n_kv_heads},
                      {"head_dim", trace.head_dim},
                      {"rope_theta", trace.rope_theta},
                      {"model_fingerprint", trace.model_fingerprint},
                      {"dtype", std::string(DTypeName(dtype))},
                      {"layers", trace.layers},
                      {"kv_heads", trace.kv_heads},
                      {"n_q_rows", trace.n_q_rows()}};
  const std::string header = h.dump();
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) return UnavailableError("trace: cannot create " + tmp);
  out.write(kMagic, 8);
  const uint32_t version = kTraceFormatVersion, hlen = static_cast<uint32_t>(header.size());
  out.write(reinterpret_cast<const char*>(&version), 4);
  out.write(reinterpret_cast<const char*>(&hlen), 4);
  CrcWriter w(&out);
  w.Write(header.data(), header.size());
  w.Write(trace.tokens.data(), trace.tokens.size() * 4);
  w.Write(trace.q_positions.data(), trace.q_positions.size() * 8);
  for (size_t s = 0; s < trace.layers.size(); ++s) {
    w.WriteFloats(trace.q[s].data(), trace.q[s].size(), dtype);
    w.WriteFloats(trace.k[s].data(), trace.k[s].size(), dtype);
    w.WriteFloats(trace.v[s].data(), trace.v[s].size(), dtype);
  }
  const uint32_t crc = w.crc();
  out.write(reinterpret_cast<const char*>(&crc), 4);
  out.close();
  if (!out) return UnavailableError("trace: write failed for " + tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return UnavailableError("trace: rename to " + path + " failed: " + ec.message());
  return Status::OK();
}

StatusOr<Trace> ReadTrace(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return NotFoundError("trace file not found: " + path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return UnavailableError("trace: cannot open " + path);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string where = "trace " + path + ": ";
  if (data.size() < 20 || std::memcmp(data.data(), kMagic, 8) != 0) {
    return DataLossError(where + "bad magic (expected \"CTXTRACE\") or file too short");
  }
  uint32_t version, hlen;
  std::memcpy(&version, data.data() + 8, 4);
  std::memcpy(&hlen, data.data() + 12, 4);
  if (version != kTraceFormatVersion) {
    return InvalidArgumentError(where + "unsupported format version " + std::to_string(version) +
                                " (expected " + std::to_string(kTraceFormatVersion) + ")");
  }
  if (16 + static_cast<size_t>(hlen) + 4 > data.size()) {
    return DataLossError(where + "truncated header");
  }
  const size_t body_end = data.size() - 4;
  uint32_t stored_crc;
  std::memcpy(&stored_crc, data.data() + body_end, 4);
  nlohmann::json h = nlohmann::json::parse(data.data() + 16, data.data() + 16 + hlen, nullptr,
                                           /*allow_exceptions=*/false);
  if (h.is_discarded() || !h.is_object()) return DataLossError(where + "header is not valid JSON");
  Trace t;
  DType dtype;
  int64_t n_tokens = 0, n_q_rows = 0;
  try {
    n_tokens = h.at("n_tokens").get<int64_t>();
    t.n_layers_total = h.at("n_layers_total").get<int>();
    t.n_q_heads = h.at("n_q_heads").get<int>();
    t.n_kv_heads = h.at("n_kv_heads").get<int>();
    t.head_dim = h.at("head_dim").get<int>();
    t.rope_theta = h.value("rope_theta", 0.0);
    t.model_fingerprint = h.value("model_fingerprint", std::string());
    t.layers = h.at("layers").get<std::vector<int>>();
    t.kv_heads = h.at("kv_heads").get<std::vector<int>>();
    n_q_rows = h.at("n_q_rows").get<int64_t>();
    auto dt = ParseDType(h.at("dtype").get<std::string>());
    if (!dt.ok()) return dt.status().WithContext(where + "field 'dtype'");
    dtype = *dt;
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(where + "bad header field: " + e.what());
  }
  if (n_tokens < 0 || n_q_rows < 0 || n_q_rows > n_tokens || t.head_dim <= 0 || t.n_kv_heads <= 0 ||
      t.n_q_heads <= 0 || t.n_q_heads % t.n_kv_heads != 0) {
    return InvalidArgumentError(where + "inconsistent header dims");
  }
  // The sizes the header implies, checked for overflow: a hostile header may
  // name counts whose byte sizes wrap size_t and "match" a small file.
  bool overflow = false;
  auto mul = [&overflow](size_t a, size_t b) {
    size_t r = 0;
    overflow |= __builtin_mul_overflow(a, b, &r);
    return r;
  };
  auto add = [&overflow](size_t a, size_t b) {
    size_t r = 0;
    overflow |= __builtin_add_overflow(a, b, &r);
    return r;
  };
  const size_t es = DTypeSize(dtype);
  const size_t group = static_cast<size_t>(t.n_q_heads / t.n_kv_heads);
  const size_t qn = mul(mul(mul(t.kv_heads.size(), group), static_cast<size_t>(n_q_rows)),
                        static_cast<size_t>(t.head_dim));
  const size_t kn =
      mul(mul(t.kv_heads.size(), static_cast<size_t>(n_tokens)), static_cast<size_t>(t.head_dim));
  const size_t tensors = mul(mul(t.layers.size(), add(qn, mul(2, kn))), es);
  const size_t need = add(add(add(add(size_t{16} + hlen, mul(static_cast<size_t>(n_tokens), 4)),
                                  mul(static_cast<size_t>(n_q_rows), 8)),
                              tensors),
                          4);
  if (overflow) {
    return DataLossError(where + "header sizes overflow (n_tokens " + std::to_string(n_tokens) +
                         ", n_q_rows " + std::to_string(n_q_rows) + ")");
  }
  if (data.size() < need) {
    return DataLossError(where + "truncated: " + std::to_string(data.size()) +
                         " bytes, header implies " + std::to_string(need));
  }
  if (data.size() != need) {
    return DataLossError(where + "size " + std::to_string(data.size()) +
                         " != " + std::to_string(need) + " implied by the header");
  }
  const uint32_t crc = crc32c::Value(data.data() + 16, body_end - 16);
  if (crc != stored_crc) return DataLossError(where + "checksum mismatch");
  const char* p = data.data() + 16 + hlen;
  t.tokens.resize(n_tokens);
  std::memcpy(t.tokens.data(), p, n_tokens * 4);
  p += n_tokens * 4;
  t.q_positions.resize(n_q_rows);
  std::memcpy(t.q_positions.data(), p, n_q_rows * 8);
  p += n_q_rows * 8;
  auto read = [&](size_t n, std::vector<float>* out) {
    out->resize(n);
    ConvertToFloat(dtype, p, out->data(), n);
    p += n * es;
  };
  t.q.resize(t.layers.size());
  t.k.resize(t.layers.size());
  t.v.resize(t.layers.size());
  for (size_t s = 0; s < t.layers.size(); ++s) {
    read(qn, &t.q[s]);
    read(kn, &t.k[s]);
    read(kn, &t.v[s]);
  }
  RETURN_IF_ERROR(t.Validate().WithContext(where));
  return t;
}

}  // namespace ctxcache::model
