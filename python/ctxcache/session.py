"""Decode sessions with server-side selection (the SDK's ``SelectMode::kServer``).

A session is one ``Decode`` bidi stream: ``Open`` once, then per generated
token a ``step`` per layer (the layer's queries in; the selected token ids,
the page tables and the pages of those tokens out) and one ``append`` (the
new token's K/V/Q of every layer), and finally ``close``.

>>> with client.open_session(context_id, method="csa", params={"rho": 0.05}) as s:
...     r = s.step(0, queries)          # queries: [n_q_heads, head_dim]
...     r.heads[0].per_q_head[0]        # token ids selected for q head 0
...     r.heads[0].k                    # their K rows, [len(ids), head_dim]
...     s.append(k, v, q)               # [n_layers, n_kv_heads|n_q_heads, head_dim]

Every message waits at most ``timeout`` seconds (default: the client's) for its reply
(:class:`ctxcache.DeadlineExceeded`, after which the session is closed).
Errors the server reports in-band (``RequestError``: bad shapes, NaN, layer
out of range, ...) raise the matching :class:`ctxcache.Error` and leave the
session usable. Not thread-safe: one session per thread.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional

import grpc
import numpy as np

from ctxcache import errors
from ctxcache import tensors as _t
from ctxcache.page_codec import check_page_crcs, decode_page
from ctxcache.types import HeadResult, Page, StepResult
from ctxcache.v1 import ctxcache_service_pb2 as pb

if TYPE_CHECKING:
    from ctxcache.client import Client

__all__ = ["Session"]

_END = object()


class _Stream:
    """The Decode stream: a request queue feeding gRPC and a reader thread
    filling a response queue, so every reply can be awaited with a timeout."""

    def __init__(self, stub_method: Any) -> None:
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self.responses: "queue.Queue[Any]" = queue.Queue()
        self.call = stub_method(self._request_iter())
        self._reader = threading.Thread(target=self._read, args=(self.call, self.responses),
                                        name="ctxcache-decode-reader", daemon=True)
        self._reader.start()

    def _request_iter(self) -> Iterator["pb.DecodeRequest"]:
        while True:
            item = self._requests.get()
            if item is _END:
                return
            yield item

    @staticmethod
    def _read(call: Any, out: "queue.Queue[Any]") -> None:
        try:
            for resp in call:
                out.put(resp)
            out.put(None)
        except grpc.RpcError as e:
            out.put(e)
        except Exception as e:  # pragma: no cover - defensive
            out.put(e)

    def send(self, req: "pb.DecodeRequest") -> None:
        self._requests.put(req)

    def finish(self, timeout: float) -> None:
        """Half-closes the stream and waits for the server to end it."""
        self._requests.put(_END)
        self._reader.join(timeout)
        if self._reader.is_alive():
            self.call.cancel()
            self._reader.join(1.0)

    def cancel(self) -> None:
        self._requests.put(_END)
        self.call.cancel()


class Session:
    """A server-select decode session on one context; see the module docstring.

    Attributes:
        session_id: the server's id of the session.
        context: the ``ContextInfo`` at open.
        model: the context's ``ModelSpec`` (n_layers, n_q_heads, n_kv_heads, head_dim).
        n_tokens: tokens in the session's sequence (context + appended).
        method, params: the selection method and its params.
        timeout: seconds each message waits for its reply (may be changed).
    """

    def __init__(self) -> None:  # use Client.open_session
        self._stream: Optional[_Stream] = None
        self._closed = True
        self._release: Callable[[], None] = lambda: None  # its connection's room

    @classmethod
    def _open(cls, client: "Client", context_id: str, method: str,
              params: Mapping[str, Any], as_torch: bool, dtype: str,
              timeout: float) -> "Session":
        if as_torch and not _t.torch_available():
            raise ImportError("as_torch=True needs torch")
        if dtype not in ("float32", "raw"):
            raise ValueError(f"dtype must be 'float32' or 'raw', not {dtype!r}")
        s = cls()
        s._client = client
        s.timeout = float(timeout)
        s._as_torch = as_torch
        s._dtype = dtype
        s._next_id = 1
        s.method = method
        s.params = {str(k): str(v) for k, v in params.items()}
        req = pb.DecodeRequest(open=pb.OpenSession(context_id=context_id, method=method,
                                                   params=s.params, want_pages=True))
        backoff = client.initial_backoff
        for attempt in range(1, client.max_attempts + 1):
            stub, s._release = client._session_stub()
            weakref.finalize(s, s._release)  # a session dropped unclosed
            s._stream = _Stream(stub.Decode)
            s._closed = False
            try:
                resp = s._round_trip(req)
                break
            except errors.Unavailable:
                s._abort()
                if attempt >= client.max_attempts:
                    raise
                time.sleep(backoff)
                backoff = min(5.0, backoff * 2)
            except BaseException:
                s._abort()
                raise
        s.session_id = resp.opened.session_id
        s.context = resp.opened.context
        s.model = s.context.model
        s.n_tokens = int(s.context.n_tokens)
        return s

    # ------------------------------------------------------------ plumbing --

    @property
    def closed(self) -> bool:
        """True after :meth:`close` or a broken stream."""
        return self._closed

    def _abort(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        self._closed = True
        self._release()

    def _receive(self, rid: int) -> "pb.DecodeResponse":
        assert self._stream is not None
        try:
            item = self._stream.responses.get(timeout=self.timeout)
        except queue.Empty:
            self._abort()
            raise errors.DeadlineExceeded(
                f"no reply from ctxcached within {self.timeout:g} s; session closed",
                rpc="Decode") from None
        if isinstance(item, pb.DecodeResponse):
            if item.request_id != rid:
                self._abort()
                raise errors.Internal(f"reply to request {item.request_id}, expected {rid}",
                                      rpc="Decode")
            return item
        self._abort()  # the stream ended: release the request feeder too
        if isinstance(item, grpc.RpcError):
            if item.code() == grpc.StatusCode.UNAVAILABLE:
                raise errors.Unavailable(
                    f"decode stream broke: cannot reach ctxcached at {self._client.address} "
                    f"({item.details()})", rpc="Decode")
            raise errors.from_rpc_error(item, "Decode")
        if isinstance(item, BaseException):
            raise errors.Internal(f"decode stream failed: {item!r}", rpc="Decode")
        raise errors.Unavailable("decode stream ended by the server", rpc="Decode")

    def _round_trip(self, req: "pb.DecodeRequest",
                    batches: Optional[List["pb.PageBatch"]] = None) -> "pb.DecodeResponse":
        if self._closed or self._stream is None:
            raise errors.FailedPrecondition("session is closed", rpc="Decode")
        rid = self._next_id
        self._next_id += 1
        req.request_id = rid
        self._stream.send(req)
        resp = self._receive(rid)
        which = resp.WhichOneof("msg")
        if which == "error":
            raise errors.error_for_code(resp.error.code, resp.error.message, "Decode")
        if which == "step" and batches is not None:
            for _ in range(resp.step.n_page_batches):
                pr = self._receive(rid)
                if pr.WhichOneof("msg") != "pages":
                    self._abort()
                    raise errors.Internal("decode stream: expected a page batch", rpc="Decode")
                batches.append(pr.pages)
        return resp

    # ------------------------------------------------------------------ API --

    def step(self, layer: int, queries: Any) -> StepResult:
        """Selects the context tokens for ``layer`` and returns them with their pages.

        Args:
            layer: the layer (0 ≤ layer < n_layers; else InvalidArgument from the server).
            queries: post-RoPE queries of all q heads, ``[n_q_heads, head_dim]``
                (numpy or torch; f32/f16/bf16 sent as is, others as f32).

        Returns:
            A :class:`ctxcache.StepResult`: per kv head the per-q-head selections,
            the page list and the K/V of the pages (and of the selected tokens).
        """
        m = self.model
        tensor = _t.encode_tensor(queries, (m.n_q_heads, m.head_dim), "queries")
        req = pb.DecodeRequest(step=pb.StepRequest(layer=int(layer), queries=tensor))
        batches: List["pb.PageBatch"] = []
        resp = self._round_trip(req, batches)
        return self._assemble(resp.step, batches)

    def _assemble(self, step: "pb.StepResult", batches: List["pb.PageBatch"]) -> StepResult:
        m = self.model
        n_q, n_kv = m.n_q_heads, m.n_kv_heads
        g = max(1, n_q // n_kv)
        block = int(self.context.block_tokens) or 16
        empty = np.zeros(0, dtype=np.int64)
        heads = [HeadResult(kv_head=h, per_q_head=[empty] * g) for h in range(n_kv)]
        selections: List[np.ndarray] = [empty] * n_q
        mass: List[Optional[float]] = [None] * n_q
        for s in step.selections:
            if s.q_head >= n_q:
                raise errors.DataLoss(f"selection of q head {s.q_head} out of range", rpc="Decode")
            ids = np.array(s.token_ids, dtype=np.int64)
            selections[s.q_head] = ids
            if s.HasField("estimated_mass"):
                mass[s.q_head] = float(s.estimated_mass)
            heads[s.q_head // g].per_q_head[s.q_head % g] = ids
        tables = []
        blocks: List[set] = [set() for _ in range(n_kv)]
        for pt in step.page_tables:
            if pt.kv_head >= n_kv:
                raise errors.DataLoss(f"page table of kv head {pt.kv_head} out of range",
                                      rpc="Decode")
            tables.append((pt.kv_head, pt.subgroup, list(pt.blocks)))
            blocks[pt.kv_head].update(pt.blocks)
        pages: List[Dict[int, Page]] = [{} for _ in range(n_kv)]
        received = 0
        check_page_crcs([p for b in batches for p in b.pages], rpc="Decode")
        for b in batches:
            for p in b.pages:
                if p.kv_head >= n_kv:
                    raise errors.DataLoss(f"page of kv head {p.kv_head} out of range",
                                          rpc="Decode")
                received += len(p.k) + len(p.v)
                pages[p.kv_head][p.block] = decode_page(p, "float32", rpc="Decode",
                                                        crc_checked=True)
        for h, head in enumerate(heads):
            head.blocks = sorted(blocks[h] | set(pages[h]))
            parts = [x for x in head.per_q_head if x.size]
            head.ids = np.unique(np.concatenate(parts)) if parts else empty
            missing = sorted({int(i) // block for i in head.ids} - set(pages[h]))
            if missing:
                raise errors.DataLoss(f"server selected tokens of block {missing[0]} (kv head "
                                      f"{h}) but sent no page for it", rpc="Decode")
            ordered = [pages[h][b] for b in sorted(pages[h])]
            d = m.head_dim
            if ordered:
                kk = np.zeros((len(ordered), block, d), dtype=np.float32)
                vv = np.zeros_like(kk)
                pos = {}
                for i, p in enumerate(ordered):
                    kk[i, :p.n_tokens] = p.k
                    vv[i, :p.n_tokens] = p.v
                    pos[p.block] = i
                idx = np.array([pos[int(i) // block] for i in head.ids], dtype=np.int64)
                rows = head.ids % block
                head.k, head.v = kk[idx, rows], vv[idx, rows]
            else:
                head.k = np.zeros((0, d), dtype=np.float32)
                head.v = np.zeros((0, d), dtype=np.float32)
            head.pages = [self._convert_page(p) for p in ordered]
            if self._as_torch:
                head.k, head.v = _t.to_torch(head.k), _t.to_torch(head.v)
        return StepResult(layer=step.layer, heads=heads, selections=selections,
                          page_tables=tables, stats=step.stats, bytes_received=received,
                          estimated_mass=mass)

    def _convert_page(self, p: Page) -> Page:
        # Pages were decoded to float32 for the gather; re-express as asked.
        if self._dtype == "raw" and p.dtype == "bf16":
            p.k, p.v = _t.float32_to_bf16(p.k), _t.float32_to_bf16(p.v)
        elif self._dtype == "raw" and p.dtype == "f16":
            p.k, p.v = p.k.astype(np.float16), p.v.astype(np.float16)
        if self._as_torch:
            wire = {"bf16": 3, "f16": 2, "f32": 1}[p.dtype] if self._dtype == "raw" else None
            p.k, p.v = _t.to_torch(p.k, wire), _t.to_torch(p.v, wire)
        return p

    def append(self, k: Any, v: Any, q: Any = None, token_id: int = 0) -> int:
        """Appends one generated token: its post-RoPE K and V of every layer
        ``[n_layers, n_kv_heads, head_dim]`` and optionally Q
        ``[n_layers, n_q_heads, head_dim]`` (query-centric indexes learn from it).
        Returns the session's new ``n_tokens``."""
        m = self.model
        req = pb.DecodeRequest(append=pb.AppendRequest(
            k=_t.encode_tensor(k, (m.n_layers, m.n_kv_heads, m.head_dim), "k"),
            v=_t.encode_tensor(v, (m.n_layers, m.n_kv_heads, m.head_dim), "v"),
            token_id=int(token_id)))
        if q is not None:
            req.append.q.CopyFrom(_t.encode_tensor(q, (m.n_layers, m.n_q_heads, m.head_dim), "q"))
        resp = self._round_trip(req)
        self.n_tokens = int(resp.appended.n_tokens)
        return self.n_tokens

    def close(self) -> None:
        """Closes the session (idempotent); the server releases its lease."""
        if self._closed or self._stream is None:
            return
        try:
            self._round_trip(pb.DecodeRequest(close=pb.CloseSession()))
        finally:
            self._closed = True
            self._stream.finish(self.timeout)
            self._release()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc and exc[0] is not None:
            try:
                self.close()
            except errors.Error:
                pass  # keep the original exception
        else:
            self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._abort()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<ctxcache.Session {getattr(self, 'session_id', '?')} {state} "
                f"method={getattr(self, 'method', '?')} n_tokens={getattr(self, 'n_tokens', '?')}>")
