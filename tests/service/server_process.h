// ServerProcess: starts the real ctxcached (build/bin, or the directory
// given) as a child process on loopback with ephemeral ports, for the
// integration tests (no mocks) and the e2e bench (bench/e2e_bench.cc): the one
// place that spawns a server and waits for its port file.
// Header-only and std/POSIX-only, so tests/ and bench/ include it alike.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ctxcache::testing {

inline std::string BinDir() {
  const char* d = std::getenv("CTXCACHE_BIN_DIR");
  return d ? d : "build/bin";
}

inline std::string SourceDir() {
  const char* d = std::getenv("CTXCACHE_SOURCE_DIR");
  return d ? d : ".";
}

// A fresh temp directory removed on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ctxcache-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class ServerProcess {
 public:
  // bin_dir: the directory holding ctxcached (default BinDir()).
  explicit ServerProcess(std::string bin_dir = BinDir()) : bin_dir_(std::move(bin_dir)) {}
  ~ServerProcess() { Kill(); }

  // Starts ctxcached with --data-dir data_dir, ephemeral ports, and `extra`
  // flags; --listen and --metrics-listen default to 127.0.0.1:0 unless
  // `extra` sets them ("--metrics-listen", "" turns metrics off). Its
  // stdout+stderr go to log_path() (data_dir + ".log"). Returns false if it
  // exits or does not report its ports in time.
  bool Start(const std::string& data_dir, const std::vector<std::string>& extra = {},
             std::chrono::seconds timeout = std::chrono::seconds(30)) {
    log_path_ = data_dir + ".log";
    port_file_ = data_dir + ".ports";
    std::filesystem::remove(port_file_);
    std::vector<std::string> args = {bin_dir_ + "/ctxcached", "--data-dir", data_dir, "--port-file",
                                     port_file_};
    for (const char* flag : {"--metrics-listen", "--listen"}) {
      if (std::find(extra.begin(), extra.end(), flag) == extra.end()) {
        args.insert(args.end(), {flag, "127.0.0.1:0"});
      }
    }
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = Spawn(args, log_path_);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_status_ = status;
        pid_ = -1;
        return false;
      }
      std::ifstream f(port_file_);
      if (f >> port_ >> metrics_port_) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // Sends `sig` and waits up to `timeout`; returns the exit code, or -1 on
  // timeout / abnormal exit.
  int Stop(int sig = SIGTERM, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    if (pid_ <= 0)
      return exit_status_ >= 0 && WIFEXITED(exit_status_) ? WEXITSTATUS(exit_status_) : -1;
    kill(pid_, sig);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        exit_status_ = status;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  std::string log() const { return ReadFile(log_path_); }

  // Runs argv to completion with stdout+stderr captured; returns exit code.
  static int RunCapture(const std::vector<std::string>& args, std::string* output,
                        std::chrono::seconds timeout = std::chrono::seconds(60)) {
    std::string path =
        (std::filesystem::temp_directory_path() /
         ("ctxcache-run-" + std::to_string(getpid()) + "-" + std::to_string(counter_++)))
            .string();
    pid_t pid = Spawn(args, path);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (true) {
      if (waitpid(pid, &status, WNOHANG) == pid) break;
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        *output = ReadFile(path);
        std::filesystem::remove(path);
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    *output = ReadFile(path);
    std::filesystem::remove(path);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  static pid_t Spawn(const std::vector<std::string>& args, const std::string& out_path) {
    pid_t pid = fork();
    if (pid == 0) {
      int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> argv;
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    return pid;
  }

  static inline int counter_ = 0;
  std::string bin_dir_;
  pid_t pid_ = -1;
  int exit_status_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string log_path_;
  std::string port_file_;
};

}  // namespace ctxcache::testing
