"""A cluster with API keys (tests/cluster, ctest cluster): nodes talk to each
other with the --cluster-key-file operator key; forwarded calls are
authenticated as the original caller; tenancy survives replication (the same
tenant-salted id on every node, from one shared --id-secret-file); nodes
without the cluster key cannot copy."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

import ctxcache
from ctxcache.cluster import owners_of
from cluster_harness import Cluster, wait_for

R = 2


def make_key(bin_dir: str, keys_file: str, role: str, tenant: str = "") -> str:
    args = [os.path.join(bin_dir, "ctxcache"), "keys", "create", "--keys-file", keys_file,
            "--role", role, "--json"]
    if tenant:
        args += ["--tenant", tenant]
    return json.loads(subprocess.run(args, check=True, capture_output=True,
                                     text=True).stdout)["key"]


@pytest.fixture(scope="module")
def secured(bin_dir: str, model_dir: str, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("keys"))
    keys = os.path.join(d, "keys")
    cluster_key = make_key(bin_dir, keys, "operator")
    with open(os.path.join(d, "cluster.key"), "w") as f:
        f.write(cluster_key + "\n")
    alice = make_key(bin_dir, keys, "builder", "alice")
    bob = make_key(bin_dir, keys, "builder", "bob")
    alice_reader = make_key(bin_dir, keys, "reader", "alice")
    bob_reader = make_key(bin_dir, keys, "reader", "bob")
    alice_admin = make_key(bin_dir, keys, "admin", "alice")
    secret = os.path.join(d, "ID_SECRET")
    with open(secret, "w") as f:  # 32 bytes, hex (docs/security.md)
        f.write(os.urandom(32).hex() + "\n")
    os.chmod(secret, 0o600)
    c = Cluster(3, bin_dir, model_dir, extra=[
        "--replicas", str(R), "--etcd-lease-ttl-s", "2", "--keys-file", keys,
        "--cluster-key-file", os.path.join(d, "cluster.key"), "--id-secret-file", secret])
    try:
        yield c, {"alice": alice, "bob": bob, "alice_reader": alice_reader,
                  "bob_reader": bob_reader, "alice_admin": alice_admin,
                  "cluster": cluster_key}
    finally:
        c.close()


def test_tenancy_survives_replication_and_forwarding(secured) -> None:
    c, keys = secured
    alice = ctxcache.connect(c.uri, api_key=keys["alice"])
    ctx = alice.build(tokens=list(range(1, 90)), name="alice-doc").context.context_id
    rc = ctxcache.ClusterClient(c.uri)

    def settled() -> bool:
        owners = sorted(o.node_id for o in owners_of(ctx, rc.nodes(refresh=True), R))
        return sorted(rc._membership.holders(ctx)) == owners
    wait_for(settled, 20, "copies on the owners")
    for n in c.nodes:  # owners serve their copies, the third node forwards
        got = ctxcache.Client(n.address, api_key=keys["alice_reader"]).get(ctx)
        assert got.tenant == "alice" and got.context_id == ctx
        with pytest.raises(ctxcache.NotFound):
            ctxcache.Client(n.address, api_key=keys["bob_reader"]).get(ctx)
        with pytest.raises(ctxcache.Unauthenticated):
            ctxcache.Client(n.address, api_key="ck_wrong", max_attempts=1).get(ctx)
    # The same prompt built by bob is another context (another id namespace).
    bob_ctx = ctxcache.connect(c.uri, api_key=keys["bob"]).build(
        tokens=list(range(1, 90))).context.context_id
    assert bob_ctx != ctx


def test_cluster_service_needs_the_operator_role(secured) -> None:
    c, keys = secured
    import grpc
    for key, code in ((keys["alice"], grpc.StatusCode.PERMISSION_DENIED),
                      (keys["alice_admin"], grpc.StatusCode.PERMISSION_DENIED),
                      ("", grpc.StatusCode.UNAUTHENTICATED)):
        ch = grpc.insecure_channel(c.nodes[0].address)
        call = ch.unary_unary("/ctxcache.v1.ClusterService/ReplicateContext",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
        md = [("authorization", f"Bearer {key}")] if key else []
        with pytest.raises(grpc.RpcError) as e:
            call(b"", metadata=md, timeout=5)
        assert e.value.code() == code
        ch.close()
    r = subprocess.run([os.path.join(c.bin_dir, "ctxcache"), "cluster", "status", "--json",
                        "--server", c.uri, "--api-key", keys["cluster"]],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode in (0, 1), r.stderr
    assert len(json.loads(r.stdout)["nodes"]) == 3
