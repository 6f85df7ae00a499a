#!/usr/bin/env bash
# Builds the images for real with podman and brings them up (docs/deploy.md,
# "Tested"): opt-in, 11-17 min on 2 cores when the image must be compiled (ctest
# image_smoke with -DCTXCACHE_IMAGE_SMOKE=ON; not in the default suite).
#   1. a debian:12 base image from Debian's archive, if podman has none:
#      mmdebstrap --variant=minbase bookworm with this host's apt sources
#      (no registry needed), piped into `podman import`;
#   2. `podman build` of deploy/Dockerfile (ctxcache:local) and
#      deploy/etcd.Dockerfile (ctxcache-etcd:local), from this working tree
#      as it is, built or not (.dockerignore keeps build dirs and .git out);
#   3. one container of ctxcache:local with its default CMD (TLS, keys file,
#      metrics token; as the image's non-root uid 10001) and secrets from
#      deploy/make-secrets.sh: `ctxcache health` over TLS must answer SERVING
#      and an API call without a key must be refused;
#   4. deploy/compose.yaml with podman-compose (etcd + node1..3):
#      `ctxcache cluster status` over mutual TLS with the operator key must list
#      3 nodes; a context built through node1 is readable through node3;
#   5. everything it started is removed (containers, volumes, network).
# Needs root (or rootless podman with a full uid map), podman, podman-compose,
# mmdebstrap (apt-get install podman podman-compose mmdebstrap runc), openssl
# and a built ctxcache CLI (build/bin/ctxcache, or $CTXCACHE_BIN).
# On hosts with cgroup v1/hybrid, crun cannot start containers ("cgroups in
# hybrid mode not supported"): the script then uses runc through a
# containers.conf of its own ($CONTAINERS_CONF), which also sets ulimits no
# higher than this host's hard limits (crun/runc fail to raise them).
# Usage: deploy/smoke-image.sh [--keep]   (--keep: leave the compose project up)
#   CTXCACHE_SMOKE_NO_BUILD=1: use the images already tagged ctxcache:local and
#   ctxcache-etcd:local instead of building them from HEAD.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
keep=0
[ "${1:-}" = --keep ] && keep=1
cli="${CTXCACHE_BIN:-$root/build/bin/ctxcache}"
[ -x "$cli" ] || { echo "smoke-image: no ctxcache CLI at $cli (build it or set CTXCACHE_BIN)" >&2; exit 1; }
for t in podman podman-compose openssl git; do
  command -v "$t" >/dev/null || { echo "smoke-image: $t missing" >&2; exit 1; }
done
work="$(mktemp -d /tmp/ctxcache-smoke-XXXXXX)"
log() { echo "smoke-image: $*"; }

# containers.conf: runc on cgroup v1/hybrid hosts, ulimits within the host's.
conf="$work/containers.conf"
nofile="$(ulimit -Hn)"
[ "$nofile" = unlimited ] && nofile=1048576
{
  echo "[containers]"
  echo "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=4096:4096\"]"
  echo "[engine]"
  if [ ! -f /sys/fs/cgroup/cgroup.controllers ] && command -v runc >/dev/null; then
    echo 'runtime = "runc"'
  fi
} >"$conf"
export CONTAINERS_CONF="$conf"

# 1. Base image.
if ! podman image exists debian:12; then
  sources=""
  for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] && grep -qE '^[^#]*debian' "$f" && { sources="$f"; break; }
  done
  [ -n "$sources" ] || { echo "smoke-image: no Debian apt source on this host" >&2; exit 1; }
  log "making debian:12 with mmdebstrap from $sources"
  mmdebstrap --variant=minbase --include=ca-certificates bookworm - "$sources" |
    podman import - localhost/debian:12
fi

# 2. Images, from the working tree (.dockerignore: no build dirs, no .git).
build() {  # build DOCKERFILE TAG CONTEXT
  # chroot isolation and the host network: the RUN steps need neither
  # namespaces nor a container network, only Debian's archive.
  podman build --isolation chroot --network host -f "$1" -t "$2" "$3"
}
if [ "${CTXCACHE_SMOKE_NO_BUILD:-0}" = 1 ]; then
  podman image exists ctxcache:local && podman image exists ctxcache-etcd:local ||
    { echo "smoke-image: CTXCACHE_SMOKE_NO_BUILD=1 but the images are missing" >&2; exit 1; }
else
  log "building ctxcache:local (compiles the project; 11-17 min on 2 cores)"
  build "$root/deploy/Dockerfile" localhost/ctxcache:local "$root"
  build "$root/deploy/etcd.Dockerfile" localhost/ctxcache-etcd:local "$root/deploy"
fi

# Secrets (as compose.yaml expects them: next to the compose file).
cp "$root/deploy/compose.yaml" "$work/compose.yaml"
"$root/deploy/make-secrets.sh" "$work/secrets" >/dev/null
s="$work/secrets"
tls=(--tls-ca "$s/ca.pem")
mtls=(--tls-ca "$s/ca.pem" --tls-cert "$s/client.pem" --tls-key "$s/client.key"
      --api-key-file "$s/operator.key")

single=ctxcache-smoke-single
project=ctxcache-smoke
cleanup() {
  podman rm -f -t 5 "$single" >/dev/null 2>&1 || true
  if [ $keep = 0 ]; then
    (cd "$work" && podman-compose -p "$project" -f compose.yaml down -v >/dev/null 2>&1) || true
    rm -rf "$work"
  else
    log "left up: cd $work && podman-compose -p $project -f compose.yaml down -v"
  fi
}
trap cleanup EXIT

wait_health() {  # wait_health ADDR ARGS...: SERVING within 60 s
  local addr="$1"
  shift
  for _ in $(seq 1 120); do
    if out="$("$cli" "$@" --server "$addr" --timeout 2 health 2>&1)" && [[ "$out" == *SERVING* ]]; then
      echo "$out"
      return 0
    fi
    sleep 0.5
  done
  echo "$out" >&2
  return 1
}

# 3. One node with the image's own CMD (TLS + keys file + metrics token).
log "single node: podman run ctxcache:local (uid $(podman run --rm --entrypoint id localhost/ctxcache:local -u))"
podman run -d --name "$single" -p 127.0.0.1:17700:7700 -p 127.0.0.1:17701:7701 \
  -v "$s/node.pem:/etc/ctxcache/tls/server.pem:ro" -v "$s/node.key:/etc/ctxcache/tls/server.key:ro" \
  -v "$s/keys:/etc/ctxcache/keys:ro" -v "$s/metrics-token:/etc/ctxcache/metrics-token:ro" \
  localhost/ctxcache:local >/dev/null
if ! wait_health 127.0.0.1:17700 "${tls[@]}"; then
  podman logs "$single" | tail -20 >&2
  exit 1
fi
if "$cli" "${tls[@]}" --server 127.0.0.1:17700 --timeout 5 ls >/dev/null 2>&1; then
  echo "smoke-image: ListContexts without an API key was accepted" >&2
  exit 1
fi
"$cli" "${tls[@]}" --api-key-file "$s/operator.key" --server 127.0.0.1:17700 --timeout 5 \
  ls >/dev/null
log "single node: health SERVING over TLS, keyless call refused, operator key accepted"
podman rm -f -t 10 "$single" >/dev/null

# 4. compose: etcd + 3 nodes.
log "compose: podman-compose up (etcd, node1..node3)"
(cd "$work" && podman-compose -p "$project" -f compose.yaml up -d >"$work/compose-up.log" 2>&1) ||
  { cat "$work/compose-up.log" >&2; exit 1; }
for p in 7710 7720 7730; do wait_health "127.0.0.1:$p" "${mtls[@]}" >/dev/null; done
n_nodes() {  # nodes listed by `ctxcache cluster status` through node1
  "$cli" "${mtls[@]}" --json --server 127.0.0.1:7710 --timeout 5 cluster status 2>/dev/null |
    tail -1 | python3 -c 'import json,sys; print(len(json.load(sys.stdin).get("nodes", [])))' \
    2>/dev/null || echo 0
}
for _ in $(seq 1 60); do [ "$(n_nodes)" = 3 ] && break; sleep 1; done
"$cli" "${mtls[@]}" --server 127.0.0.1:7710 --timeout 5 cluster status
[ "$(n_nodes)" = 3 ] || { echo "smoke-image: cluster status does not list 3 nodes" >&2; exit 1; }
id="$("$cli" "${mtls[@]}" --server 127.0.0.1:7710 --timeout 120 --json build --text \
  "The smoke test's context, built through node1." | tail -1 |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["context_id"])')"
"$cli" "${mtls[@]}" --server 127.0.0.1:7730 --timeout 30 show "$id" >/dev/null
log "compose: 3 nodes in cluster status; context $id built on node1, read through node3"
log "OK"
