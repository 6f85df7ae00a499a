// Runs a `ctxcache-bench` workload from a test and returns the JSON object
// that every bench prints as its last stdout line.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace ctxcache::testing {

struct BenchRun {
  int status = -1;         // pclose status; 0 = the bench exited 0
  std::string output;      // everything it printed on stdout
  std::string last_line;   // its last non-empty line
  nlohmann::json json;     // last_line parsed (discarded, not an object, if unparsable)
};

// Runs `command` through the shell (popen) and reads its whole stdout.
inline BenchRun RunBench(const std::string& command) {
  BenchRun r;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  r.status = pclose(p);
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) r.last_line = line;
  }
  r.json = nlohmann::json::parse(r.last_line, nullptr, /*allow_exceptions=*/false);
  return r;
}

}  // namespace ctxcache::testing
