"""TLS, mTLS, API keys and tenants from Python against the real ctxcached
(certificates made by tests/security/make-certs.sh with openssl, keys by
``ctxcache keys create``)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np
import pytest

import ctxcache
from ctxcache import errors

from conftest import REPO, Server, random_tokens


@pytest.fixture(scope="module")
def pki(tmp_root: str) -> str:
    d = tempfile.mkdtemp(prefix="pki-", dir=tmp_root)
    subprocess.run(["bash", os.path.join(REPO, "tests", "security", "make-certs.sh"), d],
                   check=True, capture_output=True)
    return d


def create_key(cli: str, keys_file: str, role: str, tenant: str = "") -> str:
    args = [cli, "keys", "create", "--keys-file", keys_file, "--role", role, "--json"]
    if tenant:
        args += ["--tenant", tenant]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["key"]


@pytest.fixture(scope="module")
def secured(pki: str, ctxcached_bin: str, model_dir: str, tmp_root: str):
    cli = os.path.join(os.path.dirname(ctxcached_bin), "ctxcache")
    workdir = tempfile.mkdtemp(prefix="secured-", dir=tmp_root)
    keys_file = os.path.join(workdir, "keys")
    keys = {
        "a-builder": create_key(cli, keys_file, "builder", "a"),
        "a-reader": create_key(cli, keys_file, "reader", "a"),
        "b-builder": create_key(cli, keys_file, "builder", "b"),
        "b-reader": create_key(cli, keys_file, "reader", "b"),
        "a-admin": create_key(cli, keys_file, "admin", "a"),
        "operator": create_key(cli, keys_file, "operator"),
    }
    subprocess.run([cli, "keys", "map-cert", "--keys-file", keys_file, "--cn", "worker-a",
                    "--tenant", "a", "--role", "reader"], check=True, capture_output=True)
    s = Server(ctxcached_bin, model_dir, workdir,
               ["--default-indexes", "streaming",
                "--tls-cert", os.path.join(pki, "server.pem"),
                "--tls-key", os.path.join(pki, "server.key"),
                "--tls-client-ca", os.path.join(pki, "ca.pem"),
                "--keys-file", keys_file])
    s.client_kwargs = {"tls_ca": os.path.join(pki, "ca.pem"),
                       "tls_cert": os.path.join(pki, "client-a.pem"),
                       "tls_key": os.path.join(pki, "client-a.key")}
    s.start()
    yield s, keys, pki
    s.stop()


def test_keys_roles_and_tenants_over_mtls(secured) -> None:
    s, keys, pki = secured
    ca = os.path.join(pki, "ca.pem")
    cert = {"tls_cert": os.path.join(pki, "client-a.pem"),
            "tls_key": os.path.join(pki, "client-a.key")}
    with ctxcache.Client(s.address, tls_ca=ca, api_key=keys["a-builder"], **cert) as ab:
        info = ab.build(tokens=random_tokens(48, 1)).context
        assert info.tenant == "a"
        assert info.provenance == ctxcache.storage_pb.PROVENANCE_BUILT
    # The certificate alone maps to tenant a's reader.
    with ctxcache.Client(s.address, tls_ca=ca, **cert) as ar:
        assert ar.get(info.context_id).context_id == info.context_id
        with pytest.raises(errors.PermissionDenied):
            ar.build(tokens=random_tokens(8, 2))
    # Tenant b cannot see a's context: NotFound, as for an unknown id.
    with ctxcache.Client(s.address, tls_ca=ca, api_key=keys["b-builder"], **cert) as bb:
        with pytest.raises(errors.PermissionDenied):
            bb.get(info.context_id)  # builders do not read
        with pytest.raises(errors.NotFound):
            bb.evict(info.context_id)
        child = bb.build(tokens=random_tokens(48, 1)).context
        assert child.context_id != info.context_id
    # A wrong key is UNAUTHENTICATED even with a valid certificate.
    with ctxcache.Client(s.address, tls_ca=ca, api_key="ck_000000000000_" + "0" * 64,
                         **cert) as bad:
        with pytest.raises(errors.Unauthenticated):
            bad.stats()


def test_an_ingested_child_needs_a_parent_the_caller_may_read(secured) -> None:
    """IngestContext with parent_id opens the parent as ExtendContext does:
    another tenant's context is NOT_FOUND (as an unknown id); the owner's
    builder stores the child in its tenant."""
    s, keys, _ = secured
    tls = s.client_kwargs  # the CA and tenant a's client certificate
    with ctxcache.Client(s.address, api_key=keys["a-builder"], **tls) as ab:
        parent = ab.build(tokens=random_tokens(40, 5)).context
    m = parent.model
    kv = [(np.zeros((m.n_kv_heads, 3, m.head_dim), np.float32),) * 2] * m.n_layers
    with ctxcache.Client(s.address, api_key=keys["b-builder"], **tls) as bb:
        with pytest.raises(errors.NotFound, match="header.parent_id"):
            bb.ingest(m, [1, 2, 3], kv, parent_id=parent.context_id, parent_tokens=40)
    with ctxcache.Client(s.address, api_key=keys["a-builder"], **tls) as ab:
        child = ab.ingest(m, [1, 2, 3], kv, parent_id=parent.context_id, parent_tokens=40)
        assert child.tenant == "a" and child.parent_id == parent.context_id
        assert child.n_tokens == 43


def test_api_key_from_environment_and_plaintext_refused(secured, monkeypatch) -> None:
    s, keys, pki = secured
    ca = os.path.join(pki, "ca.pem")
    cert = {"tls_cert": os.path.join(pki, "client-a.pem"),
            "tls_key": os.path.join(pki, "client-a.key")}
    monkeypatch.setenv("CTXCACHE_API_KEY", keys["a-reader"])
    with ctxcache.Client(s.address, tls_ca=ca, **cert) as c:
        assert c.stats().n_contexts >= 0
    with ctxcache.Client(s.address, max_attempts=1, timeout=3) as plain:
        with pytest.raises(errors.Unavailable):
            plain.stats()
    with pytest.raises(ValueError):
        ctxcache.Client(s.address, tls_cert=cert["tls_cert"], tls_key=cert["tls_key"])


def test_native_library_speaks_tls_keys_and_tenants(secured) -> None:
    """The native library (libctxcache_c.so) under the same TLS, keys and
    tenant checks as the gRPC client: a reader of tenant a loads a's KV, a
    builder may not read, plaintext never reaches a TLS server."""
    import numpy as np

    from ctxcache import native
    s, keys, pki = secured
    ca = os.path.join(pki, "ca.pem")
    cert = {"tls_cert": os.path.join(pki, "client-a.pem"),
            "tls_key": os.path.join(pki, "client-a.key")}
    with ctxcache.Client(s.address, tls_ca=ca, api_key=keys["a-builder"], **cert) as ab:
        info = ab.build(tokens=random_tokens(64, 7)).context
    with native.NativeClient(s.address, tls_ca=ca, api_key=keys["a-reader"], **cert) as ar:
        shape = ar.context(info.context_id)
        k = np.zeros(shape.kv_shape(), np.uint16)
        v = np.zeros_like(k)
        ar.load_kv(info.context_id, k, v)
        assert k.any() and v.any()
        # The same-host segment: only through the RPC that this key may make.
        with ar.map_kv(info.context_id) as m:
            m.wait()
            np.testing.assert_array_equal(m.array()[:, 0], k)
    with native.NativeClient(s.address, tls_ca=ca, api_key=keys["b-builder"], **cert) as bb:
        with pytest.raises(errors.PermissionDenied):
            bb.context(info.context_id)
        with pytest.raises(errors.PermissionDenied):
            bb.map_kv(info.context_id)
    # Another tenant's reader cannot tell a's context exists, let alone map it.
    with native.NativeClient(s.address, tls_ca=ca, api_key=keys["b-reader"], **cert) as br:
        with pytest.raises(errors.NotFound):
            br.map_kv(info.context_id)
        with pytest.raises(errors.NotFound):
            br.load_kv(info.context_id, k, v)
    with native.NativeClient(s.address, max_attempts=1, timeout=3) as plain:
        with pytest.raises(errors.Unavailable):
            plain.context(info.context_id)


def test_a_tenant_admin_stays_inside_its_tenant(secured) -> None:
    """Tenant a's admin is scoped to a: b's context is NotFound to it on every
    call (as an unknown id, the answer b's contexts give a's builders and
    readers), naming b is PermissionDenied, GetStats shows a's numbers only."""
    s, keys, _ = secured
    tls = s.client_kwargs
    with ctxcache.Client(s.address, api_key=keys["b-builder"], **tls) as bb:
        theirs = bb.build(tokens=random_tokens(40, 31)).context
    unknown = "0123456789abcdef0123456789abcdef"
    with ctxcache.Client(s.address, api_key=keys["a-admin"], max_attempts=1, **tls) as aa:
        mine = aa.build(tokens=random_tokens(40, 32)).context
        assert mine.tenant == "a"
        calls = {
            "get": lambda cid: aa.get(cid),
            "pin": lambda cid: aa.pin(cid),
            "unpin": lambda cid: aa.unpin(cid),
            "share": lambda cid: aa.share(cid),
            "extend": lambda cid: aa.extend(cid, tokens=[5, 6, 7]),
            "fetch_pages": lambda cid: aa.fetch_pages(cid, [(0, 0, [0])]),
            "evict": lambda cid: aa.evict(cid),
        }
        for name, call in calls.items():
            with pytest.raises(errors.NotFound) as foreign:
                call(theirs.context_id)
            with pytest.raises(errors.NotFound) as missing:
                call(unknown)
            assert (str(foreign.value).replace(theirs.context_id, "<id>")
                    == str(missing.value).replace(unknown, "<id>")), name
        listed = list(aa.list())
        assert mine.context_id in {c.context_id for c in listed}
        assert all(c.tenant == "a" or c.shared for c in listed)
        assert theirs.context_id not in {c.context_id for c in listed}
        with pytest.raises(errors.PermissionDenied, match="operator"):
            list(aa.list(tenant="b"))
        assert {c.tenant for c in aa.list(tenant="a")} == {"a"}
        with pytest.raises(errors.PermissionDenied):
            aa.build(tokens=random_tokens(16, 33), tenant="b")
        a_stats = aa.stats()
        # Within a, the admin does everything, sharing included.
        assert aa.pin(mine.context_id).pinned
        assert aa.share(mine.context_id).shared
        assert not aa.share(mine.context_id, False).shared
        assert not aa.unpin(mine.context_id).pinned
    with ctxcache.Client(s.address, api_key=keys["a-reader"], **tls) as ar:
        assert ar.stats().n_contexts == a_stats.n_contexts
    with ctxcache.Client(s.address, api_key=keys["operator"], **tls) as op:
        assert op.stats().n_contexts > a_stats.n_contexts
    with ctxcache.Client(s.address, api_key=keys["b-reader"], **tls) as br:
        assert br.get(theirs.context_id).context_id == theirs.context_id  # untouched


def test_the_operator_reaches_every_tenant(secured) -> None:
    s, keys, _ = secured
    tls = s.client_kwargs
    with ctxcache.Client(s.address, api_key=keys["b-builder"], **tls) as bb:
        theirs = bb.build(tokens=random_tokens(40, 41)).context
    with ctxcache.Client(s.address, api_key=keys["operator"], **tls) as op:
        assert op.get(theirs.context_id).tenant == "b"
        assert theirs.context_id in {c.context_id for c in op.list(tenant="b")}
        tenants = {c.tenant for c in op.list()}
        assert {"a", "b"} <= tenants
        assert op.pin(theirs.context_id).pinned
        assert not op.unpin(theirs.context_id).pinned
        child = op.extend(theirs.context_id, tokens=[5, 6, 7]).context
        assert child.tenant == "b"  # an operator's child stays in the parent's tenant
        built = op.build(tokens=random_tokens(16, 42), tenant="b").context
        assert built.tenant == "b"
        for cid in (child.context_id, built.context_id, theirs.context_id):
            op.evict(cid)
        with pytest.raises(errors.NotFound):
            op.get(theirs.context_id)


def _cli(s_bin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([s_bin, *args], capture_output=True, text=True, timeout=60)


def test_keys_file_roles_and_their_errors(ctxcached_bin: str, model_dir: str,
                                          tmp_root: str) -> None:
    """``ctxcache keys`` writes operator keys (no tenant) and scoped admin keys;
    an admin without a tenant and an unknown role are refused, naming the
    field and the expected values; ctxcached refuses a keys file whose admin
    has no tenant (the server-wide admin of old files) with the migration."""
    cli = os.path.join(os.path.dirname(ctxcached_bin), "ctxcache")
    d = tempfile.mkdtemp(prefix="roles-", dir=tmp_root)
    keys_file = os.path.join(d, "keys")
    create_key(cli, keys_file, "operator")
    create_key(cli, keys_file, "admin", "acme")
    listed = json.loads(_cli(cli, "keys", "list", "--keys-file", keys_file, "--json").stdout)
    assert sorted((k["role"], k["tenant"]) for k in listed) == [("admin", "acme"),
                                                              ("operator", "")]
    with open(keys_file) as f:
        assert "tenant=- role=operator" in f.read()
    r = _cli(cli, "keys", "create", "--keys-file", keys_file, "--role", "admin")
    assert r.returncode == 1
    assert "--tenant: role admin is scoped to one tenant" in r.stderr
    assert "role operator" in r.stderr
    r = _cli(cli, "keys", "create", "--keys-file", keys_file, "--tenant", "acme",
             "--role", "superuser")
    assert r.returncode == 1
    assert "role: expected reader, builder, admin or operator, got 'superuser'" in r.stderr
    r = _cli(cli, "keys", "map-cert", "--keys-file", keys_file, "--cn", "ops-console",
             "--role", "operator")
    assert r.returncode == 0, r.stderr

    salt, sha = "a" * 32, "b" * 64
    for text, expected in (
            (f"key 0123456789ab tenant=- role=admin salt={salt} sha256={sha}\n",
             "keys file line 1: tenant '-': role admin is scoped to one tenant"),
            (f"key 0123456789ab tenant=acme role=superuser salt={salt} sha256={sha}\n",
             "keys file line 1: role: expected reader, builder, admin or operator, "
             "got 'superuser'")):
        bad = os.path.join(d, "bad-keys")
        with open(bad, "w") as f:
            f.write(text)
        server = Server(ctxcached_bin, model_dir, tempfile.mkdtemp(prefix="bad-", dir=d),
                        ["--keys-file", bad])
        with pytest.raises(RuntimeError, match="exited") as e:
            server.start(timeout=20)
        assert expected in str(e.value)
