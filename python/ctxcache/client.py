"""The ctxcache client: every ContextAdmin and DecodeService RPC of ctxcached.

Semantics follow the C++ SDK (client/include/ctxcache/client.h):

* every unary call and every stream has a deadline (``timeout`` seconds per
  attempt; builds, extends and ingests get ``max(timeout, 3600)``);
* idempotent calls failing with UNAVAILABLE (server down, restarting or
  draining) are retried ``max_attempts`` times in all, sleeping between half
  and all of ``initial_backoff`` seconds before the first retry (jitter, so
  clients that failed together do not retry together), the bound doubled each
  time up to 5 s (client/sdk/retry.h); ``evict`` (a retry after an eviction
  that reached the server would fail with NOT_FOUND), ``ingest`` (its request
  stream cannot be replayed) and ``watch`` are not retried;
* every page and index artifact received is checked against its crc32c
  (:class:`ctxcache.DataLoss` on mismatch);
* errors raise one exception class per status code (:mod:`ctxcache.errors`).

Thread-safety: a Client may be shared by threads (one channel, many calls); a
:class:`~ctxcache.session.Session` may not (one per decode stream / thread).
"""
from __future__ import annotations

import numbers
import random
import sys
import os
import time
import threading
import types
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional,
                    Sequence, Tuple, TypeVar, Union)

import grpc
import numpy as np

from ctxcache import errors
from ctxcache import tensors as _t
from ctxcache.crc32c import crc32c_many
from ctxcache.page_codec import check_page_crcs, decode_page, page_crc_error  # noqa: F401
from ctxcache.session import Session
from ctxcache.types import Page
from ctxcache.v1 import ctxcache_service_pb2 as pb
from ctxcache.v1 import storage_pb2 as st

__all__ = ["Client", "Watcher", "IndexArg", "ProgressCallback"]

T = TypeVar("T")
ProgressCallback = Callable[["pb.BuildProgress"], None]
# An index to build: "csa", ("csa", {"alpha": 0.25}), {"method": "csa", "params": {...}}
# or an IndexSpec; a mapping {"csa": {...}, "tactic": {}} lists several.
IndexArg = Union[str, "pb.IndexSpec", Tuple[str, Mapping[str, Any]], Mapping[str, Any]]
TokensArg = Union[Sequence[int], np.ndarray, Any]

_BUILD_TIMEOUT_S = 3600.0
_MAX_BACKOFF_S = 5.0
_INGEST_MESSAGE_BYTES = 4 << 20
_PHASE_NAMES = {v: k.lower() for k, v in pb.BuildProgress.Phase.items()}


def _index_specs(indexes: Optional[Union[IndexArg, Iterable[IndexArg]]]) -> List["pb.IndexSpec"]:
    if indexes is None:
        return []
    if isinstance(indexes, (str, pb.IndexSpec)):
        indexes = [indexes]
    elif isinstance(indexes, Mapping) and "method" not in indexes:
        indexes = [(m, p or {}) for m, p in indexes.items()]
    out = []
    for ix in indexes:
        if isinstance(ix, pb.IndexSpec):
            out.append(ix)
            continue
        if isinstance(ix, str):
            method, params = ix, {}
        elif isinstance(ix, Mapping):
            method, params = ix["method"], ix.get("params") or {}
        else:
            method, params = ix
        out.append(pb.IndexSpec(method=str(method),
                                params={str(k): str(v) for k, v in dict(params).items()}))
    return out


def _token_ids(tokens: TokensArg) -> List[int]:
    """Token ids as Python ints. Non-integers (floats, bools, strings, float
    arrays) are a TypeError naming the field: int() would truncate 1.9 to 1
    and build another context."""
    if isinstance(tokens, (list, tuple)):
        ids = []
        for i, t in enumerate(tokens):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise TypeError(f"tokens: expected integer token ids, got "
                                f"{type(t).__name__} {t!r} at index {i}")
            ids.append(int(t))
    else:
        if _t._is_torch(tokens):
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D sequence, got shape {list(arr.shape)}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"tokens: expected integer token ids, got a {arr.dtype} array")
        ids = arr.astype(np.int64).tolist()
    for t in ids:
        if not 0 <= t < (1 << 32):
            raise ValueError(f"tokens: id {t} is not a uint32")
    return ids


def _labels(labels: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    return {str(k): str(v) for k, v in (labels or {}).items()}


def _state(state: Any) -> int:
    if state is None:
        return st.CONTEXT_STATE_UNSPECIFIED
    if isinstance(state, str):
        name = state.upper()
        if not name.startswith("CONTEXT_STATE_"):
            name = "CONTEXT_STATE_" + name
        return st.ContextState.Value(name)
    return int(state)


def _model_spec(model: Union["st.ModelSpec", Mapping[str, Any]]) -> "st.ModelSpec":
    if isinstance(model, st.ModelSpec):
        spec = st.ModelSpec()
        spec.CopyFrom(model)
    else:
        m = dict(model)
        rope = m.pop("rope", None)
        kv_dtype = m.pop("kv_dtype", None)
        fp = m.pop("fingerprint", b"")
        spec = st.ModelSpec(**m)
        if rope is not None:
            if isinstance(rope, st.RopeParams):
                spec.rope.CopyFrom(rope)
            else:
                spec.rope.CopyFrom(st.RopeParams(**dict(rope)))
        if kv_dtype is not None:
            spec.kv_dtype = _t.parse_dtype(kv_dtype)
        spec.fingerprint = bytes.fromhex(fp) if isinstance(fp, str) else bytes(fp)
    if spec.kv_dtype == st.DTYPE_UNSPECIFIED:
        spec.kv_dtype = st.DTYPE_BF16
    return spec


def ingest_header(model: Optional[Union["st.ModelSpec", Mapping[str, Any]]], tokens: TokensArg,
                  *, indexes: Optional[Union[IndexArg, Iterable[IndexArg]]] = None,
                  name: str = "", labels: Optional[Mapping[str, Any]] = None,
                  ttl_seconds: int = 0, pin: bool = False, tenant: str = "",
                  parent_id: str = "") -> "pb.IngestHeader":
    """The ``IngestHeader`` of an ingest (arguments as :meth:`Client.ingest`;
    ``model`` None leaves it unset: a child's is then its parent's). Used by
    :meth:`Client.ingest` and the native client's ingest."""
    header = pb.IngestHeader(indexes=_index_specs(indexes), name=name, labels=_labels(labels),
                             ttl_seconds=int(ttl_seconds), pin=pin, tenant=tenant,
                             parent_id=parent_id)
    if model is not None:
        header.model.CopyFrom(_model_spec(model))
    header.tokens.ids.extend(_token_ids(tokens))
    return header


class _TqdmBar:
    """A tqdm progress bar for build/extend (tokens prefilled, then layers indexed)."""

    def __init__(self, tqdm_cls: Any, desc: str) -> None:
        self._tqdm = tqdm_cls
        self._desc = desc
        self._bar: Any = None
        self._phase = -1

    def __call__(self, p: "pb.BuildProgress") -> None:
        if p.phase != self._phase and p.phase in (pb.BuildProgress.PREFILL,
                                                  pb.BuildProgress.INDEXING):
            self.close()
            total = p.tokens_total if p.phase == pb.BuildProgress.PREFILL else p.layers_total
            unit = "tok" if p.phase == pb.BuildProgress.PREFILL else "layer"
            self._bar = self._tqdm(total=int(total) or None, unit=unit,
                                   desc=f"{self._desc} {_PHASE_NAMES[p.phase]}")
        self._phase = p.phase
        if self._bar is not None:
            n = p.tokens_prefilled if p.phase == pb.BuildProgress.PREFILL else p.layers_indexed
            self._bar.update(max(0, int(n) - int(self._bar.n)))
        if p.phase == pb.BuildProgress.DONE:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _progress_callback(on_progress: Optional[ProgressCallback], progress: Optional[bool],
                       desc: str) -> Tuple[Optional[ProgressCallback], Optional[_TqdmBar]]:
    if on_progress is not None or progress is False:
        return on_progress, None
    if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None, None
    try:
        from tqdm.auto import tqdm  # optional dependency
    except ImportError:
        return None, None
    bar = _TqdmBar(tqdm, desc)
    return bar, bar


class Watcher(Iterator["pb.ContextEvent"]):
    """An iterator over context events (``ContextEvent``: CREATED, READY, EXTENDED,
    EVICTED, FAILED). Returned by :meth:`Client.watch` once the subscription is
    live, so every event after that call is seen. Iteration ends (without
    error) when the deadline passes, ``max_events`` were yielded, :meth:`close`
    is called, or the server ends the stream; other failures raise
    :class:`ctxcache.Error`. Usable as a context manager."""

    def __init__(self, call: Any, max_events: Optional[int], address: str) -> None:
        self._call = call
        self._left = max_events
        self._address = address
        self._done = False
        self._pending: List["pb.ContextEvent"] = []
        first = self._read()  # the subscription marker (TYPE_UNSPECIFIED)
        if first is not None and first.type != pb.ContextEvent.TYPE_UNSPECIFIED:
            self._pending.append(first)

    def _read(self) -> Optional["pb.ContextEvent"]:
        if self._done:
            return None
        try:
            return next(self._call)
        except StopIteration:
            self._done = True
            return None
        except grpc.RpcError as e:
            self._done = True
            if e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise errors.Unavailable(
                    f"cannot reach ctxcached at {self._address} ({e.details()})",
                    rpc="WatchContexts") from None
            raise errors.from_rpc_error(e, "WatchContexts") from None

    def __iter__(self) -> "Watcher":
        return self

    def __next__(self) -> "pb.ContextEvent":
        if self._left is not None and self._left <= 0:
            self.close()
            raise StopIteration
        while True:
            ev = self._pending.pop(0) if self._pending else self._read()
            if ev is None:
                raise StopIteration
            if ev.type == pb.ContextEvent.TYPE_UNSPECIFIED:
                continue
            if self._left is not None:
                self._left -= 1
            return ev

    def close(self) -> None:
        """Ends the subscription (idempotent)."""
        if not self._done:
            self._done = True
            self._call.cancel()

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <key>`` to every call (plaintext or TLS:
    gRPC's own call credentials refuse plaintext channels, which loopback
    deployments use)."""

    def __init__(self, key: str) -> None:
        self._md = ("authorization", "Bearer " + key)

    def _details(self, d: Any) -> Any:
        md = list(d.metadata or []) + [self._md]
        return d._replace(metadata=md) if hasattr(d, "_replace") else _CallDetails(d, md)

    def intercept_unary_unary(self, cont, details, request):  # type: ignore[no-untyped-def]
        return cont(self._details(details), request)

    def intercept_unary_stream(self, cont, details, request):  # type: ignore[no-untyped-def]
        return cont(self._details(details), request)

    def intercept_stream_unary(self, cont, details, it):  # type: ignore[no-untyped-def]
        return cont(self._details(details), it)

    def intercept_stream_stream(self, cont, details, it):  # type: ignore[no-untyped-def]
        return cont(self._details(details), it)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, d: Any, metadata: Any) -> None:
        self.method = d.method
        self.timeout = d.timeout
        self.metadata = metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class Client:
    """A connection to ctxcached.

    Args:
        address: ``HOST:PORT`` of ctxcached (default ``127.0.0.1:7700``).
        timeout: deadline of each call attempt and of each session message, seconds.
        max_attempts: attempts for idempotent calls failing with UNAVAILABLE
            (1 = no retry; evict is never retried).
        initial_backoff: bound of the first retry delay, seconds; doubled each
            attempt (cap 5 s); each delay is drawn from [bound / 2, bound].
        max_message_bytes: largest gRPC message sent or received (default 16 MiB;
            the server's own limit is 8 MiB).
        options: extra gRPC channel options ``[(name, value), ...]``.
        tls_ca: path of the CA bundle (PEM) the server's certificate must chain
            to; set = TLS (docs/security.md). Default: plaintext.
        tls_cert, tls_key: paths of the client certificate and key (PEM) for mTLS.
        tls_server_name: verify the server certificate against this name
            instead of the host in ``address``.
        api_key: sent as ``authorization: Bearer <key>`` on every call
            (default: ``$CTXCACHE_API_KEY`` if set).
        sessions_per_connection: decode sessions (one stream each) per
            connection. Sessions go on connections of their own (never the
            client's, which stays free for the other calls), opened as
            needed; at most the server's ``--max-streams-per-connection``
            (default 256).

    Usable as a context manager (closes the channel).

    A cluster address, ``etcd://host:port[,host:port...]/<cluster>``, is
    :func:`ctxcache.connect`'s (a :class:`ctxcache.ClusterClient`, same
    methods, that routes each call to a node holding its context and fails
    over); Client raises ValueError for it.
    """

    def __init__(self, address: str = "127.0.0.1:7700", timeout: float = 30.0,
                 max_attempts: int = 5, initial_backoff: float = 0.1,
                 max_message_bytes: int = 16 << 20,
                 options: Optional[Sequence[Tuple[str, Any]]] = None,
                 tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_server_name: Optional[str] = None,
                 api_key: Optional[str] = None, sessions_per_connection: int = 256) -> None:
        if not address:
            raise ValueError("address is empty")
        if address.startswith("etcd://"):
            raise ValueError(f"{address} is a cluster address: use ctxcache.connect(address) "
                             "(or ctxcache.ClusterClient) for a routing client")
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.address = address
        self.timeout = float(timeout)
        self.max_attempts = max(1, int(max_attempts))
        self.initial_backoff = float(initial_backoff)
        opts = [("grpc.max_receive_message_length", int(max_message_bytes)),
                ("grpc.max_send_message_length", int(max_message_bytes))]
        opts.extend(options or [])
        if tls_server_name:
            opts.append(("grpc.ssl_target_name_override", tls_server_name))
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if tls_cert and not tls_ca:
            raise ValueError("tls_cert/tls_key (mTLS) need tls_ca (the server's CA)")
        if int(sessions_per_connection) < 1:
            raise ValueError(f"sessions_per_connection: {sessions_per_connection}, expected >= 1")
        key = api_key if api_key is not None else os.environ.get("CTXCACHE_API_KEY", "")

        def make_channel(extra: Sequence[Tuple[str, Any]] = ()) -> Tuple[Any, Any]:
            """(raw channel, channel with the API key) to ``address``."""
            o = opts + list(extra)
            if tls_ca:
                def read(path: str) -> bytes:
                    with open(path, "rb") as f:
                        return f.read()
                creds = grpc.ssl_channel_credentials(
                    root_certificates=read(tls_ca),
                    private_key=read(tls_key) if tls_key else None,
                    certificate_chain=read(tls_cert) if tls_cert else None)
                raw = grpc.secure_channel(address, creds, options=o)
            else:
                raw = grpc.insecure_channel(address, options=o)
            return raw, grpc.intercept_channel(raw, _BearerKey(key)) if key else raw

        self._raw_channel, channel = make_channel()
        self._channel = channel
        self._admin = _make_stub(self._channel, "ContextAdmin")
        self._decode = _make_stub(self._channel, "DecodeService")
        # Decode sessions (one stream each) go on connections of their own, at
        # most sessions_per_connection streams each (a local subchannel pool
        # per channel: gRPC would otherwise share one connection per target);
        # the channel above stays free for every other call.
        self.sessions_per_connection = int(sessions_per_connection)
        self._make_channel = make_channel
        self._session_lock = threading.Lock()
        self._session_conns: List[List[Any]] = []  # [stub, open streams, raw channel]
        self._health_check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_health().HealthCheckRequest.SerializeToString,
            response_deserializer=_health().HealthCheckResponse.FromString)

    # ------------------------------------------------------------ plumbing --

    def close(self) -> None:
        """Closes the channels; calls in flight are cancelled."""
        self._channel.close()
        for _, _, channel in self._session_conns:
            channel.close()

    def _session_stub(self) -> Tuple[Any, Callable[[], None]]:
        """The DecodeService stub of a connection with room for one more
        session stream, and the callable that gives the room back (once)."""
        with self._session_lock:
            for conn in self._session_conns:
                if conn[1] < self.sessions_per_connection:
                    break
            else:
                n = len(self._session_conns)
                raw, channel = self._make_channel([("grpc.use_local_subchannel_pool", 1),
                                                   ("ctxcache.connection", n)])
                conn = [_make_stub(channel, "DecodeService"), 0, raw]
                self._session_conns.append(conn)
            conn[1] += 1
        released = []

        def release() -> None:
            with self._session_lock:
                if not released:
                    released.append(True)
                    conn[1] -= 1
        return conn[0], release

    def sessions_per_connection_open(self) -> List[int]:
        """Open session streams per session connection, in opening order."""
        with self._session_lock:
            return [c[1] for c in self._session_conns]

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ctxcache.Client({self.address!r})"

    def _convert(self, e: grpc.RpcError, rpc: str) -> errors.Error:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return errors.Unavailable(f"cannot reach ctxcached at {self.address} ({e.details()})",
                                      rpc=rpc)
        return errors.from_rpc_error(e, rpc)

    def _retry(self, rpc: str, attempt: Callable[[], T], idempotent: bool = True) -> T:
        """Runs attempt() until it fails with something other than UNAVAILABLE,
        at most max_attempts times (once unless ``idempotent``), with jittered
        exponential backoff (client/sdk/retry.h)."""
        backoff = self.initial_backoff
        attempts = self.max_attempts if idempotent else 1
        for i in range(1, attempts + 1):
            try:
                return attempt()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and i < attempts:
                    time.sleep(random.uniform(backoff / 2, backoff))
                    backoff = min(_MAX_BACKOFF_S, backoff * 2)
                    continue
                raise self._convert(e, rpc) from None
        raise AssertionError("unreachable")

    def _unary(self, rpc: str, method: Callable[..., T], request: Any,
               idempotent: bool = True) -> T:
        return self._retry(rpc, lambda: method(request, timeout=self.timeout), idempotent)

    def _stream(self, rpc: str, method: Callable[..., Any], request: Any,
                consume: Callable[[Iterator[Any]], T], timeout: Optional[float] = None) -> T:
        """A server-streaming call retried as a whole: consume(responses) per attempt."""

        def attempt() -> T:
            call = method(request, timeout=timeout or self.timeout)
            try:
                return consume(call)
            finally:
                call.cancel()  # no-op once the stream is finished

        return self._retry(rpc, attempt)

    # --------------------------------------------------------------- health --

    def health(self, service: str = "") -> str:
        """The server's health status for ``service`` ("" = overall;
        "ctxcache.v1.ContextAdmin", "ctxcache.v1.DecodeService"): "SERVING",
        "NOT_SERVING" (draining), ... Raises :class:`ctxcache.Error` on failure."""
        h = _health()
        resp = self._unary("Health/Check", self._health_check,
                           h.HealthCheckRequest(service=service))
        return h.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 30.0, service: str = "") -> None:
        """Waits until the server reports SERVING; raises :class:`ctxcache.Unavailable`
        (or the last error) when ``timeout`` seconds pass first."""
        h = _health()
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                resp = self._health_check(h.HealthCheckRequest(service=service),
                                          timeout=min(1.0, left), wait_for_ready=True)
                if resp.status == h.HealthCheckResponse.SERVING:
                    return
                last = h.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        raise errors.Unavailable(f"ctxcached at {self.address} not SERVING after {timeout:g} s "
                                 f"(last: {last})", rpc="Health/Check")

    # ---------------------------------------------------------------- admin --

    def _run_build(self, rpc: str, method: Callable[..., Any], request: Any,
                   on_progress: Optional[ProgressCallback], progress: Optional[bool]
                   ) -> "pb.BuildProgress":
        callback, bar = _progress_callback(on_progress, progress, rpc)

        def consume(stream: Iterator["pb.BuildProgress"]) -> "pb.BuildProgress":
            last = None
            for p in stream:
                if callback is not None:
                    callback(p)
                if p.phase == pb.BuildProgress.DONE:
                    last = p
            if last is None:
                raise errors.Internal("build stream ended without a final message", rpc=rpc)
            return last

        try:
            return self._stream(rpc, method, request, consume,
                                timeout=max(self.timeout, _BUILD_TIMEOUT_S))
        finally:
            if bar is not None:
                bar.close()

    def build(self, text: Optional[str] = None, tokens: Optional[TokensArg] = None, *,
              model: str = "", indexes: Optional[Union[IndexArg, Iterable[IndexArg]]] = None,
              name: str = "", labels: Optional[Mapping[str, Any]] = None,
              ttl_seconds: int = 0, pin: bool = False, tenant: str = "", add_bos: bool = False,
              on_progress: Optional[ProgressCallback] = None,
              progress: Optional[bool] = None) -> "pb.BuildProgress":
        """Builds (prefills, indexes and stores) a context from text or token ids.

        Args:
            text: text, tokenized by the model's tokenizer (``add_bos`` prepends BOS).
            tokens: token ids (list, 1-D numpy array or torch tensor) instead of text.
            model: a model under the server's ``--model-dir`` ("" = its default).
            indexes: index methods to build, e.g. ``["csa", ("tactic", {...})]``
                (None = the server's ``--default-indexes``).
            name, labels, ttl_seconds, pin, tenant: stored with the context.
            on_progress: called with every ``BuildProgress`` message.
            progress: show a tqdm bar (None = when tqdm is importable, stderr is a
                terminal and no ``on_progress`` is given).

        Returns:
            The final ``BuildProgress`` (phase DONE): ``.context`` is the
            ``ContextInfo``, ``.reused`` is True when the context was already stored.

        Builds are idempotent (the id is a hash of model and tokens), so an
        UNAVAILABLE build is retried like any call.
        """
        if (text is None) == (tokens is None):
            raise ValueError("give exactly one of text= and tokens=")
        req = pb.BuildContextRequest(model=model, indexes=_index_specs(indexes), name=name,
                                     labels=_labels(labels), ttl_seconds=int(ttl_seconds),
                                     pin=pin, tenant=tenant, add_bos=add_bos)
        if text is not None:
            req.text = text
        else:
            req.tokens.ids.extend(_token_ids(tokens))
        return self._run_build("BuildContext", self._admin.BuildContext, req, on_progress,
                               progress)

    def extend(self, parent_id: str, text: Optional[str] = None,
               tokens: Optional[TokensArg] = None, *,
               indexes: Optional[Union[IndexArg, Iterable[IndexArg]]] = None, name: str = "",
               labels: Optional[Mapping[str, Any]] = None, ttl_seconds: int = 0,
               pin: bool = False, on_progress: Optional[ProgressCallback] = None,
               progress: Optional[bool] = None) -> "pb.BuildProgress":
        """Stores a new context = ``parent_id``'s tokens followed by text or tokens,
        prefilled on top of the parent's stored KV (its full pages are shared).
        Indexes default to the parent's. Returns the final ``BuildProgress``."""
        if (text is None) == (tokens is None):
            raise ValueError("give exactly one of text= and tokens=")
        req = pb.ExtendContextRequest(parent_id=parent_id, indexes=_index_specs(indexes),
                                      name=name, labels=_labels(labels),
                                      ttl_seconds=int(ttl_seconds), pin=pin)
        if text is not None:
            req.text = text
        else:
            req.tokens.ids.extend(_token_ids(tokens))
        return self._run_build("ExtendContext", self._admin.ExtendContext, req, on_progress,
                               progress)

    def ingest_chunks(self, chunks: Iterable["pb.IngestChunk"],
                      timeout: Optional[float] = None) -> "pb.ContextInfo":
        """Streams raw ``IngestChunk`` messages (header first, then layer chunks,
        then the commit) and returns the stored ``ContextInfo``. Not retried.
        An exception raised by the iterator cancels the upload (nothing is
        stored) and is re-raised here. ``timeout``: the whole stream's
        deadline in seconds (None: ``max(timeout, 3600)``)."""
        failure: List[BaseException] = []

        def guarded() -> Iterator["pb.IngestChunk"]:
            try:
                yield from chunks
            except BaseException as e:  # re-raised below, after gRPC cancels
                failure.append(e)
                raise

        try:
            return self._admin.IngestContext(
                guarded(),
                timeout=max(self.timeout, _BUILD_TIMEOUT_S) if timeout is None else timeout)
        except grpc.RpcError as e:
            if failure:
                raise failure[0] from None
            raise self._convert(e, "IngestContext") from None

    def ingest(self, model: Optional[Union["st.ModelSpec", Mapping[str, Any]]],
               tokens: TokensArg, layers: Iterable[Sequence[Any]], *,
               indexes: Optional[Union[IndexArg, Iterable[IndexArg]]] = None, name: str = "",
               labels: Optional[Mapping[str, Any]] = None, ttl_seconds: int = 0,
               pin: bool = False, tenant: str = "", dtype: Any = None,
               max_message_bytes: int = _INGEST_MESSAGE_BYTES, parent_id: str = "",
               parent_tokens: Optional[int] = None,
               timeout: Optional[float] = None) -> "pb.ContextInfo":
        """Stores a context from KV computed elsewhere (e.g. a GPU engine's prefill),
        or, with ``parent_id``, a child of a stored context from the KV of the
        tokens appended to it (e.g. an extension's prefill, decoded tokens).

        Args:
            model: the ``ModelSpec`` (or a dict of its fields: name, n_layers,
                n_q_heads, n_kv_heads, head_dim, rope, kv_dtype ("bf16" when
                unset), fingerprint (bytes or hex; required: it decides KV
                compatibility and is part of the context id)). With
                ``parent_id`` it must equal the parent's
                (:class:`ctxcache.FailedPrecondition` otherwise); None takes
                the parent's.
            tokens: all token ids of the context; with ``parent_id``, the
                appended tokens only (the child's tokens are the parent's
                followed by these).
            layers: one item per layer, in order: ``(k, v)`` or ``(k, v, q)`` with
                post-RoPE K, V ``[n_kv_heads, n_tokens, head_dim]`` and Q
                ``[n_q_heads, n_tokens, head_dim]`` (needed by query-centric
                indexes such as csa; may be None), numpy arrays or torch tensors
                (any device), ``n_tokens = len(tokens)``. A generator is consumed
                lazily, so layers can be produced one at a time.
            indexes, name, labels, ttl_seconds, pin, tenant: as for :meth:`build`
                (a child's defaults: the parent's indexes, name and labels).
            dtype: wire dtype of the chunks ("bf16", "f16", "f32"; None = the
                arrays' own: f32/f16/bf16 kept, others sent as f32). The server
                converts to the model's kv_dtype.
            max_message_bytes: each IngestChunk message stays under this (4 MiB).
            parent_id: ingest a child of this stored context ("" = none). The
                child shares the parent's pages as an :meth:`extend` child does.
            parent_tokens: the parent's n_tokens when the caller knows it (the
                chunks' token_start counts from the child's token 0); None asks
                the server (one GetContext, which also supplies ``model``).
            timeout: the stream's deadline in seconds (None: ``max(timeout, 3600)``).

        Returns:
            The stored ``ContextInfo`` (or the stored one with the same tokens
            and indexes). Validation failures raise
            :class:`ctxcache.InvalidArgument` and store nothing; an unknown
            parent :class:`ctxcache.NotFound`.
        """
        start = 0
        if parent_id:
            if parent_tokens is None or model is None:
                pinfo = self.get(parent_id)
                start = int(pinfo.n_tokens)
                if model is None:
                    model = pinfo.model
            if parent_tokens is not None:
                start = int(parent_tokens)
        elif model is None:
            raise ValueError("model: required unless parent_id is given")
        header = ingest_header(model, tokens, indexes=indexes, name=name, labels=labels,
                               ttl_seconds=ttl_seconds, pin=pin, tenant=tenant,
                               parent_id=parent_id)
        spec = header.model
        n_tokens = len(header.tokens.ids)
        nkv, nq, d = spec.n_kv_heads, spec.n_q_heads, spec.head_dim

        def messages() -> Iterator["pb.IngestChunk"]:
            yield pb.IngestChunk(header=header)
            n_layers = 0
            for layer, item in enumerate(layers):
                if len(item) not in (2, 3):
                    raise ValueError(f"layer {layer}: expected (k, v) or (k, v, q)")
                k, v = item[0], item[1]
                q = item[2] if len(item) == 3 else None
                for nm, a, heads in (("k", k, nkv), ("v", v, nkv), ("q", q, nq)):
                    if a is not None and tuple(a.shape) != (heads, n_tokens, d):
                        raise ValueError(f"layer {layer}: {nm} has shape {list(a.shape)}, "
                                         f"expected {[heads, n_tokens, d]}")
                itemsize = 4 if dtype is None else _t._ITEMSIZE[_t.parse_dtype(dtype)]
                per_token = (2 * nkv + (nq if q is not None else 0)) * d * itemsize
                step = max(1, (int(max_message_bytes) - 4096) // max(1, per_token))
                for t0 in range(0, n_tokens, step):
                    t1 = min(n_tokens, t0 + step)
                    c = pb.IngestLayerChunk(layer=layer, token_start=start + t0,
                                            n_tokens=t1 - t0)
                    c.k.CopyFrom(_t.encode_tensor(k[:, t0:t1], name="k", dtype=dtype))
                    c.v.CopyFrom(_t.encode_tensor(v[:, t0:t1], name="v", dtype=dtype))
                    if q is not None:
                        c.q.CopyFrom(_t.encode_tensor(q[:, t0:t1], name="q", dtype=dtype))
                    yield pb.IngestChunk(chunk=c)
                n_layers += 1
            if n_layers != spec.n_layers:
                raise ValueError(f"got {n_layers} layers of KV, the model has {spec.n_layers}")
            yield pb.IngestChunk(commit=pb.IngestCommit())

        return self.ingest_chunks(messages(), timeout=timeout)

    def get(self, context_id: str) -> "pb.ContextInfo":
        """The ``ContextInfo`` of a context (:class:`ctxcache.NotFound` if unknown,
        :class:`ctxcache.InvalidArgument` for a malformed id)."""
        return self._unary("GetContext", self._admin.GetContext,
                           pb.GetContextRequest(context_id=context_id))

    def list_page(self, page_size: int = 100, page_token: str = "",
                  label_filter: Optional[Mapping[str, Any]] = None,
                  state: Any = None, tenant: str = "") -> "pb.ListContextsResponse":
        """One page of ``ListContexts`` (``.contexts``, ``.next_page_token``).
        ``tenant``: list only that tenant's contexts; an operator may name any
        tenant, every other role only its own (:class:`ctxcache.PermissionDenied`
        otherwise)."""
        req = pb.ListContextsRequest(page_size=int(page_size), page_token=page_token,
                                     label_filter=_labels(label_filter),
                                     state_filter=_state(state), tenant=tenant)
        return self._unary("ListContexts", self._admin.ListContexts, req)

    def list(self, label_filter: Optional[Mapping[str, Any]] = None, state: Any = None,
             page_size: int = 100, limit: Optional[int] = None,
             tenant: str = "") -> Iterator["pb.ContextInfo"]:
        """Iterates over stored contexts, fetching pages of ``page_size`` (≤ 1000) as
        needed. ``label_filter``: all given labels must match; ``state``: e.g.
        "READY" (None = any); ``limit``: stop after this many."""
        token = ""
        seen_tokens = set()
        n = 0
        while True:
            resp = self.list_page(page_size, token, label_filter, state, tenant)
            for c in resp.contexts:
                if limit is not None and n >= limit:
                    return
                n += 1
                yield c
            token = resp.next_page_token
            if not token:
                return
            if token in seen_tokens:
                raise errors.Internal(f"ListContexts returned page token {token!r} twice",
                                      rpc="ListContexts")
            seen_tokens.add(token)

    def evict(self, context_id: str) -> "pb.EvictContextResponse":
        """Deletes a context now, or when its last session closes (``deferred``).
        Pinned contexts and parents: :class:`ctxcache.FailedPrecondition`."""
        return self._unary("EvictContext", self._admin.EvictContext,
                           pb.EvictContextRequest(context_id=context_id), idempotent=False)

    def pin(self, context_id: str, pinned: bool = True) -> "pb.ContextInfo":
        """Pins (never evicted) or, with ``pinned=False``, unpins a context."""
        return self._unary("PinContext", self._admin.PinContext,
                           pb.PinContextRequest(context_id=context_id, pinned=pinned))

    def unpin(self, context_id: str) -> "pb.ContextInfo":
        """``pin(context_id, False)``."""
        return self.pin(context_id, False)

    def share(self, context_id: str, shared: bool = True) -> "pb.ContextInfo":
        """Role admin (its own tenant's contexts) or operator (any): makes a
        context readable by every tenant (``shared=False`` undoes it). Another
        tenant's context is :class:`ctxcache.NotFound`, as an unknown id."""
        return self._unary("ShareContext", self._admin.ShareContext,
                           pb.ShareContextRequest(context_id=context_id, shared=shared))

    def stats(self) -> "pb.ServerStats":
        """``ServerStats``: version, uptime, contexts, bytes, models, ... Server-wide
        for the operator role; every other role gets its own tenant's contexts and
        bytes only."""
        return self._unary("GetStats", self._admin.GetStats, pb.GetStatsRequest())

    # --------------------------------------------------------------- decode --

    def watch(self, context_id: str = "", label_filter: Optional[Mapping[str, Any]] = None,
              timeout: Optional[float] = None, max_events: Optional[int] = None) -> Watcher:
        """Subscribes to context events (all contexts, or one id, or those whose
        labels match). Returns a :class:`Watcher` once the subscription is live;
        it yields events until ``timeout`` seconds pass (None = no limit),
        ``max_events`` were yielded, or it is closed. Not retried."""
        req = pb.WatchRequest(context_id=context_id, label_filter=_labels(label_filter))
        call = self._decode.WatchContexts(req, timeout=timeout)
        return Watcher(call, max_events, self.address)

    def fetch_index(self, context_id: str, method: str,
                    layers: Optional[Iterable[int]] = None,
                    kv_heads: Optional[Iterable[int]] = None) -> Dict[Tuple[int, int], bytes]:
        """The serialized index artifacts of ``method`` for client-side selection:
        ``{(layer, kv_head): bytes}``, each checked against its total size and
        crc32c (:class:`ctxcache.DataLoss`). ``layers``/``kv_heads``: None = all.
        A method not built for the context: :class:`ctxcache.FailedPrecondition`
        or :class:`ctxcache.InvalidArgument` (unknown method)."""
        req = pb.FetchIndexRequest(context_id=context_id, methods=[method],
                                   layers=list(layers or []), kv_heads=list(kv_heads or []))

        def consume(stream: Iterator["pb.IndexChunk"]) -> Dict[Tuple[int, int], bytes]:
            parts: Dict[Tuple[int, int], List[bytes]] = {}
            out: Dict[Tuple[int, int], bytes] = {}
            last: Dict[Tuple[int, int], "pb.IndexChunk"] = {}
            for c in stream:
                key = (c.layer, c.kv_head)
                parts.setdefault(key, []).append(c.data)
                if c.chunk_index + 1 == c.n_chunks:
                    out[key] = b"".join(parts.pop(key))
                    last[key] = c
            if parts:
                raise errors.DataLoss(f"index stream ended inside artifacts {sorted(parts)}",
                                      rpc="FetchIndex")
            # Every artifact's crc in one batched pass (on a GPU when torch sees one).
            got = crc32c_many(list(out.values()))
            for (key, data), crc in zip(out.items(), got):
                c = last[key]
                if len(data) != c.total_bytes or int(crc) != c.crc32c:
                    raise errors.DataLoss(
                        f"index artifact crc32c mismatch (layer {c.layer}, kv head "
                        f"{c.kv_head}, method {c.method}: {len(data)} of {c.total_bytes} "
                        f"bytes)", rpc="FetchIndex")
            return out

        return self._stream("FetchIndex", self._decode.FetchIndex, req, consume)

    def fetch_pages(self, context_id: str, tables: Iterable[Any], dtype: str = "float32",
                    as_torch: bool = False) -> List[Page]:
        """Fetches KV pages, crc32c-checked.

        Args:
            context_id: the context.
            tables: ``PageTable`` messages, ``(layer, kv_head, blocks)`` tuples or
                dicts with those keys; blocks are page indices (tokens
                ``[16 b, 16 b + 16)``).
            dtype: "float32" (decoded; bf16 is exact in float32) or "raw" (as
                stored: uint16 bf16 bits, float16 or float32).
            as_torch: return ``k``/``v`` as torch tensors (raw bf16 as
                ``torch.bfloat16``); ImportError without torch.

        Returns:
            :class:`ctxcache.Page` objects with ``k``, ``v`` of ``[n_tokens, head_dim]``,
            in the order the server sent them (by table, then block).
        """
        if as_torch and not _t.torch_available():
            raise ImportError("as_torch=True needs torch")
        raw = self.fetch_wire_pages(context_id, tables)
        check_page_crcs(raw, rpc="FetchPages")  # one batched pass, not a loop per page
        return [decode_page(p, dtype, as_torch, rpc="FetchPages", crc_checked=True) for p in raw]

    def fetch_wire_pages(self, context_id: str, tables: Iterable[Any]) -> List["pb.Page"]:
        """FetchPages without decoding: the wire ``Page`` messages in the
        order the server sent them, **crc32c not checked**. For callers that
        move many pages in bulk and check the crcs themselves where the bytes
        land, or with :func:`check_page_crcs`; ``tables`` as in :meth:`fetch_pages`."""
        req = pb.FetchPagesRequest(context_id=context_id, tables=[_page_table(t) for t in tables])

        def consume(stream: Iterator["pb.PageBatch"]) -> List["pb.Page"]:
            return [p for batch in stream for p in batch.pages]

        return self._stream("FetchPages", self._decode.FetchPages, req, consume)

    def open_session(self, context_id: str, method: str = "csa",
                     params: Optional[Mapping[str, Any]] = None, *, as_torch: bool = False,
                     dtype: str = "float32", timeout: Optional[float] = None) -> "Session":
        """Opens a decode session with server-side selection (see
        :class:`ctxcache.Session`): the server selects each step's tokens and
        sends their pages. ``params``: e.g. ``{"rho": 0.05}``, ``{"budget": 64}``,
        ``page_fraction``, ``whole_pages``, ``subgroup``, ``recent_blocks``,
        ``estimate_mass``, csa's ``rerank`` (docs/api.md). ``as_torch``/``dtype``:
        the form of the returned K/V.
        ``timeout``: how long each session message waits for its reply (default:
        the client's timeout; ``Session.timeout`` may be changed later)."""
        return Session._open(self, context_id, method, params or {}, as_torch, dtype,
                             timeout or self.timeout)


# (client streaming, server streaming) of each RPC, for protobuf runtimes whose
# MethodDescriptor lacks those attributes.
_STREAMING = {
    "BuildContext": (False, True), "IngestContext": (True, False),
    "ExtendContext": (False, True), "Decode": (True, True), "FetchIndex": (False, True),
    "FetchPages": (False, True), "WatchContexts": (False, True),
}


def _make_stub(channel: grpc.Channel, service: str) -> Any:
    """A stub of a ctxcache.v1 service built from its descriptor: one gRPC
    multicallable per RPC, named like the RPC (``stub.GetContext``).

    Equivalent to the generated ``*_pb2_grpc`` stub classes, which the client
    does not need: only ``protoc --python_out`` is required to build the
    package (grpc_python_plugin / grpcio-tools are optional)."""
    svc = pb.DESCRIPTOR.services_by_name[service]
    kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    methods = {}
    for m in svc.methods:
        streaming = (getattr(m, "client_streaming", None), getattr(m, "server_streaming", None))
        if None in streaming:
            streaming = _STREAMING.get(m.name, (False, False))
        methods[m.name] = kinds[streaming](
            f"/{svc.full_name}/{m.name}",
            request_serializer=getattr(pb, m.input_type.name).SerializeToString,
            response_deserializer=getattr(pb, m.output_type.name).FromString)
    return types.SimpleNamespace(**methods)


def _page_table(t: Any) -> "pb.PageTable":
    if isinstance(t, pb.PageTable):
        return t
    if isinstance(t, Mapping):
        return pb.PageTable(layer=int(t["layer"]), kv_head=int(t["kv_head"]),
                            subgroup=int(t.get("subgroup", 0)),
                            blocks=[int(b) for b in t["blocks"]])
    layer, kv_head, blocks = t
    return pb.PageTable(layer=int(layer), kv_head=int(kv_head), blocks=[int(b) for b in blocks])


_health_mod: Any = None


def _health() -> Any:
    """grpc.health.v1 messages: grpcio-health-checking's when installed (so the
    two never register the same proto file twice), else the generated copy."""
    global _health_mod
    if _health_mod is None:
        try:
            from grpc_health.v1 import health_pb2 as mod  # type: ignore
        except ImportError:
            from ctxcache import _health_pb2 as mod  # type: ignore
        _health_mod = mod
    return _health_mod
