// A minimal HTTP/1.1 GET over a plain socket on 127.0.0.1, for tests of the
// metrics endpoint (no HTTP client library in the test dependencies).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace ctxcache::testing {

// One HTTP/1.1 GET over a plain socket; the whole response (head and body),
// or "" when the connection fails. The server closes after each response.
// `header`: one extra request header line without CRLF ("" = none).
inline std::string HttpGet(int port, const std::string& path, const std::string& header = "") {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" +
                    (header.empty() ? "" : header + "\r\n") + "\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return "";
  }
  std::string resp;
  char buf[4096];
  for (;;) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, 5000) <= 0) break;  // a hung server fails the test, not the run
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return resp;
}

}  // namespace ctxcache::testing
