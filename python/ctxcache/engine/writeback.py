"""Write-back of appended tokens: the K/V a worker computes after a stored
context (an extension's prefill, each sequence's decoded tokens) stored on
the server as a child of that context, off the decode step's critical path.

One :class:`WriteBack` per sequence. ``append`` takes the ids and the
post-RoPE K/V (and optionally Q) of tokens that directly follow what the
writer has taken so far, which starts right after the stored context:

  1. copy: device to pinned host memory on a side CUDA stream, which waits
     for the caller's stream (``wait_stream``, no host sync), with
     non_blocking copies and an event; on CPU tensors, a plain copy. The
     source must keep its rows until the copy ran: before the caller's stream
     overwrites them (``OwnTokens.reset``, a new extension), it calls
     :meth:`WriteBack.wait_copies` (a device-side wait, no host sync).
  2. batch: ``flush`` hands everything appended since the last flush to a
     batch; ``append`` flushes by itself every ``flush_tokens`` tokens.
  3. ingest: on a background thread, a batch waits for its copy events and
     is stored with ``IngestContext`` + ``parent_id`` as a child of the
     previous batch's child (the first one's parent: the stored context), so
     successive flushes form a chain. One ingest per sequence is in flight;
     batches queue behind it (at most ``max_queued`` batches; a flush past
     that joins the last queued batch, which has not started).

``flush`` returns a :class:`concurrent.futures.Future` of the child's
``ContextInfo`` holding every token appended up to that flush. Errors (an
evicted parent: :class:`ctxcache.NotFound`; a dead server:
:class:`ctxcache.Unavailable`; a slow one: :class:`ctxcache.DeadlineExceeded`
after ``timeout_s``) land on that future; the writer then stops (a broken
chain cannot continue), and later ``flush``/``append`` calls raise or return
the same error. Nothing here blocks the caller: ``append`` raises
``BufferError`` instead when more than ``max_pending_bytes`` wait on the host.

Flushing: every flush stores a context (a manifest, the appended pages, and
index artifacts built over the whole sequence, so the server's index build
costs O(context) per flush) and adds a link to the chain; a flush that is
too rare risks more unsaved tokens when the worker dies. The default flushes
at a turn's end (the caller's ``flush``) and every 4096 tokens within a
turn. Chain links stay stored while a later link references their pages
(storage/store.h); ``ttl_seconds`` bounds them.

Keys are post-RoPE, as the engine keeps them (``llama._rows`` rotates K
before attention) and as IngestLayerChunk stores them. Shapes: K/V
[n_layers, n_kv_heads, T, head_dim], Q [n_layers, n_q_heads, T, head_dim].

Thread-safety: one caller thread per writer (the worker's own thread runs
the ingests); the client may be shared.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Deque, List, Mapping, Optional, Sequence

import torch

__all__ = ["WriteBack", "WriteBackOptions"]


@dataclass
class WriteBackOptions:
    # Tokens appended since the last flush at which append() flushes by
    # itself; 0 = only explicit flush() calls (e.g. at a turn's end).
    # Default: 4096.
    flush_tokens: int = 4096
    # Batches waiting behind the one in flight; a flush past it joins the
    # last waiting batch. Default: 4.
    max_queued: int = 4
    # Host bytes (copies not yet stored) past which append() raises
    # BufferError. Default: 1 GiB.
    max_pending_bytes: int = 1 << 30
    # Deadline of each child's ingest, seconds. Default: 120.
    timeout_s: float = 120.0
    # Index methods of each child (as Client.ingest's ``indexes``); None = the
    # parent's methods and parameters (the server's default). Default: None.
    indexes: Any = None
    # Wire dtype of the K/V ("bf16", "f16", "f32"); None = the tensors' own.
    # Default: None.
    dtype: Any = None
    # TTL of each child, seconds; 0 = the server's default. Default: 0.
    ttl_seconds: int = 0
    # Name and labels of each child ("" / None: the parent's). Default: none.
    name: str = ""
    labels: Optional[Mapping[str, Any]] = None


class _Segment:
    """Host copies of one append: ids [T] int64, k/v [L, H, T, d], q or None;
    ``event`` (CUDA) completes when they are filled."""

    def __init__(self, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q: Optional[torch.Tensor], event: Any) -> None:
        self.ids, self.k, self.v, self.q, self.event = ids, k, v, q, event
        self.n_tokens = int(k.shape[2])
        self.nbytes = sum(t.numel() * t.element_size() for t in (ids, k, v, q) if t is not None)


class _Batch:
    def __init__(self) -> None:
        self.segments: List[_Segment] = []
        self.future: "Future[Any]" = Future()
        self.nbytes = 0


class WriteBack:
    """Stores the tokens one sequence appends to a stored context as a chain of
    child contexts (module docstring)."""

    def __init__(self, client: Any, parent: Any, options: Optional[WriteBackOptions] = None,
                 executor: Optional[Executor] = None) -> None:
        """client: a :class:`ctxcache.Client`, ClusterClient or
        :class:`ctxcache.native.NativeClient` (ingest through the C ABI, the
        GIL released during transfers); parent: the
        stored context's ``ContextInfo`` (``client.get(id)``: its id, model and
        n_tokens); executor: runs the ingests (shared by many writers: each
        keeps one ingest in flight); None = a private one-thread executor."""
        o = options or WriteBackOptions()
        if o.flush_tokens < 0 or o.max_queued < 1 or o.max_pending_bytes < 1:
            raise ValueError("WriteBackOptions: flush_tokens >= 0, max_queued >= 1 and "
                             f"max_pending_bytes >= 1 expected, got {o}")
        if o.timeout_s <= 0:
            raise ValueError(f"WriteBackOptions.timeout_s: expected > 0, got {o.timeout_s}")
        self.options = o
        self._client = client
        self._head = parent
        self._model = parent.model
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ctxcache-writeback")
        self._lock = threading.Lock()
        self._open: List[_Segment] = []        # appended since the last flush
        self._open_tokens = 0
        self._queue: Deque[_Batch] = collections.deque()  # [0] runs when _running
        self._running = False
        self._bytes = 0                        # open + queued
        self._error: Optional[BaseException] = None
        self._has_q: Optional[bool] = None
        self._last: "Future[Any]" = Future()
        self._last.set_result(parent)
        self._stream: Any = None
        self.appended = 0                      # tokens taken so far

    # ----------------------------------------------------------------- state --

    @property
    def head(self) -> Any:
        """The ``ContextInfo`` of the latest stored link (the parent at first)."""
        return self._head

    @property
    def error(self) -> Optional[BaseException]:
        """The error that stopped the writer, if any."""
        return self._error

    @property
    def pending_bytes(self) -> int:
        """Host bytes appended and not yet stored."""
        return self._bytes

    # ---------------------------------------------------------------- append --

    def append(self, tokens: Any, k: torch.Tensor, v: torch.Tensor,
               q: Optional[torch.Tensor] = None) -> None:
        """Takes T tokens: ids (a sequence of ints or an integer tensor [T] on
        any device), post-RoPE k, v [n_layers, n_kv_heads, T, head_dim] and
        optionally q [n_layers, n_q_heads, T, head_dim] (query-centric indexes
        such as csa need it; give it on every append or never). Enqueues the
        copies and returns; flushes when ``flush_tokens`` are open."""
        if self._error is not None:
            raise self._error
        m = self._model
        t = int(k.shape[2]) if k.dim() == 4 else -1
        want = (m.n_layers, m.n_kv_heads, t, m.head_dim)
        for name, x, shape in (("k", k, want), ("v", v, want),
                               ("q", q, (m.n_layers, m.n_q_heads, t, m.head_dim))):
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"WriteBack.append: {name} has shape {list(x.shape)}, expected "
                                 f"{list(shape)} (n_layers, heads, T, head_dim)")
        if t < 1:
            raise ValueError("WriteBack.append: no tokens")
        if self._has_q is not None and self._has_q != (q is not None):
            raise ValueError("WriteBack.append: q given on some appends and not on others")
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(
            [int(i) for i in tokens], dtype=torch.int64)
        if ids.dim() != 1 or ids.shape[0] != t or ids.dtype.is_floating_point:
            raise ValueError(f"WriteBack.append: tokens must be {t} integer ids, got "
                             f"{ids.dtype} {list(ids.shape)}")
        nbytes = sum(x.numel() * x.element_size() for x in (ids, k, v, q) if x is not None)
        if self._bytes + nbytes > self.options.max_pending_bytes:
            raise BufferError(f"WriteBack: {self._bytes} bytes wait to be stored; {nbytes} more "
                              f"would pass max_pending_bytes {self.options.max_pending_bytes}")
        seg = self._copy(ids, k, v, q)
        with self._lock:
            self._has_q = q is not None
            self._open.append(seg)
            self._open_tokens += t
            self._bytes += seg.nbytes
            self.appended += t
            due = self.options.flush_tokens and self._open_tokens >= self.options.flush_tokens
        if due:
            self.flush()

    def append_extension(self, attention: Any, tokens: Any) -> None:
        """The K/V an extension prefill keeps (``SparseExtendAttention`` or
        ``DenseExtendAttention``: ``k_new``/``v_new``, every layer at
        ``n_new``) for its token ids; call before the attention is reset."""
        n = attention.n_new[0]
        if any(x != n for x in attention.n_new):
            raise ValueError(f"WriteBack.append_extension: layers hold {attention.n_new} tokens; "
                             "expected the same count in every layer")
        self.append(tokens, attention.k_new[:, :, :n], attention.v_new[:, :, :n])

    def append_own(self, own: Any, b: int, tokens: Any, start: int) -> None:
        """Rows [start, start + len(tokens)) of sequence b of an
        :class:`~ctxcache.engine.engine.OwnTokens`: row i holds the K/V of the
        token fed at the sequence's step i (position context + i); their
        queries too when the own tokens keep them (``own.q``)."""
        end = start + (int(tokens.shape[0]) if isinstance(tokens, torch.Tensor) else len(tokens))
        if not 0 <= start < end <= own.max_tokens:
            raise ValueError(f"WriteBack.append_own: rows [{start}, {end}) outside "
                             f"[0, {own.max_tokens})")
        q = None if getattr(own, "q", None) is None else own.q[:, b, :, start:end]
        self.append(tokens, own.k[:, b, :, start:end], own.v[:, b, :, start:end], q)

    def _copy(self, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              q: Optional[torch.Tensor]) -> _Segment:
        srcs = [ids, k, v, q]
        if not any(x is not None and x.is_cuda for x in srcs):
            outs = [None if x is None else x.detach().clone() for x in srcs]
            return _Segment(outs[0], outs[1], outs[2], outs[3], None)
        dev = next(x.device for x in srcs if x is not None and x.is_cuda)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(dev))
        outs = []
        with torch.cuda.stream(side):
            for x in srcs:
                if x is None:
                    outs.append(None)
                    continue
                host = torch.empty(tuple(x.shape), dtype=x.dtype, pin_memory=x.is_cuda)
                host.copy_(x.detach(), non_blocking=True)
                if x.is_cuda:
                    x.record_stream(side)  # the allocator keeps x until the copy ran
                outs.append(host)
            event = torch.cuda.Event()
            event.record(side)
        return _Segment(outs[0], outs[1], outs[2], outs[3], event)

    def wait_copies(self, stream: Any = None) -> None:
        """Makes ``stream`` (default: the current one) wait for every copy
        enqueued so far, on the device (no host sync): call it before that
        stream overwrites rows given to :meth:`append`."""
        if self._stream is not None:
            (stream or torch.cuda.current_stream(self._stream.device)).wait_stream(self._stream)

    # ----------------------------------------------------------------- flush --

    def flush(self) -> "Future[Any]":
        """Sends what was appended since the last flush as the next child; the
        future gives its ``ContextInfo`` (or the error). Nothing open: the
        latest batch's future (the parent's info when none)."""
        with self._lock:
            if self._error is not None:
                f: "Future[Any]" = Future()
                f.set_exception(self._error)
                return f
            if not self._open:
                return self._last
            waiting = len(self._queue) - (1 if self._running else 0)
            if waiting >= self.options.max_queued:
                batch = self._queue[-1]  # not started: it takes these tokens too
            else:
                batch = _Batch()
                self._queue.append(batch)
            batch.segments.extend(self._open)
            batch.nbytes += sum(s.nbytes for s in self._open)
            self._open, self._open_tokens = [], 0
            self._last = batch.future
            self._start_locked()
            return batch.future

    def close(self, timeout: Optional[float] = None) -> Any:
        """Flushes, waits up to ``timeout`` seconds (None: forever) for every
        batch, stops a private executor and returns the last link's
        ``ContextInfo``; raises the writer's error, or TimeoutError."""
        last = self.flush()
        try:
            return last.result(timeout=timeout)
        finally:
            if self._own_executor:
                self._executor.shutdown(wait=False)

    def __enter__(self) -> "WriteBack":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close(self.options.timeout_s * (1 + len(self._queue)))
        elif self._own_executor:
            self._executor.shutdown(wait=False)

    # ---------------------------------------------------------------- worker --

    def _start_locked(self) -> None:
        if self._running or not self._queue:
            return
        self._running = True
        batch = self._queue[0]
        try:
            self._executor.submit(self._run, batch)
        except RuntimeError as e:  # the executor was shut down
            self._running = False
            self._fail_locked(e)

    def _fail_locked(self, e: BaseException) -> None:
        """Stops the writer: every queued batch fails with ``e``."""
        if self._error is None:
            self._error = e
        while self._queue:
            b = self._queue.popleft()
            self._bytes -= b.nbytes
            if not b.future.done():
                b.future.set_exception(self._error)
        self._bytes -= sum(s.nbytes for s in self._open)
        self._open, self._open_tokens = [], 0

    def _run(self, batch: _Batch) -> None:
        try:
            info = self._ingest(batch.segments)
        except BaseException as e:  # surfaces on the future and the next flush
            with self._lock:
                self._running = False
                self._fail_locked(e)
            return
        with self._lock:
            self._head = info
            self._queue.popleft()
            self._bytes -= batch.nbytes
            self._running = False
            self._start_locked()
        batch.future.set_result(info)

    def _ingest(self, segments: Sequence[_Segment]) -> Any:
        for s in segments:
            if s.event is not None:
                s.event.synchronize()  # this thread waits, never the caller's stream
        ids = torch.cat([s.ids for s in segments]).tolist()
        k = torch.cat([s.k for s in segments], dim=2)
        v = torch.cat([s.v for s in segments], dim=2)
        q = None if segments[0].q is None else torch.cat([s.q for s in segments], dim=2)
        head, o = self._head, self.options
        layers = [(k[i], v[i]) if q is None else (k[i], v[i], q[i]) for i in range(k.shape[0])]
        return self._client.ingest(self._model, ids, layers, indexes=o.indexes, name=o.name,
                                   labels=o.labels, ttl_seconds=o.ttl_seconds, dtype=o.dtype,
                                   parent_id=head.context_id, parent_tokens=int(head.n_tokens),
                                   timeout=o.timeout_s)
