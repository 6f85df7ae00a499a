#!/usr/bin/env bash
# Secrets for deploy/compose.yaml and deploy/k8s/ (never committed):
#   ca.pem             the CA every node and client trusts (its key: ca-private/ca.key,
#                      a subfolder, so `kubectl create secret --from-file=DIR` leaves it out)
#   node.{pem,key}     one certificate for all nodes: SANs node1..node3 (compose),
#                      *.ctxcache.<namespace>.svc(.cluster.local) (k8s), localhost,
#                      127.0.0.1; serverAuth + clientAuth (nodes dial each other)
#   client.{pem,key}   CN=admin, clientAuth: the operator's mTLS certificate
#   keys               ctxcached --keys-file, with two operator keys (server-wide role;
#                      tenants' keys: `ctxcache keys create --tenant T --role admin|builder|reader`)
#   operator.key       the first operator key (ctxcache --api-key-file)
#   cluster.key        the second operator key, what nodes present to each other
#   metrics-token      bearer token of the metrics endpoint
#   id-secret          the id secret every node shares (--id-secret-file)
# Usage: make-secrets.sh OUTDIR [NAMESPACE]   (needs openssl and the ctxcache
# CLI: $CTXCACHE_BIN, else build/bin/ctxcache, else ctxcache on PATH)
set -euo pipefail
out="$1"
ns="${2:-default}"
here="$(cd "$(dirname "$0")/.." && pwd)"
cli="${CTXCACHE_BIN:-$here/build/bin/ctxcache}"
[ -x "$cli" ] || cli="$(command -v ctxcache)" || { echo "make-secrets: no ctxcache CLI" >&2; exit 1; }
mkdir -p "$out"
cd "$out"
umask 077
q() { "$@" >/dev/null 2>&1 || { echo "make-secrets: failed: $*" >&2; "$@"; exit 1; }; }
leaf() {  # name cn ext
  q openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2"
  printf '%s\n' "$3" > "$1.ext"
  q openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-private/ca.key -CAcreateserial -out "$1.pem" \
    -days 825 -extfile "$1.ext"
  rm -f "$1.csr" "$1.ext" ca.srl
}
mkdir -p ca-private
q openssl req -x509 -newkey rsa:2048 -nodes -keyout ca-private/ca.key -out ca.pem -days 3650 \
  -subj "/CN=ctxcache cluster CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign"
leaf node ctxcached "subjectAltName=DNS:node1,DNS:node2,DNS:node3,DNS:localhost,IP:127.0.0.1,\
DNS:*.ctxcache.$ns.svc,DNS:*.ctxcache.$ns.svc.cluster.local
extendedKeyUsage=serverAuth,clientAuth"
leaf client admin "extendedKeyUsage=clientAuth"
rm -f keys
"$cli" keys create --keys-file keys --role operator | tail -1 > operator.key
"$cli" keys create --keys-file keys --role operator | tail -1 > cluster.key
openssl rand -hex 32 > metrics-token
openssl rand -hex 32 > id-secret
# The image runs as uid 10001: it must be able to read what it mounts.
chmod 0644 ./*.pem ./*.key keys metrics-token id-secret
chmod 0700 ca-private
echo "make-secrets: wrote $(ls | tr '\n' ' ')into $out"
