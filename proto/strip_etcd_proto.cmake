# Copies one etcd v3 .proto (Debian golang-etcd-server-dev) to OUT with the
# gogoproto and google.api (grpc-gateway) imports and options removed: they
# only steer Go code generation and the HTTP gateway, and Debian ships no
# C++ for them. The wire format is unchanged.
#   cmake -DIN=<src.proto> -DOUT=<dst.proto> -P strip_etcd_proto.cmake
file(READ "${IN}" text)
string(REGEX REPLACE "import \"gogoproto/gogo.proto\";" "" text "${text}")
string(REGEX REPLACE "import \"google/api/annotations.proto\";" "" text "${text}")
string(REGEX REPLACE "option \\(gogoproto\\.[a-z_]+\\) = [a-z]+;" "" text "${text}")
string(REGEX REPLACE "\\[\\(gogoproto\\.[a-z_]+\\) = [^]]*\\]" "" text "${text}")
# (one level of nested braces: additional_bindings { ... })
string(REGEX REPLACE "option \\(google\\.api\\.http\\) = {([^{}]|{[^{}]*})*};" "" text "${text}")
if(text MATCHES "gogoproto|google\\.api")
  message(FATAL_ERROR "strip_etcd_proto: ${IN} still mentions gogoproto or google.api")
endif()
file(WRITE "${OUT}.tmp" "${text}")
file(RENAME "${OUT}.tmp" "${OUT}")
