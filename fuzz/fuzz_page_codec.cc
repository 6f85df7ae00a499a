// Fuzz target: the KV page decoder (storage/page_codec.h). Pages come from
// disk (and, as bytes, from FetchPages clients verify the same way).
#include <cstring>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "storage/page_codec.h"

using namespace ctxcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view encoded = fuzz::AsView(data, size);
  storage::PageHeader header;
  Status parsed = storage::ParsePageHeader(encoded, &header);
  // A small fixed buffer: pages larger than it must be INVALID_ARGUMENT.
  static std::vector<uint8_t> small(4096);
  storage::PageHeader h2;
  Status small_status = storage::DecodePage(encoded, small.data(), small.size(), &h2);
  if (parsed.ok() && header.raw_bytes <= (8u << 20)) {
    std::vector<uint8_t> dst(header.raw_bytes);
    storage::PageHeader h3;
    Status st = storage::DecodePage(encoded, dst.data(), dst.size(), &h3);
    if (st.ok()) {
      // A decoded page re-encodes with its own codec and decodes to the same bytes.
      std::string re;
      storage::PageCodecOptions opt;
      opt.codec = h3.codec;
      if (!storage::EncodePage(opt, h3.shape, fuzz::AsView(dst.data(), dst.size()), &re).ok()) {
        std::abort();
      }
      std::vector<uint8_t> back(dst.size());
      storage::PageHeader h4;
      if (!storage::DecodePage(re, back.data(), back.size(), &h4).ok() ||
          std::memcmp(back.data(), dst.data(), dst.size()) != 0) {
        std::abort();
      }
    }
  }
  return 0;
}
