#!/usr/bin/env bash
# TLS plus API keys end to end with the CLI (docs/security.md):
#   1. installs the dependencies and builds (like scripts/demo.sh; set
#      CTXCACHE_DEMO_SKIP_BUILD=1 to reuse build/ as it is);
#   2. makes a throwaway PKI with openssl (tests/security/make-certs.sh) and
#      two tenants' keys with `ctxcache keys create`;
#   3. starts ctxcached with TLS and the keys file, listening on all
#      interfaces (allowed because both are configured);
#   4. acme's builder builds a context over TLS; acme's reader lists it;
#      globex's reader cannot see it; a call without a key is refused;
#   5. revokes acme's reader key and shows it refused, without a restart;
#   6. stops the server and prints the audit log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/demo-lib.sh
demo_build
CLI=./build/bin/ctxcache

echo "== a test PKI (openssl): CA, server certificate for 127.0.0.1"
./tests/security/make-certs.sh "$WORK/pki"
echo "== keys (printed once, stored as salted hashes in $WORK/keys)"
$CLI keys create --keys-file "$WORK/keys" --tenant acme --role builder >"$WORK/acme-builder.key"
$CLI keys create --keys-file "$WORK/keys" --tenant acme --role reader >"$WORK/acme-reader.key"
$CLI keys create --keys-file "$WORK/keys" --tenant globex --role reader >"$WORK/globex-reader.key"
$CLI keys list --keys-file "$WORK/keys"

echo "== starting ctxcached with TLS and API keys on 0.0.0.0"
DEMO_LISTEN=0.0.0.0:0 demo_start_server --metrics-listen "" --model-dir models \
  --default-model ctxcache-ref --tls-cert "$WORK/pki/server.pem" --tls-key "$WORK/pki/server.key" \
  --keys-file "$WORK/keys" --audit-log "$WORK/audit.log"
SERVER="127.0.0.1:$PORT"
TLS=(--server "$SERVER" --tls-ca "$WORK/pki/ca.pem")

echo "== acme's builder builds a context over TLS"
$CLI "${TLS[@]}" --api-key-file "$WORK/acme-builder.key" build \
  --text "The quarterly report of ACME is confidential." --name report
echo "== acme's reader lists it"
$CLI "${TLS[@]}" --api-key-file "$WORK/acme-reader.key" ls
echo "== globex's reader sees nothing"
$CLI "${TLS[@]}" --api-key-file "$WORK/globex-reader.key" ls
echo "== no key: refused"
if $CLI "${TLS[@]}" ls; then echo "unexpected: a call without a key succeeded"; exit 1; fi
echo "== revoke acme's reader key (no restart)"
$CLI keys revoke --keys-file "$WORK/keys" --id "$(cut -c4-15 "$WORK/acme-reader.key")"
sleep 1.2
if CTXCACHE_API_KEY="$(cat "$WORK/acme-reader.key")" $CLI "${TLS[@]}" ls; then
  echo "unexpected: a revoked key still works"; exit 1
fi
echo "== stopping ctxcached"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID"
SERVER_PID=""
echo "== audit log"
cat "$WORK/audit.log"
echo "== done"
