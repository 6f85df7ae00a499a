#!/usr/bin/env bash
# Test PKI made with openssl at test time (never committed):
#   ca.{pem,key}            the CA that server and clients trust
#   server.{pem,key}        CN=ctxcached, SAN IP:127.0.0.1, IP:::1, DNS:localhost
#   server2.{pem,key}       the same names, signed by other-ca (for reload)
#   client-a.{pem,key}      CN=worker-a, signed by ca
#   client-unmapped.{pem,key} CN=stranger, signed by ca
#   expired.{pem,key}       CN=worker-a, signed by ca, expired in 2020
#   other-ca.{pem,key}      an unrelated CA
#   other-client.{pem,key}  CN=worker-a, signed by other-ca
# Usage: make-certs.sh OUTDIR
set -euo pipefail
out="$1"
mkdir -p "$out"
cd "$out"
q() { "$@" >/dev/null 2>&1 || { echo "make-certs: failed: $*" >&2; "$@"; exit 1; }; }

ca() {  # name cn
  q openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.pem" -days 3650 \
    -subj "/CN=$2" -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}
leaf() {  # name cn ca ext
  q openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2"
  printf '%s\n' "$4" > "$1.ext"
  q openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -out "$1.pem" \
    -days 825 -extfile "$1.ext"
  rm -f "$1.csr" "$1.ext"
}
server_ext='subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost
extendedKeyUsage=serverAuth'
client_ext='extendedKeyUsage=clientAuth'

ca ca "ctxcache test CA"
ca other-ca "some other CA"
leaf server ctxcached ca "$server_ext"
leaf server2 ctxcached other-ca "$server_ext"
leaf client-a worker-a ca "$client_ext"
leaf client-unmapped stranger ca "$client_ext"
leaf other-client worker-a other-ca "$client_ext"

# An expired client certificate: `openssl ca` can set dates in the past.
mkdir -p expired-ca/newcerts
: > expired-ca/index.txt
echo 1000 > expired-ca/serial
cat > expired-ca/ca.cnf <<CNF
[ ca ]
default_ca = test
[ test ]
dir = expired-ca
database = expired-ca/index.txt
new_certs_dir = expired-ca/newcerts
serial = expired-ca/serial
default_md = sha256
policy = any
copy_extensions = none
[ any ]
commonName = supplied
[ client ]
extendedKeyUsage = clientAuth
CNF
q openssl req -newkey rsa:2048 -nodes -keyout expired.key -out expired.csr -subj "/CN=worker-a"
q openssl ca -batch -config expired-ca/ca.cnf -cert ca.pem -keyfile ca.key -in expired.csr \
  -out expired.pem -startdate 20200101000000Z -enddate 20200102000000Z -extensions client -notext
rm -rf expired.csr expired-ca ca.srl other-ca.srl
chmod 600 ./*.key
