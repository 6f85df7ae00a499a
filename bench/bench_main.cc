// ctxcache-bench: benchmark and fidelity tools. Workloads (one subcommand
// each, registered by bench/*_bench.cc):
//   storage   RocksDB page store: write, warm/cold random page-table reads, codecs, fio baseline
//   index     CSAttention (and other methods) vs exact scan and FAISS IVF
//   fidelity  all methods at equal budget: recall, attention mass, output error
//   prefill   C++ prefill engine throughput and memory
//   trace     writes a .ctxtrace of a text with a model
//   e2e       decode steps through ctxcached on loopback
// Usage: ctxcache-bench <workload> [--quick] [options]; each prints one JSON
// object as the last line of stdout.
#include <cstdio>
#include <cstring>

#include "bench/bench_registry.h"

namespace ctxcache::bench {
std::map<std::string, BenchEntry>& BenchRegistry() {
  static auto* registry = new std::map<std::string, BenchEntry>();
  return *registry;
}
}  // namespace ctxcache::bench

int main(int argc, char** argv) {
  auto& registry = ctxcache::bench::BenchRegistry();
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fprintf(stderr, "usage: ctxcache-bench <workload> [--quick] [options]\nworkloads:\n");
    for (const auto& [name, entry] : registry) {
      std::fprintf(stderr, "  %-10s %s\n", name.c_str(), entry.description.c_str());
    }
    return argc < 2 ? 2 : 0;
  }
  auto it = registry.find(argv[1]);
  if (it == registry.end()) {
    std::fprintf(stderr, "ctxcache-bench: unknown workload '%s'; run with --help for the list\n",
                 argv[1]);
    return 2;
  }
  return it->second.fn(argc - 1, argv + 1);
}
