// libctxcache_spm.so: the sentencepiece plugin. The ONLY translation unit
// that includes sentencepiece_processor.h; it includes no gRPC/absl header.
//
// Why a plugin: Debian's libsentencepiece.so.0 (0.1.97) exports its own
// bundled copy of protobuf-lite (~1300 google::protobuf symbols). Linked into
// a process that also loads libprotobuf.so (gRPC, our protos), whichever
// library loads first interposes the other's symbols, and ctxcached crashed
// in libprotobuf's static initialisers. model/tokenizer.cc therefore dlopens
// this plugin with RTLD_LOCAL | RTLD_DEEPBIND, so sentencepiece binds to its
// own protobuf and never leaks into the global symbol scope.
//
// The interface is plain C; buffers returned by the plugin are malloc'd and
// released with ctxcache_spm_free_buffer.
#include <sentencepiece_processor.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

void SetError(char* err, size_t err_len, const std::string& msg) {
  if (err == nullptr || err_len == 0) return;
  std::strncpy(err, msg.c_str(), err_len - 1);
  err[err_len - 1] = '\0';
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* ctxcache_spm_load(const char* path, char* err,
                                                               size_t err_len) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const auto st = sp->Load(path);
  if (!st.ok()) {
    SetError(err, err_len, st.ToString());
    delete sp;
    return nullptr;
  }
  return sp;
}

__attribute__((visibility("default"))) void ctxcache_spm_free(void* handle) {
  delete static_cast<sentencepiece::SentencePieceProcessor*>(handle);
}

__attribute__((visibility("default"))) void ctxcache_spm_free_buffer(void* buf) { std::free(buf); }

// Returns 0 on success; *ids (malloc'd, *n entries) on success.
__attribute__((visibility("default"))) int ctxcache_spm_encode(void* handle, const char* text,
                                                               size_t len, int32_t** ids, size_t* n,
                                                               char* err, size_t err_len) {
  auto* sp = static_cast<sentencepiece::SentencePieceProcessor*>(handle);
  std::vector<int> out;
  const auto st = sp->Encode(std::string_view(text, len), &out);
  if (!st.ok()) {
    SetError(err, err_len, st.ToString());
    return 1;
  }
  *n = out.size();
  *ids = static_cast<int32_t*>(std::malloc(std::max<size_t>(1, out.size()) * sizeof(int32_t)));
  for (size_t i = 0; i < out.size(); ++i) (*ids)[i] = out[i];
  return 0;
}

__attribute__((visibility("default"))) int ctxcache_spm_decode(void* handle, const int32_t* ids,
                                                               size_t n, char** text, size_t* len,
                                                               char* err, size_t err_len) {
  auto* sp = static_cast<sentencepiece::SentencePieceProcessor*>(handle);
  std::vector<int> in(ids, ids + n);
  std::string out;
  const auto st = sp->Decode(in, &out);
  if (!st.ok()) {
    SetError(err, err_len, st.ToString());
    return 1;
  }
  *len = out.size();
  *text = static_cast<char*>(std::malloc(out.size() + 1));
  std::memcpy(*text, out.data(), out.size());
  (*text)[out.size()] = '\0';
  return 0;
}

__attribute__((visibility("default"))) int ctxcache_spm_piece_size(void* handle) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->GetPieceSize();
}

__attribute__((visibility("default"))) int ctxcache_spm_bos_id(void* handle) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->bos_id();
}

__attribute__((visibility("default"))) int ctxcache_spm_eos_id(void* handle) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->eos_id();
}

// Returns a malloc'd NUL-terminated piece string.
__attribute__((visibility("default"))) char* ctxcache_spm_id_to_piece(void* handle, int id) {
  std::string piece = static_cast<sentencepiece::SentencePieceProcessor*>(handle)->IdToPiece(id);
  char* out = static_cast<char*>(std::malloc(piece.size() + 1));
  std::memcpy(out, piece.c_str(), piece.size() + 1);
  return out;
}

}  // extern "C"
