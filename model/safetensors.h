// Reader for the safetensors format (8-byte LE header length, JSON header,
// raw little-endian tensor bytes), memory-mapped read-only, plus the sharded
// `model.safetensors.index.json` layout of HF model directories.
//
// Ownership: a SafetensorsFile owns its mapping; TensorView pointers stay
// valid while the file object lives. SafetensorsSet owns its files.
// Thread-safety: read-only after Open; safe for concurrent use.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace ctxcache::model {

enum class TensorDType { kF32, kF16, kBF16, kI64, kI32 };
std::string_view TensorDTypeName(TensorDType t);
size_t TensorDTypeSize(TensorDType t);

struct TensorView {
  std::string name;
  TensorDType dtype = TensorDType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping
  size_t nbytes = 0;
  int64_t numel() const;
  // "[a, b]"
  std::string ShapeString() const;
};

class SafetensorsFile {
 public:
  // NotFound if missing; DataLoss if the header or a tensor extends past the
  // end of the file (truncated), or the header is not valid JSON;
  // InvalidArgument for an unsupported dtype or inconsistent shape/offsets.
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // NotFound naming the tensor and the file.
  StatusOr<const TensorView*> Get(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a model directory: `model.safetensors`, or the shards named
// by `model.safetensors.index.json` ("weight_map": name -> file).
class SafetensorsSet {
 public:
  static StatusOr<std::unique_ptr<SafetensorsSet>> OpenDir(const std::string& dir);
  // Opens one file (e.g. golden.safetensors).
  static StatusOr<std::unique_ptr<SafetensorsSet>> OpenFile(const std::string& path);

  bool Has(const std::string& name) const { return index_.count(name) != 0; }
  StatusOr<const TensorView*> Get(const std::string& name) const;
  // Names in sorted order.
  std::vector<std::string> Names() const;

  // Reads a tensor as fp32 (from f32/f16/bf16), checking the shape.
  // InvalidArgument naming the tensor and both shapes on a mismatch.
  Status ReadF32(const std::string& name, const std::vector<int64_t>& expected_shape,
                 std::vector<float>* out) const;
  // Reads an integer tensor (I64 or I32) of any shape.
  Status ReadI64(const std::string& name, std::vector<int64_t>* out) const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

// Writes tensors (fp32 or i64 data) to a safetensors file; used by tests to
// build fixtures and by tools. Tensors are written in name order.
struct TensorToWrite {
  std::string name;
  TensorDType dtype = TensorDType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;  // raw little-endian data
};
Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);

}  // namespace ctxcache::model
