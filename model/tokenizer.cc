// Tokenizer over the sentencepiece plugin (model/spm_plugin.cc), loaded with
// dlopen; see the plugin's file comment for why sentencepiece is isolated.
#include "model/tokenizer.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#ifndef CTXCACHE_SPM_PLUGIN_INSTALL_PATH
#define CTXCACHE_SPM_PLUGIN_INSTALL_PATH "/usr/local/lib/ctxcache/libctxcache_spm.so"
#endif

namespace ctxcache::model {

namespace {

constexpr const char* kPluginName = "libctxcache_spm.so";

struct PluginApi {
  void* (*load)(const char*, char*, size_t) = nullptr;
  void (*free_handle)(void*) = nullptr;
  void (*free_buffer)(void*) = nullptr;
  int (*encode)(void*, const char*, size_t, int32_t**, size_t*, char*, size_t) = nullptr;
  int (*decode)(void*, const int32_t*, size_t, char**, size_t*, char*, size_t) = nullptr;
  int (*piece_size)(void*) = nullptr;
  int (*bos_id)(void*) = nullptr;
  int (*eos_id)(void*) = nullptr;
  char* (*id_to_piece)(void*, int) = nullptr;
};

std::vector<std::string> PluginCandidates() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("CTXCACHE_SPM_PLUGIN")) out.push_back(env);
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto dir = exe.parent_path();
    out.push_back((dir / kPluginName).string());
    out.push_back((dir / ".." / "lib" / kPluginName).string());
    out.push_back((dir / ".." / "lib" / "ctxcache" / kPluginName).string());
  }
  out.push_back(CTXCACHE_SPM_PLUGIN_INSTALL_PATH);
  out.push_back(kPluginName);  // the dynamic loader's search path
  return out;
}

// Loads the plugin once per process.
StatusOr<const PluginApi*> GetPlugin() {
  static std::once_flag once;
  static PluginApi api;
  static Status load_status;
  std::call_once(once, [] {
    int flags = RTLD_NOW | RTLD_LOCAL;
#if !defined(__SANITIZE_ADDRESS__)
    // Sanitizer runtimes refuse RTLD_DEEPBIND; sanitizer builds only use the
    // tokenizer in processes without libprotobuf, where it is not needed.
    flags |= RTLD_DEEPBIND;
#endif
    void* lib = nullptr;
    std::string tried;
    for (const auto& path : PluginCandidates()) {
      lib = dlopen(path.c_str(), flags);
      if (lib) break;
      tried += "\n  " + path + ": " + dlerror();
    }
    if (!lib) {
      load_status = FailedPreconditionError(
          std::string("cannot load the sentencepiece plugin ") + kPluginName +
          " (build target ctxcache_spm, or set CTXCACHE_SPM_PLUGIN); tried:" + tried);
      return;
    }
    auto sym = [&](const char* name, auto* fn) {
      *reinterpret_cast<void**>(fn) = dlsym(lib, name);
      return *fn != nullptr;
    };
    bool ok = sym("ctxcache_spm_load", &api.load) && sym("ctxcache_spm_free", &api.free_handle) &&
              sym("ctxcache_spm_free_buffer", &api.free_buffer) &&
              sym("ctxcache_spm_encode", &api.encode) && sym("ctxcache_spm_decode", &api.decode) &&
              sym("ctxcache_spm_piece_size", &api.piece_size) &&
              sym("ctxcache_spm_bos_id", &api.bos_id) && sym("ctxcache_spm_eos_id", &api.eos_id) &&
              sym("ctxcache_spm_id_to_piece", &api.id_to_piece);
    if (!ok) load_status = FailedPreconditionError("sentencepiece plugin is missing symbols");
  });
  if (!load_status.ok()) return load_status;
  return &api;
}

}  // namespace

struct Tokenizer::Impl {
  const PluginApi* api = nullptr;
  void* handle = nullptr;
  int piece_size = 0;
  ~Impl() {
    if (handle) api->free_handle(handle);
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    return NotFoundError("tokenizer model not found: " + path);
  ASSIGN_OR_RETURN(const PluginApi* api, GetPlugin());
  char err[512] = {0};
  void* handle = api->load(path.c_str(), err, sizeof(err));
  if (!handle) {
    return InvalidArgumentError("cannot load sentencepiece model " + path + ": " + err);
  }
  auto impl = std::make_unique<Impl>();
  impl->api = api;
  impl->handle = handle;
  impl->piece_size = api->piece_size(handle);
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

Status Tokenizer::Encode(std::string_view text, std::vector<int32_t>* ids) const {
  int32_t* buf = nullptr;
  size_t n = 0;
  char err[512] = {0};
  if (impl_->api->encode(impl_->handle, text.data(), text.size(), &buf, &n, err, sizeof(err))) {
    return InternalError(std::string("sentencepiece encode failed: ") + err);
  }
  ids->assign(buf, buf + n);
  impl_->api->free_buffer(buf);
  return Status::OK();
}

Status Tokenizer::Decode(const std::vector<int32_t>& ids, std::string* text) const {
  const int n = impl_->piece_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= n) {
      return InvalidArgumentError("token id " + std::to_string(ids[i]) + " at index " +
                                  std::to_string(i) + " outside [0, " + std::to_string(n) + ")");
    }
  }
  char* buf = nullptr;
  size_t len = 0;
  char err[512] = {0};
  if (impl_->api->decode(impl_->handle, ids.data(), ids.size(), &buf, &len, err, sizeof(err))) {
    return InternalError(std::string("sentencepiece decode failed: ") + err);
  }
  text->assign(buf, len);
  impl_->api->free_buffer(buf);
  return Status::OK();
}

int Tokenizer::vocab_size() const { return impl_->piece_size; }
int32_t Tokenizer::bos_id() const { return impl_->api->bos_id(impl_->handle); }
int32_t Tokenizer::eos_id() const { return impl_->api->eos_id(impl_->handle); }
std::string Tokenizer::IdToPiece(int32_t id) const {
  if (id < 0 || id >= impl_->piece_size) return "";
  char* p = impl_->api->id_to_piece(impl_->handle, id);
  std::string out(p);
  impl_->api->free_buffer(p);
  return out;
}

}  // namespace ctxcache::model
