#include "service/wire.h"

#include "common/crc32c.h"
#include "common/dtype.h"
#include "proto/dtype_convert.h"

namespace ctxcache::service {

StatusOr<storage::ContextId> ParseContextId(const std::string& hex, const char* field) {
  if (hex.empty()) {
    return InvalidArgumentError(std::string(field) + " is required (32 hex characters)");
  }
  auto id = storage::ContextId::FromHex(hex);
  if (!id.ok()) {
    return InvalidArgumentError(std::string(field) + " '" + Clip(hex) +
                                "' is not 32 hex characters");
  }
  return *id;
}

std::string Clip(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  return std::string(s.substr(0, max_bytes)) + "...";
}

Status ValidateText(std::string_view value, const char* field, size_t max_bytes) {
  if (value.size() > max_bytes) {
    return InvalidArgumentError(std::string(field) + ": at most " + std::to_string(max_bytes) +
                                " bytes, got " + std::to_string(value.size()));
  }
  for (unsigned char c : value) {
    if (c < 0x20 || c == 0x7f) {
      return InvalidArgumentError(std::string(field) +
                                  ": control characters (NUL, newline, ...) are not allowed");
    }
  }
  return Status::OK();
}

Status ValidateLabels(const google::protobuf::Map<std::string, std::string>& labels,
                      const char* field) {
  if (labels.size() > kMaxLabels) {
    return InvalidArgumentError(std::string(field) + ": at most " + std::to_string(kMaxLabels) +
                                " labels, got " + std::to_string(labels.size()));
  }
  for (const auto& [k, v] : labels) {
    if (k.empty()) return InvalidArgumentError(std::string(field) + ": empty label key");
    RETURN_IF_ERROR(ValidateText(k, field, kMaxLabelKeyBytes));
    RETURN_IF_ERROR(ValidateText(v, field, kMaxLabelValueBytes));
  }
  return Status::OK();
}

Status ValidateTtl(int64_t ttl_seconds, const char* field) {
  if (ttl_seconds < 0 || ttl_seconds > kMaxTtlSeconds) {
    return InvalidArgumentError(std::string(field) + ": expected 0 (server default) to " +
                                std::to_string(kMaxTtlSeconds) + " seconds, got " +
                                std::to_string(ttl_seconds));
  }
  return Status::OK();
}

v1::ContextInfo ManifestToInfo(const v1::ContextManifest& m) {
  v1::ContextInfo info;
  auto id = storage::ContextId::FromBytes(m.context_id());
  if (id.ok()) info.set_context_id(id->ToHex());
  info.set_name(m.name());
  info.set_state(m.state());
  info.set_model_name(m.model().name());
  *info.mutable_model() = m.model();
  info.set_n_tokens(m.n_tokens());
  info.set_block_tokens(m.block_tokens());
  *info.mutable_indexes() = m.index_params();
  uint64_t index_bytes = 0;
  for (const auto& a : m.artifacts()) {
    std::string kind = a.name();
    auto slash = kind.find('/');
    if (slash != std::string::npos) kind = kind.substr(0, slash);
    (*info.mutable_bytes_by_kind())["index/" + kind] += a.size_bytes();
    index_bytes += a.size_bytes();
  }
  uint64_t page_bytes = m.stored_bytes() > index_bytes ? m.stored_bytes() - index_bytes : 0;
  (*info.mutable_bytes_by_kind())["pages"] = page_bytes;
  info.set_stored_bytes(m.stored_bytes());
  info.set_raw_kv_bytes(m.raw_kv_bytes());
  info.set_created_at_ms(m.created_at_ms());
  info.set_last_access_ms(m.last_access_ms());
  info.set_expires_at_ms(m.expires_at_ms());
  info.set_pinned(m.pinned());
  info.set_tenant(m.tenant());
  info.set_provenance(m.provenance());
  info.set_shared(m.shared());
  *info.mutable_labels() = m.labels();
  if (!m.parent_id().empty()) {
    auto pid = storage::ContextId::FromBytes(m.parent_id());
    if (pid.ok()) info.set_parent_id(pid->ToHex());
  }
  info.set_prefix_tokens(m.prefix_tokens());
  return info;
}

v1::BuildProgress ProgressToProto(const BuildProgress& p) {
  v1::BuildProgress out;
  switch (p.phase) {
    case BuildProgress::Phase::kQueued:
      out.set_phase(v1::BuildProgress::QUEUED);
      break;
    case BuildProgress::Phase::kPrefill:
      out.set_phase(v1::BuildProgress::PREFILL);
      break;
    case BuildProgress::Phase::kIndexing:
      out.set_phase(v1::BuildProgress::INDEXING);
      break;
    case BuildProgress::Phase::kCommitting:
      out.set_phase(v1::BuildProgress::COMMITTING);
      break;
    case BuildProgress::Phase::kDone:
      out.set_phase(v1::BuildProgress::DONE);
      break;
  }
  out.set_tokens_total(p.tokens_total);
  out.set_tokens_prefilled(p.tokens_prefilled);
  out.set_layers_total(p.layers_total);
  out.set_layers_indexed(p.layers_indexed);
  out.set_bytes_written(p.bytes_written);
  out.set_tokens_per_s(p.tokens_per_s);
  out.set_eta_s(p.eta_s);
  out.set_queue_position(p.queue_position);
  return out;
}

namespace {

// Checks t's shape, dtype and byte count; *n_out = elements, *dtype_out = its dtype.
Status CheckTensor(const v1::Tensor& t, const std::vector<int64_t>& shape, const char* what,
                   int64_t* n_out, DType* dtype_out) {
  std::string want = "[";
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    want += (i ? ", " : "") + std::to_string(shape[i]);
    n *= shape[i];
  }
  want += "]";
  bool shape_ok = t.shape_size() == static_cast<int>(shape.size());
  for (int i = 0; shape_ok && i < t.shape_size(); ++i) shape_ok = t.shape(i) == shape[i];
  if (!shape_ok) {
    std::string got = "[";
    for (int i = 0; i < t.shape_size(); ++i) got += (i ? ", " : "") + std::to_string(t.shape(i));
    return InvalidArgumentError(std::string(what) + ": shape " + got + "], expected " + want);
  }
  auto dtype = FromProtoDType(t.dtype());
  if (!dtype.ok()) return dtype.status().WithContext(what);
  const DType dt = *dtype;
  if (t.data().size() != static_cast<size_t>(n) * DTypeSize(dt)) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(t.data().size()) +
                                " data bytes, expected " + std::to_string(n * DTypeSize(dt)) +
                                " for shape " + want + " in " + std::string(DTypeName(dt)));
  }
  *n_out = n;
  *dtype_out = dt;
  return Status::OK();
}

}  // namespace

Status TensorToFloat(const v1::Tensor& t, const std::vector<int64_t>& shape, const char* what,
                     std::vector<float>* out) {
  int64_t n = 0;
  DType dt = DType::kF32;
  RETURN_IF_ERROR(CheckTensor(t, shape, what, &n, &dt));
  out->resize(static_cast<size_t>(n));
  ConvertToFloat(dt, t.data().data(), out->data(), static_cast<size_t>(n));
  if (HasNonFinite(out->data(), out->size())) {
    return InvalidArgumentError(std::string(what) + " contains NaN or Inf");
  }
  return Status::OK();
}

Status CheckStoredTensor(const v1::Tensor& t, const std::vector<int64_t>& shape, DType dtype,
                         const char* what) {
  int64_t n = 0;
  DType dt = DType::kF32;
  RETURN_IF_ERROR(CheckTensor(t, shape, what, &n, &dt));
  if (dt != dtype) {
    return InvalidArgumentError(std::string(what) + ": dtype " + std::string(DTypeName(dt)) +
                                ", expected " + std::string(DTypeName(dtype)));
  }
  if (HasNonFinite(dt, t.data().data(), static_cast<size_t>(n))) {
    return InvalidArgumentError(std::string(what) + " contains NaN or Inf");
  }
  return Status::OK();
}

v1::Page StoredPageToProto(const storage::PageBatch& batch, size_t i, uint32_t layer,
                           uint32_t kv_head) {
  v1::Page page;
  page.set_layer(layer);
  page.set_kv_head(kv_head);
  page.set_block(batch.blocks[i]);
  page.set_n_tokens(batch.n_tokens[i]);
  page.set_dtype(ToProtoDType(batch.dtype));
  const size_t bytes = size_t{batch.n_tokens[i]} * batch.head_dim * DTypeSize(batch.dtype);
  page.set_k(reinterpret_cast<const char*>(batch.K(i)), bytes);
  page.set_v(reinterpret_cast<const char*>(batch.V(i)), bytes);
  page.set_crc32c(batch.crc32c[i]);  // as stored, verified by the read
  return page;
}

v1::Page DecodedPageToProto(const session::DecodedPage& p, uint32_t head_dim, uint32_t layer,
                            uint32_t kv_head, uint32_t block) {
  const size_t n = size_t{p.n_tokens} * head_dim;
  std::string k(n * 2, '\0'), v(n * 2, '\0');
  FloatToBf16(p.k.data(), reinterpret_cast<uint16_t*>(k.data()), n);
  FloatToBf16(p.v.data(), reinterpret_cast<uint16_t*>(v.data()), n);
  v1::Page page;
  page.set_layer(layer);
  page.set_kv_head(kv_head);
  page.set_block(block);
  page.set_n_tokens(p.n_tokens);
  page.set_dtype(v1::DTYPE_BF16);
  page.set_crc32c(crc32c::Value(k, v));
  page.set_k(std::move(k));
  page.set_v(std::move(v));
  return page;
}

bool PageBatcher::Add(v1::Page&& page) {
  if (corrupt_ && !page.k().empty()) (*page.mutable_k())[0] ^= 0x01;
  const size_t sz = page.k().size() + page.v().size();
  if (current_.pages_size() > 0 && current_bytes_ + sz > max_bytes_) {
    if (!sink_(std::move(current_))) return false;
    current_ = v1::PageBatch();
    current_bytes_ = 0;
  }
  current_bytes_ += sz;
  *current_.add_pages() = std::move(page);
  return true;
}

bool PageBatcher::Finish() {
  current_.set_last(true);
  return sink_(std::move(current_));
}

}  // namespace ctxcache::service
