"""Routing client for a ctxcached cluster (docs/cluster.md).

``ClusterClient("etcd://host:port[,host:port...]/<cluster>")`` (or
``ctxcache.connect`` given such an address) keeps the cluster's membership
and holders from a watch of its etcd prefix through etcd's JSON gateway
(``POST /v3/kv/range``, then ``POST /v3/watch`` from the next revision, on
the client port; no etcd Python package needed): a node that leaves is out
of the routing at watch latency. A broken watch (etcd away, an endpoint
lost, the revision compacted, ``idle_relist_s`` without a message) lists the
prefix again and watches from there. It routes each call:

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
import urllib.request
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from ctxcache import errors
from ctxcache.client import Client

__all__ = ["connect", "ClusterClient", "FailoverSession", "NodeInfo", "parse_cluster_uri",
           "owners_of", "rendezvous_score"]

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


class _Watch:
    """Every key under /<cluster>/, kept by list + watch (a daemon thread).
    Holds no reference to its ClusterClient, so that can be collected; the
    client's close() (or collection) stops it."""

    def __init__(self, membership: _Membership, idle_relist_s: float) -> None:
        self._m = membership
        self._prefix = f"/{membership.cluster}/"
        self._idle = idle_relist_s
        self._cv = threading.Condition()
        self._kvs: Dict[str, str] = {}
        self.version = 0
        self.listed = False
        self._stop = threading.Event()
        self._response: Any = None
        threading.Thread(target=self._loop, name="ctxcache-etcd-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        r = self._response
        if r is not None:
            try:  # unblocks the reader
                r.fp.raw._sock.shutdown(2)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001
                pass

    def snapshot(self, timeout: float) -> Dict[str, str]:
        """The keys now; waits up to timeout for the first list."""
        with self._cv:
            if not self.listed:
                self._cv.wait_for(lambda: self.listed, timeout)
            if not self.listed:
                raise errors.Unavailable(f"etcd {self._m.endpoints}: cluster not listed yet")
            return dict(self._kvs)

    def _post(self, ep: str, path: str, body: dict, timeout: Optional[float]) -> Any:
        req = urllib.request.Request(f"http://{ep}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=timeout)

    def _loop(self) -> None:
        eps = self._m.endpoints
        i = 0
        while not self._stop.is_set():
            ep = eps[i % len(eps)]
            try:
                body = {"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix))}
                with self._post(ep, "/v3/kv/range", body, self._m.timeout) as r:
                    data = json.loads(r.read())
                rev = int(data["header"]["revision"])
                kvs = {base64.b64decode(kv["key"]).decode():
                       base64.b64decode(kv.get("value", "")).decode()
                       for kv in data.get("kvs", [])}
                with self._cv:
                    self._kvs = kvs
                    self.version += 1
                    self.listed = True
                    self._cv.notify_all()
                body = {"create_request": dict(body, start_revision=rev + 1)}
                self._response = self._post(ep, "/v3/watch", body, self._idle)
                with self._response as r:
                    for line in r:
                        if self._stop.is_set():
                            return
                        res = json.loads(line).get("result", {})
                        if res.get("canceled") or int(res.get("compact_revision", 0) or 0):
                            break  # re-list
                        evs = res.get("events", [])
                        if not evs:
                            continue
                        with self._cv:
                            for ev in evs:
                                k = base64.b64decode(ev["kv"]["key"]).decode()
                                if ev.get("type") == "DELETE":
                                    self._kvs.pop(k, None)
                                else:
                                    self._kvs[k] = base64.b64decode(
                                        ev["kv"].get("value", "")).decode()
                            self.version += 1
                            self._cv.notify_all()
            except (OSError, ValueError, KeyError):
                i += 1  # etcd away or idle past idle_relist_s: next endpoint, re-list
                self._stop.wait(0.2)
            finally:
                self._response = None


class ClusterClient:
    """A :class:`ctxcache.Client` over a cluster; same methods. Args as
    Client's (passed to every node's Client), plus ``replicas`` (R, to
    compute owners; default 2) and ``idle_relist_s`` (a watch silent this
    long is replaced by a fresh list + watch; default 30)."""

    def __init__(self, address: str, replicas: int = 2, idle_relist_s: float = 30.0,
                 **client_kwargs: Any) -> None:
        endpoints, self.cluster = parse_cluster_uri(address)
        self.address = address
        self.replicas = int(replicas)
        self._kwargs = dict(client_kwargs)
        self.timeout = float(self._kwargs.get("timeout", 30.0))
        self._membership = _Membership(endpoints, self.cluster, min(self.timeout, 5.0))
        self._lock = threading.Lock()
        self._clients: Dict[str, Any] = {}
        self._rr = itertools.count()
        self._watch = _Watch(self._membership, float(idle_relist_s))
        self._view: Tuple[int, List[NodeInfo], Dict[str, set]] = (-1, [], {})

    def __del__(self) -> None:
        w = getattr(self, "_watch", None)
        if w is not None:
            w.stop()

    # ---------------------------------------------------------- membership --

    def _current(self) -> Tuple[List[NodeInfo], Dict[str, set]]:
        """Live nodes and each context's live holders, from the watch."""
        w = self._watch
        if self._view[0] == w.version:
            return self._view[1], self._view[2]
        version = w.version
        kvs = w.snapshot(self._membership.timeout)
        nodes_root = f"/{self.cluster}/nodes/"
        holders_root = f"/{self.cluster}/holders/"
        nodes: List[NodeInfo] = []
        holders: Dict[str, set] = {}
        for k, v in kvs.items():
            if k.startswith(nodes_root):
                try:
                    j = json.loads(v)
                except ValueError:
                    continue
                if j.get("addr"):
                    nodes.append(NodeInfo((k[len(nodes_root):], j["addr"], j.get("zone", ""))))
            elif k.startswith(holders_root):
                ctx, _, node = k[len(holders_root):].partition("/")
                holders.setdefault(ctx, set()).add(node)
        nodes.sort()
        live = {n.node_id for n in nodes}
        holders = {c: h & live for c, h in holders.items()}
        self._view = (version, nodes, holders)
        return nodes, holders

    def nodes(self, refresh: bool = False) -> List[NodeInfo]:
        """Live nodes, as the watch saw them last (refresh: read etcd now)."""
        if refresh:
            return self._membership.nodes()
        return list(self._current()[0])

    def candidates(self, context_id: str) -> List[NodeInfo]:
        """Live nodes for a call on context_id: holders (owners first), then
        the other live nodes."""
        nodes, holders = self._current()
        held = holders.get(context_id, set())
        owners = owners_of(context_id, nodes, self.replicas)
        order = ([n for n in owners if n.node_id in held] +
                 [n for n in nodes if n.node_id in held] + owners + nodes)
        out: List[NodeInfo] = []
        for n in order:
            if n not in out:
                out.append(n)
        return out

    def client_for(self, address: str) -> Any:
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                kw = dict(self._kwargs)
                kw["max_attempts"] = 1  # retries go to the next node instead
                c = Client(address, **kw)
                self._clients[address] = c
            return c

    def close(self) -> None:
        self._watch.stop()
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
        parent_id = kwargs.get("parent_id") or ""
        if parent_id:  # a child goes to a holder of its parent
            return self._ctx(parent_id, lambda c: c.ingest(*args, **kwargs))
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


def connect(address: str = "127.0.0.1:7700", **options: Any) -> Any:
    """A client for ``address``: a :class:`ctxcache.ClusterClient` for a cluster
    address ``etcd://host:port[,host:port...]/<cluster>`` (``options`` may add
    its ``replicas`` and ``idle_relist_s``), else a :class:`ctxcache.Client`
    for ``HOST:PORT``. ``options`` are Client's keyword arguments (timeout,
    TLS, api_key, ...); both clients have the same methods.

    >>> with ctxcache.connect("etcd://10.0.0.9:2379/prod") as c:
    ...     c.get(context_id)
    """
    if address.startswith("etcd://"):
        return ClusterClient(address, **options)
    return Client(address, **options)
