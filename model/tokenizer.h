// Tokenizer: a sentencepiece model (`tokenizer.model`) behind a small
// interface. sentencepiece_processor.h is included only by spm_plugin.cc,
// which includes no gRPC/absl header (DESIGN §10: the Debian 0.1.97 header
// clashes with abseil).
//
// Encode does not add BOS/EOS; callers prepend bos_id() when the model wants
// it. Token ids are accepted directly everywhere else, so a tokenizer is
// optional for the engine.
//
// Thread-safety: a loaded Tokenizer is safe for concurrent Encode/Decode.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ctxcache::model {

class Tokenizer {
 public:
  // NotFound if the file is missing; InvalidArgument if it is not a valid
  // sentencepiece model.
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  Status Encode(std::string_view text, std::vector<int32_t>* ids) const;
  // InvalidArgument naming the first id outside [0, vocab_size()).
  Status Decode(const std::vector<int32_t>& ids, std::string* text) const;

  int vocab_size() const;
  int32_t bos_id() const;  // -1 if the model has none
  int32_t eos_id() const;  // -1 if the model has none
  // The piece string of one id ("" if out of range).
  std::string IdToPiece(int32_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxcache::model
