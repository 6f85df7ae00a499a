"""Routing client for a ctxcached cluster (docs/cluster.md).

``ClusterClient("etcd://host:port[,host:port...]/<cluster>")`` (or
``ctxcache.Client`` given such an address) reads the cluster's membership
from etcd through etcd's JSON gateway (``POST /v3/kv/range`` on the client
port; no etcd Python package needed), refreshed every ``refresh_s`` seconds
and after every failover, and routes each call:

* calls naming a context go to a live node holding it, the owners first
  (rendezvous hashing, the same rule as cluster/placement.h), then any live
  node (which forwards);
* builds, ingests and listings go to a live node (round robin);
* a call failing with UNAVAILABLE is retried on the next candidate;
* a decode session that fails with UNAVAILABLE mid-session is re-opened on
  the next holder and the tokens appended so far are appended again, so it
  continues from the same token with the same results
  (:class:`FailoverSession`).

Thread-safety: a ClusterClient may be shared by threads; a session may not.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import json
import threading
import time
import urllib.request
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from ctxcache import errors

__all__ = ["ClusterClient", "FailoverSession", "NodeInfo", "parse_cluster_uri", "owners_of",
           "rendezvous_score"]

T = TypeVar("T")


class NodeInfo(Tuple[str, str, str]):
    """(node_id, address, zone)."""

    @property
    def node_id(self) -> str:
        return self[0]

    @property
    def address(self) -> str:
        return self[1]

    @property
    def zone(self) -> str:
        return self[2]


def parse_cluster_uri(uri: str) -> Tuple[List[str], str]:
    """``etcd://h:p[,h:p...]/<name>`` -> (endpoints, name); ValueError otherwise."""
    if not uri.startswith("etcd://"):
        raise ValueError(f"{uri!r}: expected etcd://host:port[,host:port...]/<cluster-name>")
    rest = uri[len("etcd://"):]
    hosts, sep, name = rest.partition("/")
    if not sep or not name or not all(c.isalnum() or c in "._-" for c in name):
        raise ValueError(f"{uri!r}: the cluster name must be 1-128 of [A-Za-z0-9._-]")
    endpoints = hosts.split(",")
    for e in endpoints:
        h, colon, p = e.rpartition(":")
        if not colon or not h or not p.isdigit():
            raise ValueError(f"{uri!r}: endpoint {e!r} is not host:port")
    return endpoints, name


def rendezvous_score(node_id: str, context_id: str) -> int:
    """First 8 bytes, big-endian, of SHA-256(node_id || 0x00 || context_id)."""
    d = hashlib.sha256(node_id.encode() + b"\0" + context_id.encode()).digest()
    return int.from_bytes(d[:8], "big")


def owners_of(context_id: str, nodes: Sequence[NodeInfo], replicas: int) -> List[NodeInfo]:
    """The context's owners, first owner first (cluster/placement.h's rule:
    score order, one node per zone before a second one in any zone)."""
    ranked = sorted(nodes, key=lambda n: (-rendezvous_score(n.node_id, context_id), n.node_id))
    want = min(replicas, len(ranked))
    out: List[NodeInfo] = []
    used = set()
    for first_pass in (True, False):
        for n in ranked:
            if len(out) == want:
                break
            if n in out or (first_pass and n.zone in used):
                continue
            used.add(n.zone)
            out.append(n)
    return out


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _prefix_end(prefix: str) -> str:
    b = bytearray(prefix.encode())
    b[-1] += 1
    return b.decode()


class _Membership:
    """Live nodes and holders, read from etcd's JSON gateway."""

    def __init__(self, endpoints: List[str], cluster: str, timeout: float) -> None:
        self.endpoints = endpoints
        self.cluster = cluster
        self.timeout = timeout
        self._i = 0

    def _range(self, prefix: str) -> List[Tuple[str, str]]:
        body = json.dumps({"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}).encode()
        last: Optional[Exception] = None
        for _ in range(len(self.endpoints)):
            ep = self.endpoints[self._i % len(self.endpoints)]
            req = urllib.request.Request(f"http://{ep}/v3/kv/range", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    data = json.loads(r.read())
                return [(base64.b64decode(kv["key"]).decode(),
                         base64.b64decode(kv.get("value", "")).decode())
                        for kv in data.get("kvs", [])]
            except OSError as e:
                last = e
                self._i += 1
        raise errors.Unavailable(f"etcd {self.endpoints}: {last}")

    def nodes(self) -> List[NodeInfo]:
        root = f"/{self.cluster}/nodes/"
        out = []
        for k, v in self._range(root):
            try:
                j = json.loads(v)
            except ValueError:
                continue
            if j.get("addr"):
                out.append(NodeInfo((k[len(root):], j["addr"], j.get("zone", ""))))
        return sorted(out)

    def holders(self, context_id: str) -> List[str]:
        root = f"/{self.cluster}/holders/{context_id}/"
        return [k[len(root):] for k, _ in self._range(root)]


class ClusterClient:
    """A :class:`ctxcache.Client` over a cluster; same methods. Args as
    Client's (passed to every node's Client), plus ``replicas`` (R, to
    compute owners; default 2) and ``refresh_s`` (membership cache age)."""

    def __init__(self, address: str, replicas: int = 2, refresh_s: float = 1.0,
                 **client_kwargs: Any) -> None:
        endpoints, self.cluster = parse_cluster_uri(address)
        self.address = address
        self.replicas = int(replicas)
        self.refresh_s = float(refresh_s)
        self._kwargs = dict(client_kwargs)
        self.timeout = float(self._kwargs.get("timeout", 30.0))
        self._membership = _Membership(endpoints, self.cluster, min(self.timeout, 5.0))
        self._lock = threading.Lock()
        self._clients: Dict[str, Any] = {}
        self._nodes: List[NodeInfo] = []
        self._nodes_at = 0.0
        self._rr = itertools.count()

    # ---------------------------------------------------------- membership --

    def nodes(self, refresh: bool = False) -> List[NodeInfo]:
        """Live nodes (cached for refresh_s)."""
        with self._lock:
            if refresh or not self._nodes or time.monotonic() - self._nodes_at > self.refresh_s:
                self._nodes = self._membership.nodes()
                self._nodes_at = time.monotonic()
            return list(self._nodes)

    def candidates(self, context_id: str) -> List[NodeInfo]:
        """Live nodes for a call on context_id: holders (owners first), then
        the other live nodes."""
        nodes = self.nodes()
        held = set(self._membership.holders(context_id))
        owners = owners_of(context_id, nodes, self.replicas)
        order = ([n for n in owners if n.node_id in held] +
                 [n for n in nodes if n.node_id in held] + owners + nodes)
        out: List[NodeInfo] = []
        for n in order:
            if n not in out:
                out.append(n)
        return out

    def client_for(self, address: str) -> Any:
        from ctxcache.client import Client
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                kw = dict(self._kwargs)
                kw["max_attempts"] = 1  # retries go to the next node instead
                c = Client(address, **kw)
                self._clients[address] = c
            return c

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------- routing --

    def _on(self, nodes: List[NodeInfo], fn: Callable[[Any], T]) -> T:
        if not nodes:
            raise errors.Unavailable(f"cluster {self.cluster}: no live node")
        seen = []
        last: Optional[Exception] = None
        for n in nodes:
            if n.address in seen:
                continue
            seen.append(n.address)
            try:
                return fn(self.client_for(n.address))
            except errors.Unavailable as e:
                last = e
        self.nodes(refresh=True)
        raise last  # type: ignore[misc]

    def _any(self, fn: Callable[[Any], T]) -> T:
        nodes = self.nodes()
        k = next(self._rr) % max(1, len(nodes))
        return self._on(nodes[k:] + nodes[:k], fn)

    def _ctx(self, context_id: str, fn: Callable[[Any], T]) -> T:
        return self._on(self.candidates(context_id), fn)

    # ---------------------------------------------------------------- calls --

    def health(self, service: str = "") -> str:
        return self._any(lambda c: c.health(service))

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self._any(lambda c: c.build(*args, **kwargs))

    def ingest(self, *args: Any, **kwargs: Any) -> Any:
        return self._any(lambda c: c.ingest(*args, **kwargs))

    def extend(self, parent_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._ctx(parent_id, lambda c: c.extend(parent_id, *args, **kwargs))

    def get(self, context_id: str) -> Any:
        return self._ctx(context_id, lambda c: c.get(context_id))

    def evict(self, context_id: str) -> Any:
        return self._ctx(context_id, lambda c: c.evict(context_id))

    def pin(self, context_id: str, pinned: bool = True) -> Any:
        return self._ctx(context_id, lambda c: c.pin(context_id, pinned))

    def unpin(self, context_id: str) -> Any:
        return self.pin(context_id, False)

    def share(self, context_id: str, shared: bool = True) -> Any:
        return self._ctx(context_id, lambda c: c.share(context_id, shared))

    def fetch_index(self, context_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._ctx(context_id, lambda c: c.fetch_index(context_id, *args, **kwargs))

    def fetch_pages(self, context_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._ctx(context_id, lambda c: c.fetch_pages(context_id, *args, **kwargs))

    def open_session(self, context_id: str, method: str = "csa",
                     params: Optional[Mapping[str, Any]] = None,
                     **kwargs: Any) -> "FailoverSession":
        return FailoverSession(self, context_id, method, dict(params or {}), kwargs)


class FailoverSession:
    """A decode session that survives the loss of its node: on UNAVAILABLE
    it re-opens on the next holder, appends again every token appended so
    far (sessions' appended tokens live only in the session), and retries
    the call. The selections after a failover are the same as without it,
    because a session's state is a function of the context and its appends.
    Same methods as :class:`ctxcache.Session`."""

    def __init__(self, cluster: ClusterClient, context_id: str, method: str,
                 params: Dict[str, Any], kwargs: Dict[str, Any]) -> None:
        self._cluster = cluster
        self.context_id = context_id
        self.method = method
        self.params = params
        self._kwargs = kwargs
        self._appended: List[Tuple[Any, Any, Any, int]] = []
        self.failovers = 0
        self.address = ""
        self._session: Any = None
        self._reopen(initial=True)

    def _reopen(self, initial: bool = False) -> None:
        if self._session is not None:
            try:
                self._session.close()
            except errors.Error:
                pass
        last: Optional[Exception] = None
        for n in self._cluster.candidates(self.context_id):
            if not initial and n.address == self.address:
                continue
            try:
                s = self._cluster.client_for(n.address).open_session(
                    self.context_id, self.method, self.params, **self._kwargs)
                for k, v, q, tok in self._appended:
                    s.append(k, v, q, tok)
            except errors.Unavailable as e:
                last = e
                continue
            self._session = s
            self.address = n.address
            return
        raise last or errors.Unavailable(f"no live node holds {self.context_id}")

    def _call(self, fn: Callable[[Any], T]) -> T:
        for _ in range(4):
            try:
                return fn(self._session)
            except (errors.Unavailable, errors.Cancelled):
                self.failovers += 1
                self._cluster.nodes(refresh=True)
                self._reopen()
        return fn(self._session)

    def __getattr__(self, name: str) -> Any:  # session_id, context, model, n_tokens, ...
        return getattr(self._session, name)

    def step(self, layer: int, queries: Any) -> Any:
        return self._call(lambda s: s.step(layer, queries))

    def append(self, k: Any, v: Any, q: Any = None, token_id: int = 0) -> int:
        n = self._call(lambda s: s.append(k, v, q, token_id))
        self._appended.append((k, v, q, token_id))
        return n

    def close(self) -> None:
        if self._session is not None:
            try:
                self._session.close()
            except (errors.Unavailable, errors.Cancelled):
                pass

    def __enter__(self) -> "FailoverSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
