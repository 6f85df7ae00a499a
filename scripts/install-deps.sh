#!/usr/bin/env bash
# Installs ctxcache's build and test dependencies from Debian 12 packages.
# Idempotent: packages already present are skipped. Must run as root (or via sudo).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  librocksdb-dev libzstd-dev liblz4-dev libsnappy-dev libbz2-dev zlib1g-dev
  libeigen3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libsentencepiece-dev sentencepiece
  nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev prometheus-cpp-dev
  libfaiss-dev libopenblas-dev
  fio curl procps xz-utils shellcheck
  etcd-server etcd-client golang-etcd-server-dev
  python3-grpcio python3-protobuf python3-numpy python3-crc32c python3-pytest python3-venv
  python3-setuptools python3-wheel
  python3-sentencepiece
  python3-matplotlib linux-perf python3-torch python3-yaml
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install-deps: need root to install: ${missing[*]}" >&2
    echo "install-deps: re-run as root (or install sudo)" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${#missing[@]} package(s): ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: done"
