// Client::StartIngest's stream (client/sdk/ingest.h).
#include "client/sdk/ingest.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "client/sdk/channel.h"
#include "client/sdk/layout.h"
#include "client/sdk/retry.h"
#include "common/dtype.h"
#include "proto/dtype_convert.h"

namespace ctxcache::client::internal {

namespace {

// One tensor of the layout (K, V or Q) with 0 strides made dense.
struct Region {
  const char* base;
  int64_t head_stride;
  int64_t token_stride;
  uint32_t n_heads;
};

Status CheckRegion(const char* name, const void* p, size_t capacity, int64_t head_stride,
                   int64_t token_stride, uint32_t n_heads, uint64_t n_tokens, size_t row,
                   const char* head_field, const char* token_field) {
  if (p == nullptr) return InvalidArgumentError(std::string("layout.") + name + ": null buffer");
  if (head_stride < 0) {
    return InvalidArgumentError(std::string("layout.") + head_field + ": " +
                                std::to_string(head_stride) + ", expected >= 0");
  }
  if (token_stride != 0 && token_stride < static_cast<int64_t>(row)) {
    return InvalidArgumentError(std::string("layout.") + token_field + ": " +
                                std::to_string(token_stride) + ", expected 0 or >= " +
                                std::to_string(row) + " (head_dim * element size)");
  }
  const int64_t ts = token_stride == 0 ? static_cast<int64_t>(row) : token_stride;
  const int64_t hs = head_stride == 0 ? ts * static_cast<int64_t>(n_tokens) : head_stride;
  const unsigned __int128 need = StridedExtent({{n_heads, hs}, {n_tokens, ts}}, row);
  if (need > capacity) {
    return InvalidArgumentError(std::string("layout.") + name + "_capacity: " +
                                std::to_string(capacity) + " bytes, expected >= " +
                                ExtentString(need) + " for " + std::to_string(n_heads) +
                                " heads x " + std::to_string(n_tokens) +
                                " tokens at the layout's strides");
  }
  return Status::OK();
}

Region MakeRegion(const void* p, int64_t head_stride, int64_t token_stride, uint32_t n_heads,
                  uint64_t n_tokens, size_t row) {
  const int64_t ts = token_stride == 0 ? static_cast<int64_t>(row) : token_stride;
  const int64_t hs = head_stride == 0 ? ts * static_cast<int64_t>(n_tokens) : head_stride;
  return {static_cast<const char*>(p), hs, ts, n_heads};
}

// Tokens [t0, t0 + n) of every head of `r`, as [heads][n][row] into `out`.
void Gather(const Region& r, uint64_t t0, uint64_t n, size_t row, v1::Tensor* out) {
  std::string* data = out->mutable_data();
  data->resize(static_cast<size_t>(r.n_heads) * n * row);
  char* dst = data->data();
  for (uint32_t h = 0; h < r.n_heads; ++h) {
    const char* src = r.base + h * r.head_stride + static_cast<int64_t>(t0) * r.token_stride;
    if (r.token_stride == static_cast<int64_t>(row)) {
      std::memcpy(dst, src, n * row);
      dst += n * row;
      continue;
    }
    for (uint64_t t = 0; t < n; ++t, dst += row, src += r.token_stride) std::memcpy(dst, src, row);
  }
}

class IngestStreamImpl final : public IngestStream {
 public:
  IngestStreamImpl(const ClientOptions& client, const IngestShape& shape,
                   const IngestOptions& options)
      : client_(client), shape_(shape), options_(options) {}

  ~IngestStreamImpl() override {
    if (writer_ && !finished_) {
      ctx_.TryCancel();  // the server stores nothing without IngestCommit
      writer_->Finish().ok();
    }
  }

  Status Open(v1::ContextAdmin::Stub* admin, const v1::IngestHeader& header) {
    AddCallCredentials(client_, &ctx_);
    const double timeout =
        options_.timeout_s > 0 ? options_.timeout_s : std::max(client_.timeout_s, 3600.0);
    ctx_.set_deadline(DeadlineAfter(timeout));
    writer_ = admin->IngestContext(&ctx_, &response_);
    v1::IngestChunk msg;
    *msg.mutable_header() = header;
    if (!writer_->Write(msg)) return Fail();
    return Status::OK();
  }

  Status WriteLayer(uint32_t layer, const IngestLayerLayout& layout) override {
    if (!failed_.ok()) return failed_;
    if (finished_) return FailedPreconditionError("the ingest was committed");
    if (layer != next_layer_) {
      return InvalidArgumentError("layer: " + std::to_string(layer) + ", expected " +
                                  std::to_string(next_layer_) + " (layers come in order)");
    }
    RETURN_IF_ERROR(CheckIngestLayout(shape_, layout));
    const size_t row = shape_.head_dim * DTypeSize(*FromProtoDType(layout.dtype));
    const Region k = MakeRegion(layout.k, layout.head_stride, layout.token_stride,
                                shape_.n_kv_heads, shape_.n_tokens, row);
    const Region v = MakeRegion(layout.v, layout.head_stride, layout.token_stride,
                                shape_.n_kv_heads, shape_.n_tokens, row);
    const bool has_q = layout.q != nullptr;
    const Region q = MakeRegion(layout.q, layout.q_head_stride, layout.q_token_stride,
                                shape_.n_q_heads, shape_.n_tokens, row);
    const uint64_t per_token =
        (2 * uint64_t{shape_.n_kv_heads} + (has_q ? shape_.n_q_heads : 0)) * row;
    const uint64_t budget = options_.frame_bytes > 4096 ? options_.frame_bytes - 4096 : 1;
    const uint64_t step = std::max<uint64_t>(1, budget / per_token);
    v1::IngestChunk msg;
    v1::IngestLayerChunk* c = msg.mutable_chunk();
    c->set_layer(layer);
    for (v1::Tensor* t : {c->mutable_k(), c->mutable_v()}) t->set_dtype(layout.dtype);
    if (has_q) c->mutable_q()->set_dtype(layout.dtype);
    for (uint64_t t0 = 0; t0 < shape_.n_tokens; t0 += step) {
      const uint64_t n = std::min(step, shape_.n_tokens - t0);
      c->set_token_start(shape_.token_start + t0);
      c->set_n_tokens(static_cast<uint32_t>(n));
      SetShape(c->mutable_k(), shape_.n_kv_heads, n);
      SetShape(c->mutable_v(), shape_.n_kv_heads, n);
      Gather(k, t0, n, row, c->mutable_k());
      Gather(v, t0, n, row, c->mutable_v());
      if (has_q) {
        SetShape(c->mutable_q(), shape_.n_q_heads, n);
        Gather(q, t0, n, row, c->mutable_q());
      }
      if (!writer_->Write(msg)) return Fail();
    }
    ++next_layer_;
    return Status::OK();
  }

  StatusOr<v1::ContextInfo> Commit() override {
    if (!failed_.ok()) return failed_;
    if (finished_) return FailedPreconditionError("the ingest was committed");
    if (next_layer_ != shape_.n_layers) {
      return FailedPreconditionError("Commit after " + std::to_string(next_layer_) +
                                     " layers, the model has " +
                                     std::to_string(shape_.n_layers));
    }
    v1::IngestChunk msg;
    msg.mutable_commit();
    if (!writer_->Write(msg)) return Fail();
    writer_->WritesDone();
    finished_ = true;
    grpc::Status s = writer_->Finish();
    if (!s.ok()) return failed_ = Convert(s);
    return response_;
  }

 private:
  void SetShape(v1::Tensor* t, uint32_t heads, uint64_t n) {
    t->clear_shape();
    t->add_shape(heads);
    t->add_shape(static_cast<int64_t>(n));
    t->add_shape(shape_.head_dim);
  }

  Status Convert(const grpc::Status& s) const {
    return FromGrpcCall(client_, s, "IngestContext");
  }

  // A refused Write: the stream is over; its status says why.
  Status Fail() {
    finished_ = true;
    grpc::Status s = writer_->Finish();
    failed_ = s.ok() ? InternalError("IngestContext: the server ended the stream early")
                     : Convert(s);
    return failed_;
  }

  const ClientOptions client_;
  const IngestShape shape_;
  const IngestOptions options_;
  grpc::ClientContext ctx_;
  v1::ContextInfo response_;
  std::unique_ptr<grpc::ClientWriter<v1::IngestChunk>> writer_;
  uint32_t next_layer_ = 0;
  bool finished_ = false;
  Status failed_;
};

}  // namespace

Status CheckIngestLayout(const IngestShape& shape, const IngestLayerLayout& layout) {
  auto dtype = FromProtoDType(layout.dtype);
  if (!dtype.ok()) {
    return InvalidArgumentError("layout.dtype: " + std::to_string(layout.dtype) +
                                ", expected f32, f16 or bf16");
  }
  const size_t row = shape.head_dim * DTypeSize(*dtype);
  RETURN_IF_ERROR(CheckRegion("k", layout.k, layout.k_capacity, layout.head_stride,
                              layout.token_stride, shape.n_kv_heads, shape.n_tokens, row,
                              "head_stride", "token_stride"));
  RETURN_IF_ERROR(CheckRegion("v", layout.v, layout.v_capacity, layout.head_stride,
                              layout.token_stride, shape.n_kv_heads, shape.n_tokens, row,
                              "head_stride", "token_stride"));
  if (layout.q != nullptr) {
    RETURN_IF_ERROR(CheckRegion("q", layout.q, layout.q_capacity, layout.q_head_stride,
                                layout.q_token_stride, shape.n_q_heads, shape.n_tokens, row,
                                "q_head_stride", "q_token_stride"));
  }
  return Status::OK();
}

StatusOr<std::unique_ptr<IngestStream>> OpenIngest(const ClientOptions& client,
                                                   v1::ContextAdmin::Stub* admin,
                                                   const v1::IngestHeader& header,
                                                   const IngestShape& shape,
                                                   const IngestOptions& options) {
  if (options.frame_bytes == 0) {
    return InvalidArgumentError("options.frame_bytes: 0, expected > 0");
  }
  auto s = std::make_unique<IngestStreamImpl>(client, shape, options);
  RETURN_IF_ERROR(s->Open(admin, header));
  return std::unique_ptr<IngestStream>(std::move(s));
}

}  // namespace ctxcache::client::internal
