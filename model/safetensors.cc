#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/dtype.h"

namespace ctxcache::model {

namespace {

StatusOr<TensorDType> ParseTensorDType(const std::string& s) {
  if (s == "F32") return TensorDType::kF32;
  if (s == "F16") return TensorDType::kF16;
  if (s == "BF16") return TensorDType::kBF16;
  if (s == "I64") return TensorDType::kI64;
  if (s == "I32") return TensorDType::kI32;
  return InvalidArgumentError("unsupported safetensors dtype '" + s +
                              "' (expected F32, F16, BF16, I64 or I32)");
}

std::string ShapeStr(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace

std::string_view TensorDTypeName(TensorDType t) {
  switch (t) {
    case TensorDType::kF32:
      return "F32";
    case TensorDType::kF16:
      return "F16";
    case TensorDType::kBF16:
      return "BF16";
    case TensorDType::kI64:
      return "I64";
    case TensorDType::kI32:
      return "I32";
  }
  return "?";
}

size_t TensorDTypeSize(TensorDType t) {
  switch (t) {
    case TensorDType::kF32:
      return 4;
    case TensorDType::kF16:
      return 2;
    case TensorDType::kBF16:
      return 2;
    case TensorDType::kI64:
      return 8;
    case TensorDType::kI32:
      return 4;
  }
  return 0;
}

int64_t TensorView::numel() const {
  // A zero dimension first: the other dimensions' product may not fit (Open
  // checks that it does whenever the count is not 0).
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string TensorView::ShapeString() const { return ShapeStr(shape); }

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFoundError("safetensors file not found: " + path);
    return UnavailableError("cannot open " + path + ": " + std::strerror(errno));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return UnavailableError("cannot stat " + path + ": " + std::strerror(errno));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_size_ = static_cast<size_t>(st.st_size);
  if (f->map_size_ < 8) {
    ::close(fd);
    return DataLossError(path + ": truncated safetensors file (" + std::to_string(f->map_size_) +
                         " bytes, need at least 8 for the header length)");
  }
  void* m = mmap(nullptr, f->map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return UnavailableError("mmap failed for " + path);
  f->map_ = m;
  const uint8_t* base = static_cast<const uint8_t*>(m);
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  if (header_len > f->map_size_ - 8) {
    return DataLossError(path + ": truncated safetensors file: header length " +
                         std::to_string(header_len) + " exceeds file size " +
                         std::to_string(f->map_size_));
  }
  const size_t data_start = 8 + header_len;
  const size_t data_size = f->map_size_ - data_start;
  nlohmann::json header = nlohmann::json::parse(reinterpret_cast<const char*>(base + 8),
                                                reinterpret_cast<const char*>(base + data_start),
                                                nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return DataLossError(path + ": safetensors header is not a valid JSON object");
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const nlohmann::json& e = it.value();
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets") || !e["dtype"].is_string() || !e["shape"].is_array() ||
        !e["data_offsets"].is_array() || e["data_offsets"].size() != 2) {
      return InvalidArgumentError(path + ": tensor '" + name +
                                  "': header entry needs dtype, shape and data_offsets[2]");
    }
    TensorView v;
    v.name = name;
    auto dt = ParseTensorDType(e["dtype"].get<std::string>());
    if (!dt.ok()) return dt.status().WithContext(path + ": tensor '" + name + "'");
    v.dtype = *dt;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return InvalidArgumentError(path + ": tensor '" + name + "': bad shape entry");
      }
      v.shape.push_back(d.get<int64_t>());
    }
    const auto& off = e["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return InvalidArgumentError(path + ": tensor '" + name + "': bad data_offsets");
    }
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (en < b)
      return InvalidArgumentError(path + ": tensor '" + name + "': data_offsets reversed");
    if (en > data_size) {
      return DataLossError(path + ": truncated: tensor '" + name + "' ends at byte " +
                           std::to_string(en) + " of the data section but only " +
                           std::to_string(data_size) + " bytes are present");
    }
    v.nbytes = en - b;
    // The element count must fit int64 (numel()): a product that overflows is
    // no tensor, whatever its wrapped value would "need".
    int64_t numel = 1;
    bool overflow = false;
    for (int64_t s : v.shape) overflow |= __builtin_mul_overflow(numel, s, &numel);
    uint64_t need = 0;
    overflow |= __builtin_mul_overflow(static_cast<uint64_t>(numel),
                                       static_cast<uint64_t>(TensorDTypeSize(v.dtype)), &need);
    if (overflow && std::find(v.shape.begin(), v.shape.end(), 0) == v.shape.end()) {
      return InvalidArgumentError(path + ": tensor '" + name + "': shape " + v.ShapeString() +
                                  " has more elements than int64 holds");
    }
    if (overflow) need = 0;  // a zero dimension: no elements, whatever the others
    if (need != v.nbytes) {
      return InvalidArgumentError(path + ": tensor '" + name + "': shape " + v.ShapeString() +
                                  " x " + std::string(TensorDTypeName(v.dtype)) + " needs " +
                                  std::to_string(need) +
                                  " bytes but data_offsets span " + std::to_string(v.nbytes));
    }
    v.data = base + data_start + b;
    f->tensors_.emplace(name, std::move(v));
  }
  return f;
}

StatusOr<const TensorView*> SafetensorsFile::Get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return NotFoundError("missing tensor '" + name + "' in " + path_);
  return &it->second;
}

StatusOr<std::unique_ptr<SafetensorsSet>> SafetensorsSet::OpenFile(const std::string& path) {
  auto set = std::make_unique<SafetensorsSet>();
  ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
  for (const auto& [name, v] : f->tensors()) set->index_[name] = &v;
  set->files_.push_back(std::move(f));
  return set;
}

StatusOr<std::unique_ptr<SafetensorsSet>> SafetensorsSet::OpenDir(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string single = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(single, ec)) return OpenFile(single);
  if (!fs::exists(index_path, ec)) {
    return NotFoundError("no model.safetensors or model.safetensors.index.json in " + dir);
  }
  std::ifstream in(index_path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgumentError(index_path + ": not valid JSON");
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
    return InvalidArgumentError(index_path + ": missing object field 'weight_map'");
  }
  auto set = std::make_unique<SafetensorsSet>();
  std::map<std::string, SafetensorsFile*> opened;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return InvalidArgumentError(index_path + ": weight_map['" + it.key() + "'] is not a string");
    }
    const std::string shard = it.value().get<std::string>();
    if (shard.find('/') != std::string::npos) {
      return InvalidArgumentError(index_path + ": shard name '" + shard + "' must be a file name");
    }
    SafetensorsFile* f = nullptr;
    auto o = opened.find(shard);
    if (o == opened.end()) {
      ASSIGN_OR_RETURN(auto nf, SafetensorsFile::Open(dir + "/" + shard));
      f = nf.get();
      opened[shard] = f;
      set->files_.push_back(std::move(nf));
    } else {
      f = o->second;
    }
    auto t = f->Get(it.key());
    if (!t.ok()) return t.status().WithContext(index_path);
    set->index_[it.key()] = *t;
  }
  return set;
}

StatusOr<const TensorView*> SafetensorsSet::Get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return NotFoundError("missing tensor '" + name + "'");
  return it->second;
}

std::vector<std::string> SafetensorsSet::Names() const {
  std::vector<std::string> out;
  for (const auto& [n, v] : index_) out.push_back(n);
  return out;
}

Status SafetensorsSet::ReadF32(const std::string& name, const std::vector<int64_t>& expected_shape,
                               std::vector<float>* out) const {
  ASSIGN_OR_RETURN(const TensorView* v, Get(name));
  if (v->shape != expected_shape) {
    return InvalidArgumentError("shape mismatch for tensor '" + name + "': expected " +
                                ShapeStr(expected_shape) + ", found " + v->ShapeString());
  }
  const size_t n = static_cast<size_t>(v->numel());
  out->resize(n);
  switch (v->dtype) {
    case TensorDType::kF32:
      std::memcpy(out->data(), v->data, n * 4);
      return Status::OK();
    case TensorDType::kF16:
      HalfToFloat(reinterpret_cast<const uint16_t*>(v->data), out->data(), n);
      return Status::OK();
    case TensorDType::kBF16:
      Bf16ToFloat(reinterpret_cast<const uint16_t*>(v->data), out->data(), n);
      return Status::OK();
    default:
      return InvalidArgumentError("tensor '" + name + "' has dtype " +
                                  std::string(TensorDTypeName(v->dtype)) +
                                  "; expected F32, F16 or BF16");
  }
}

Status SafetensorsSet::ReadI64(const std::string& name, std::vector<int64_t>* out) const {
  ASSIGN_OR_RETURN(const TensorView* v, Get(name));
  const size_t n = static_cast<size_t>(v->numel());
  out->resize(n);
  if (v->dtype == TensorDType::kI64) {
    std::memcpy(out->data(), v->data, n * 8);
  } else if (v->dtype == TensorDType::kI32) {
    for (size_t i = 0; i < n; ++i) {
      int32_t x;
      std::memcpy(&x, v->data + 4 * i, 4);
      (*out)[i] = x;
    }
  } else {
    return InvalidArgumentError("tensor '" + name + "' has dtype " +
                                std::string(TensorDTypeName(v->dtype)) + "; expected I64 or I32");
  }
  return Status::OK();
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t off = 0;
  std::vector<const TensorToWrite*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) { return a->name < b->name; });
  for (const auto* t : sorted) {
    header[t->name] = {{"dtype", std::string(TensorDTypeName(t->dtype))},
                       {"shape", t->shape},
                       {"data_offsets", {off, off + t->bytes.size()}}};
    off += t->bytes.size();
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');
  std::ofstream outf(path, std::ios::binary | std::ios::trunc);
  if (!outf) return UnavailableError("cannot create " + path);
  uint64_t len = h.size();
  outf.write(reinterpret_cast<const char*>(&len), 8);
  outf.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto* t : sorted)
    outf.write(t->bytes.data(), static_cast<std::streamsize>(t->bytes.size()));
  outf.close();
  if (!outf) return UnavailableError("write failed for " + path);
  return Status::OK();
}

}  // namespace ctxcache::model
