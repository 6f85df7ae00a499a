// Registry of ctxcache-bench subcommands. Each bench/*_bench.cc registers
// itself with CTXCACHE_BENCH("name", "one-line description", RunFn), where
// RunFn is `int(int argc, char** argv)`; argv[0] is the subcommand name.
// Every bench prints one JSON object as the last line of stdout.
#pragma once

#include <functional>
#include <map>
#include <string>

namespace ctxcache::bench {

using BenchFn = std::function<int(int argc, char** argv)>;

struct BenchEntry {
  std::string description;
  BenchFn fn;
};

std::map<std::string, BenchEntry>& BenchRegistry();

struct BenchRegistrar {
  BenchRegistrar(const char* name, const char* description, BenchFn fn) {
    BenchRegistry()[name] = BenchEntry{description, std::move(fn)};
  }
};

}  // namespace ctxcache::bench

#define CTXCACHE_BENCH_CONCAT2_(a, b) a##b
#define CTXCACHE_BENCH_CONCAT_(a, b) CTXCACHE_BENCH_CONCAT2_(a, b)
#define CTXCACHE_BENCH(name, description, fn)                                                  \
  static ::ctxcache::bench::BenchRegistrar CTXCACHE_BENCH_CONCAT_(bench_registrar_, __LINE__)( \
      name, description, fn)
