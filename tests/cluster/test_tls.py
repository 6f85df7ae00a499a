"""A cluster with mutual TLS and API keys: nodes dial each other over TLS,
verify peers against --tls-client-ca and present their own certificate
(which therefore carries serverAuth and clientAuth), with the cluster key.
Replication and forwarding work over it; a plaintext client is refused."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

import ctxcache
from ctxcache.cluster import owners_of
from cluster_harness import Cluster, wait_for

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def make_pki(d: str) -> None:
    # The test CA and client certificate (tests/security/make-certs.sh), plus
    # a node certificate for both ends of node-to-node calls.
    run("bash", os.path.join(REPO, "tests", "security", "make-certs.sh"), d)
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{d}/node.key",
        "-out", f"{d}/node.csr", "-subj", "/CN=ctxcached-node")
    with open(f"{d}/node.ext", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                "extendedKeyUsage=serverAuth,clientAuth\n")
    run("openssl", "x509", "-req", "-in", f"{d}/node.csr", "-CA", f"{d}/ca.pem", "-CAkey",
        f"{d}/ca.key", "-CAcreateserial", "-out", f"{d}/node.pem", "-days", "30",
        "-extfile", f"{d}/node.ext")


def test_replication_and_forwarding_over_mutual_tls(bin_dir: str, model_dir: str,
                                                     tmp_path_factory) -> None:
    d = str(tmp_path_factory.mktemp("pki"))
    make_pki(d)
    cli = os.path.join(bin_dir, "ctxcache")
    keys = os.path.join(d, "keys")

    def key(role: str, tenant: str) -> str:
        out = subprocess.run([cli, "keys", "create", "--keys-file", keys, "--role", role,
                              "--tenant", tenant, "--json"], check=True, capture_output=True,
                             text=True).stdout
        return json.loads(out)["key"]
    with open(f"{d}/cluster.key", "w") as f:
        f.write(key("operator", "ops"))
    builder, reader = key("builder", "t"), key("reader", "t")
    with open(f"{d}/ID_SECRET", "w") as f:
        f.write(os.urandom(32).hex())
    tls = {"tls_ca": f"{d}/ca.pem", "tls_cert": f"{d}/client-a.pem",
           "tls_key": f"{d}/client-a.key"}
    c = Cluster(3, bin_dir, model_dir, client_kwargs=tls, extra=[
        "--replicas", "2", "--etcd-lease-ttl-s", "2", "--tls-cert", f"{d}/node.pem",
        "--tls-key", f"{d}/node.key", "--tls-client-ca", f"{d}/ca.pem", "--keys-file", keys,
        "--cluster-key-file", f"{d}/cluster.key", "--id-secret-file", f"{d}/ID_SECRET"])
    try:
        ctx = ctxcache.connect(c.uri, api_key=builder, **tls).build(
            tokens=list(range(3, 150))).context.context_id
        rc = ctxcache.ClusterClient(c.uri)

        def settled() -> bool:
            owners = sorted(o.node_id for o in owners_of(ctx, rc.nodes(refresh=True), 2))
            return sorted(rc._membership.holders(ctx)) == owners
        wait_for(settled, 20, "copies on the owners over TLS")
        for n in c.nodes:  # two owners, and one node forwarding over TLS
            got = ctxcache.Client(n.address, api_key=reader, **tls).get(ctx)
            assert got.n_tokens == 147 and got.tenant == "t"
        assert sum(n.metrics()["ctxcache_replication_bytes_total"] for n in c.nodes) > 0
        with pytest.raises(ctxcache.Unavailable):
            ctxcache.Client(c.nodes[0].address, api_key=reader, max_attempts=1,
                            timeout=3).get(ctx)
    finally:
        c.close()
