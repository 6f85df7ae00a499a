#!/usr/bin/env bash
# Builds fio from Debian 12's source package with only libaio (linked
# statically) and zlib, for hosts without fio: the GPU machine has none, and
# Debian's binary package pulls in Ceph, GlusterFS and RDMA libraries.
# scripts/pack-server.sh carries the result (CTXCACHE_PACK_FIO=1) for the
# data plane's cold-load baseline (python/bench/gpu_load.py).
# Needs a deb-src entry for bookworm (added here when missing, as root) and
# the build tools of scripts/install-deps.sh.
# Usage: scripts/build-fio.sh [OUT_DIR]   (default build/fio; prints the binary's path)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/build/fio}"
if [ -x "$out/fio" ]; then echo "$out/fio"; exit 0; fi
if ! apt-get source --download-only --print-uris fio >/dev/null 2>&1; then
  src=/etc/apt/sources.list.d/ctxcache-debian-src.sources
  sed -n '/^URIs:/{p;q}' /etc/apt/sources.list.d/debian.sources >"$src.uri"
  {
    echo "Types: deb-src"
    cat "$src.uri"
    echo "Suites: bookworm"
    echo "Components: main"
    echo "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
  } >"$src"
  rm -f "$src.uri"
  apt-get update -qq
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get source --download-only fio libaio >/dev/null 2>&1)
tar -C "$work" -xzf "$work"/libaio_*.orig.tar.gz
tar -C "$work" -xzf "$work"/fio_*.orig.tar.gz
aio="$(echo "$work"/libaio-*/src)"
make -C "$aio" -j"$(nproc)" libaio.a >/dev/null
cd "$work"/fio-*/
./configure --disable-native --disable-numa --disable-rdma --disable-rados --disable-rbd \
  --disable-gfapi --disable-pmem --disable-http --disable-tcmalloc --disable-libnfs \
  --disable-xnvme --disable-libzbc --disable-dfs --extra-cflags="-I$aio -L$aio" >/dev/null
# libaio.a only (no libaio.so beside it): linked statically.
make -j"$(nproc)" LDFLAGS="-L$aio" fio >/dev/null
./fio --enghelp | grep -qx '[[:space:]]*libaio' || { echo "build-fio: libaio engine missing" >&2; exit 1; }
mkdir -p "$out"
strip -o "$out/fio" fio
echo "$out/fio"
