// main() for the fuzz targets in the default (non-libFuzzer) build: replays
// every file of the given corpus directories (or files), then runs N inputs
// mutated from them with a fixed-seed PRNG (byte flips, random bytes,
// truncations, insertions, deletions, duplicated chunks, splices of two
// inputs), so CI exercises each decoder on hostile bytes without clang.
//
// Usage: TARGET [-runs=N] [-seed=S] [-max_len=BYTES] CORPUS_DIR_OR_FILE...
// Flags spell like libFuzzer's so one ctest command line fits both builds;
// other -flags are ignored. Exit 0 when every input returned; a crash or a
// sanitizer report ends the process as it would under libFuzzer. An empty
// corpus is an error (exit 2): the seeds are missing.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"

namespace {

using Bytes = std::vector<uint8_t>;

bool ReadFile(const std::filesystem::path& p, Bytes* out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

void RunOne(const Bytes& b) {
  // A copy of exactly size bytes, so ASan sees reads past the input's end.
  std::unique_ptr<uint8_t[]> copy(new uint8_t[b.size() + 1]);
  if (!b.empty()) std::memcpy(copy.get(), b.data(), b.size());
  LLVMFuzzerTestOneInput(b.empty() ? nullptr : copy.get(), b.size());
}

Bytes Mutate(const std::vector<Bytes>& corpus, std::mt19937_64& rng, size_t max_len) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  Bytes b = corpus[pick(corpus.size())];
  const int n_mutations = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < n_mutations; ++i) {
    switch (rng() % 8) {
      case 0:  // flip one bit
        if (!b.empty()) b[pick(b.size())] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:  // random byte
        if (!b.empty()) b[pick(b.size())] = static_cast<uint8_t>(rng());
        break;
      case 2:  // interesting value (0, 0xff, 0x7f, 0x80) over 1..8 bytes
        if (!b.empty()) {
          static const uint8_t kValues[] = {0x00, 0xff, 0x7f, 0x80};
          size_t at = pick(b.size()), len = std::min<size_t>(1 + rng() % 8, b.size() - at);
          std::fill_n(b.begin() + at, len, kValues[rng() % 4]);
        }
        break;
      case 3:  // truncate
        b.resize(pick(b.size() + 1));
        break;
      case 4: {  // insert random bytes
        size_t at = pick(b.size() + 1), len = 1 + rng() % 16;
        Bytes ins(len);
        for (auto& c : ins) c = static_cast<uint8_t>(rng());
        b.insert(b.begin() + at, ins.begin(), ins.end());
        break;
      }
      case 5:  // delete a range
        if (!b.empty()) {
          size_t at = pick(b.size()), len = std::min<size_t>(1 + rng() % 32, b.size() - at);
          b.erase(b.begin() + at, b.begin() + at + len);
        }
        break;
      case 6:  // duplicate a chunk in place
        if (!b.empty()) {
          size_t at = pick(b.size()), len = std::min<size_t>(1 + rng() % 64, b.size() - at);
          Bytes chunk(b.begin() + at, b.begin() + at + len);
          b.insert(b.begin() + pick(b.size() + 1), chunk.begin(), chunk.end());
        }
        break;
      default: {  // splice: our head, another input's tail
        const Bytes& other = corpus[pick(corpus.size())];
        size_t cut = pick(b.size() + 1), from = pick(other.size() + 1);
        b.resize(cut);
        b.insert(b.end(), other.begin() + from, other.end());
        break;
      }
    }
  }
  if (b.size() > max_len) b.resize(max_len);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  long long runs = 1000;
  unsigned long long seed = 1;
  size_t max_len = size_t{1} << 20;
  std::vector<Bytes> corpus;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("-runs=", 0) == 0) {
      runs = std::stoll(a.substr(6));
    } else if (a.rfind("-seed=", 0) == 0) {
      seed = std::stoull(a.substr(6));
    } else if (a.rfind("-max_len=", 0) == 0) {
      max_len = std::stoull(a.substr(9));
    } else if (!a.empty() && a[0] == '-') {
      continue;  // a libFuzzer flag this driver does not need
    } else if (std::filesystem::is_directory(a)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(a)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());  // a fixed order: runs are reproducible
      for (const auto& f : files) {
        Bytes b;
        if (ReadFile(f, &b)) corpus.push_back(std::move(b));
      }
    } else {
      Bytes b;
      if (!ReadFile(a, &b)) {
        std::fprintf(stderr, "%s: cannot read %s\n", argv[0], a.c_str());
        return 2;
      }
      corpus.push_back(std::move(b));
    }
  }
  if (corpus.empty()) {
    std::fprintf(stderr, "%s: empty corpus (generate the seeds first: ctxcache_fuzz_seeds)\n",
                 argv[0]);
    return 2;
  }
  for (const Bytes& b : corpus) RunOne(b);
  RunOne({});
  std::mt19937_64 rng(seed);
  for (long long i = 0; i < runs; ++i) RunOne(Mutate(corpus, rng, max_len));
  std::printf("%s: %zu corpus inputs and %lld mutations ran (seed %llu)\n", argv[0], corpus.size(),
              runs, seed);
  return 0;
}
