#!/usr/bin/env bash
# Packs ctxcached, the ctxcache CLI and (when built: -DCTXCACHE_BUILD_BENCH=ON)
# the cluster load generator ctxcache-cluster-load with their shared-library
# closure into
# .pack/ctxcache-server.tar.xz (gitignored), to carry to a machine without
# this build, e.g. the GPU machine (Ubuntu 24.04). glibc (libc, libm,
# libpthread, libdl, librt, ld-linux, ...), libstdc++ and libgcc_s are left
# out: they must come from the host, whose newer versions are backward
# compatible. The sentencepiece plugin goes to lib/, where the binaries look
# for it (model/tokenizer.cc). Run it there with
#   tar xJf ctxcache-server.tar.xz && ctxcache/bin/ctxcached.sh --help
# With CTXCACHE_PACK_ETCD=1 it also carries this host's etcd server binary
# (Debian's etcd-server, static Go, ~5.7 MB xz) as ctxcache/bin/etcd, for the
# cluster bench (scripts/gpu-suite.sh stage cluster_bench) on a host without
# etcd; $CTXCACHE_ETCD_BIN overrides /usr/bin/etcd.
# CTXCACHE_PACK_FIO=1 adds fio (below).
# Usage: [CTXCACHE_PACK_ETCD=1] [CTXCACHE_PACK_FIO=1] scripts/pack-server.sh [BUILD_DIR] [OUT_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
out="${2:-$root/.pack}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pkg="$tmp/ctxcache"
mkdir -p "$pkg/bin" "$pkg/lib" "$out"
bins=(ctxcached ctxcache)
[ -x "$build/bin/ctxcache-cluster-load" ] && bins+=(ctxcache-cluster-load)
# CTXCACHE_PACK_BENCH=1: also ctxcache-bench (the service benches run on the
# GPU machine's CPUs, e.g. the task suite; it starts bin/ctxcached beside it).
[ "${CTXCACHE_PACK_BENCH:-0}" = 1 ] && bins+=(ctxcache-bench)
for b in "${bins[@]}"; do cp "$build/bin/$b" "$pkg/bin/"; done
cp "$build/lib/libctxcache_spm.so" "$pkg/lib/"
# The native client library (client/include/ctxcache/c.h) for Python's
# ctypes (python/ctxcache/native.py finds it as $CTXCACHE_BIN_DIR/../lib); its
# RPATH $ORIGIN finds the closure copied below.
cp "$build/lib/libctxcache_c.so" "$pkg/lib/"
# CTXCACHE_PACK_FIO=1: also fio (scripts/build-fio.sh: libaio static, zlib),
# the cold-load baseline of python/bench/gpu_load.py on a host without fio.
if [ "${CTXCACHE_PACK_FIO:-0}" = 1 ]; then
  cp "$("$root/scripts/build-fio.sh" "$build/fio" | tail -1)" "$pkg/bin/fio"
  bins+=(fio)
fi
if [ "${CTXCACHE_PACK_ETCD:-0}" = 1 ]; then
  etcd="${CTXCACHE_ETCD_BIN:-/usr/bin/etcd}"
  [ -x "$etcd" ] || { echo "pack-server: $etcd missing (apt-get install etcd-server)" >&2; exit 1; }
  cp "$etcd" "$pkg/bin/etcd"
fi
host_provided='^(libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libnsl|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
for f in "${bins[@]/#/$pkg/bin/}" "$pkg/lib/libctxcache_spm.so" "$pkg/lib/libctxcache_c.so"; do
  ldd "$f" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  name="$(basename "$lib")"
  if [[ "$name" =~ $host_provided ]]; then continue; fi
  cp -L "$lib" "$pkg/lib/$name"
done
for b in "${bins[@]}"; do
  cat >"$pkg/bin/$b.sh" <<WRAP
#!/usr/bin/env bash
here="\$(cd "\$(dirname "\$0")" && pwd)"
export LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "\$here/$b" "\$@"
WRAP
  chmod +x "$pkg/bin/$b.sh"
done
strip --strip-unneeded "${bins[@]/#/$pkg/bin/}" "$pkg"/lib/*.so* 2>/dev/null || true
tar -C "$tmp" -cf - ctxcache | xz -9e -T0 >"$out/ctxcache-server.tar.xz.tmp"
mv -f "$out/ctxcache-server.tar.xz.tmp" "$out/ctxcache-server.tar.xz"
n_bins=0
for f in "$pkg"/bin/*; do [[ "$f" == *.sh ]] || n_bins=$((n_bins + 1)); done
n_libs=$(find "$pkg/lib" -mindepth 1 -maxdepth 1 | wc -l)
echo "pack-server: $(du -h "$out/ctxcache-server.tar.xz" | cut -f1) $out/ctxcache-server.tar.xz" \
  "($n_bins binaries, $n_libs libraries)"
