"""The page store side of the GPU engine: a context's pages in a pinned host
tier, and an HBM pool of hot pages whose misses are resolved on the GPU.

Units. A unit is one page (``page`` tokens) of one (layer, kv head):
``unit = (layer * n_kv_heads + kv_head) * n_pages + page``. The host tier
holds K and V as [n_layers, n_kv_heads, n_pages * page, head_dim], so unit u
is rows [u * page, (u + 1) * page) of the flattened tier: the unit id is also
its host offset.

The pool. ``n_slots`` slots of one unit each (K and V), shared by every
sequence that reads the context, for all layers. Device tables:
  slot_of  int32 [n_units]  the unit's slot, -1 absent (-2 while a resolve
                            is placing it)
  page_of  int32 [n_slots]  the slot's unit, -1 empty
  stamp    int32 [n_slots]  the layer-step that last used the slot
  ref      int32 [n_slots]  CLOCK's reference bit
  clock    int32 [4]        the hand, the layer-step counter "now",
                            "floor": slots stamped at or after it are in use,
                            and the start of the latest hold window

:meth:`PagePool.resolve` makes the units a layer-step asks for resident, on
the device and with no host sync, in three steps (CUDA: three Triton kernels
of fixed grids, so a step can be captured in a CUDA graph):
  1. claim: every requested unit that is resident is a hit (its slot gets
     stamp = now and ref = 1); every absent one is claimed by exactly one of
     its requests (compare-and-swap -1 -> -2) and appended to the miss list,
     so a page that several sequences miss is copied once;
  2. victims: the CLOCK hand sweeps the ring from where it stopped, clearing
     reference bits, and takes for each miss the first slot whose bit is
     clear and that is not in use (stamp < floor); the hand stops after the
     last slot taken, and now advances;
  3. install: each miss evicts its victim's unit (slot_of = -1), takes the
     slot, and copies its K and V page from the pinned host tier (zero-copy
     reads over PCIe on CUDA).
Attention then reads ``slot_of`` for the pages it attends (``slot_tables``).

In use. By default a slot is in use only for the layer-step that stamped
it: floor follows now, and the next layer may evict it. Between
:meth:`PagePool.hold` and :meth:`PagePool.release` (device-side, capturable)
floor stays put, so every unit resolved in that window stays resident until
it ends: a decoder that reuses a step's pages for later steps holds the pool
over the planning step. :meth:`PagePool.hold_next` opens a new window and
keeps the last one too (floor moves to the last window's start): a decoder
that resolves the next plan's pages while its steps still read the current
plan's (EngineOptions.lookahead) holds two windows, and the pool needs the
slots of both.

Contract: a resolve (one layer) asks for at most ``n_slots`` distinct units
(n_kv_heads * n_pages at most, however many sequences ask), so a slot
not used by the layer-step always exists (ValueError at construction when
``max_requests`` could exceed it); inside a hold, the held windows'
distinct units are at most ``n_slots`` (the caller sizes the pool with
``min_slots``). Between resolves the tables are consistent:
``slot_of[page_of[s]] == s`` for every filled slot.

Thread-safety: one stream at a time; resolves of one pool must be ordered.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ctxcache.tensors import DTYPE_NAMES, wire_torch_dtype

__all__ = ["HostTier", "PagePool", "PoolOptions", "table_rows"]


def table_rows(pages: torch.Tensor, page: int, n_tokens: int) -> torch.Tensor:
    """Token rows of page tables [H, kp] sorted ascending and holding the
    context's last page (so last): int64 [H, kp * page - padding], the last
    page's tokens past ``n_tokens`` dropped. Page ids give context rows; slot
    ids give pool rows (the last page's slot stays last in the same order)."""
    tok = torch.arange(page, device=pages.device, dtype=torch.int64)
    rows = (pages.long().unsqueeze(-1) * page + tok).view(pages.shape[0], -1)
    pad = (-n_tokens) % page
    return rows[:, :rows.shape[1] - pad] if pad else rows


class HostTier:
    """A stored context's K and V in (pinned) host memory, page-padded:
    ``k``, ``v`` [n_layers, n_kv_heads, n_pages * page, head_dim]; tokens past
    ``n_tokens`` are zero.

    Filled by a bulk load (:meth:`from_server`; ``load`` waits for layers),
    or on demand (:meth:`on_demand`): then ``present`` (bool [n_units], on
    the host) says which units hold their bytes, :meth:`fill` fetches the
    units a step asks for (NativeClient.fetch_pages_into), and
    :meth:`start_load` starts the bulk load of the rest; once it is done,
    :meth:`complete` sets ``present`` to None, meaning every unit is in.
    Readers of units (the pool's resolve) must only read present ones."""

    def __init__(self, n_layers: int, n_kv_heads: int, n_tokens: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, page: int = 16, pin: bool = True,
                 zero: bool = True) -> None:
        """zero: fill with zeros (False: only the last page's padding rows;
        the rest is undefined until written, for a tier whose units are
        tracked by ``present``). Default: True."""
        if min(n_layers, n_kv_heads, n_tokens, head_dim, page) < 1:
            raise ValueError("HostTier: n_layers, n_kv_heads, n_tokens, head_dim and page "
                             "must be >= 1")
        self.n_layers, self.n_kv_heads, self.n_tokens = n_layers, n_kv_heads, n_tokens
        self.head_dim, self.dtype, self.page = head_dim, dtype, page
        self.n_pages = (n_tokens + page - 1) // page
        shape = (n_layers, n_kv_heads, self.n_pages * page, head_dim)
        pin = pin and torch.cuda.is_available()
        make = torch.zeros if zero else torch.empty
        self.k = make(shape, dtype=dtype, pin_memory=pin)
        self.v = make(shape, dtype=dtype, pin_memory=pin)
        if not zero:
            self.k[:, :, n_tokens:].zero_()
            self.v[:, :, n_tokens:].zero_()
        self.load: Any = None  # the background bulk load filling the tier, if any
        # On demand: which units hold their bytes (None: all, or a load's).
        self.present: Optional[torch.Tensor] = None
        self._source: Any = None  # (native client, context id, shape) when on demand
        self._streams, self._pool = 1, None  # concurrent fetches of fill()
        self.units_fetched = 0  # units fetched on demand (fill)
        self.fill_s = 0.0  # seconds in fill()
        self.fill_wait_s = 0.0  # of those, waiting for the units (a host sync) and sorting them
        self.fill_fetch_s = 0.0  # of those, in the fetch_pages_into calls

    @property
    def n_units(self) -> int:
        return self.n_layers * self.n_kv_heads * self.n_pages

    @property
    def unit_bytes(self) -> int:
        """K and V bytes of one unit."""
        return 2 * self.page * self.head_dim * self.k.element_size()

    def token_view(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V as [n_layers, n_kv_heads, n_tokens, head_dim] views (what a
        bulk load fills)."""
        return self.k[:, :, :self.n_tokens], self.v[:, :, :self.n_tokens]

    @classmethod
    def from_server(cls, client: Any, context_id: str, streams: int = 8,
                    pin: bool = True) -> "HostTier":
        """A tier for a stored context, filled in the background by a bulk load
        through the native client (:class:`ctxcache.native.NativeClient`);
        ``tier.load.wait_layer(l)`` waits for layer l, ``tier.load.wait()``
        for all."""
        shape = client.context(context_id)
        tier = cls(shape.n_layers, shape.n_kv_heads, shape.n_tokens, shape.head_dim,
                   wire_torch_dtype(DTYPE_NAMES[shape.kv_dtype]),
                   page=shape.block_tokens or 16, pin=pin)
        k, v = tier.token_view()
        tier.load = client.start_load_kv(context_id, k, v, streams=streams, shape=shape)
        return tier

    @classmethod
    def on_demand(cls, client: Any, context_id: str, pin: bool = True,
                  streams: int = 8) -> "HostTier":
        """An empty tier for a stored context that :meth:`fill` fills unit by
        unit through ``client`` (a :class:`ctxcache.native.NativeClient`,
        kept for :meth:`start_load`), with up to ``streams`` concurrent
        calls; nothing is transferred yet, and nothing zero-filled (units
        not present are never read)."""
        shape = client.context(context_id)
        tier = cls(shape.n_layers, shape.n_kv_heads, shape.n_tokens, shape.head_dim,
                   wire_torch_dtype(DTYPE_NAMES[shape.kv_dtype]),
                   page=shape.block_tokens or 16, pin=pin, zero=False)
        tier.present = torch.zeros(tier.n_units, dtype=torch.bool)
        tier._source = (client, context_id, shape)
        tier._streams = max(1, int(streams))
        return tier

    def fill(self, units: torch.Tensor) -> int:
        """Makes ``units`` (int64 unit ids, any order and repeats, on any
        device: read here, a host sync) present: fetch_pages_into calls for
        those absent, grouped by (layer, kv head) into up to ``streams`` concurrent
        calls. Returns how many it fetched (0 once the tier is complete)."""
        if self.present is None:
            return 0
        t0 = time.perf_counter()
        u = torch.unique(units.reshape(-1).to("cpu", torch.int64))
        u = u[~self.present[u]]
        t1 = time.perf_counter()
        self.fill_wait_s += t1 - t0
        if not u.numel():
            self.fill_s += t1 - t0
            return 0
        client, context_id, shape = self._source
        head, page = u // self.n_pages, u % self.n_pages
        starts = torch.nonzero(torch.diff(head, prepend=head[:1] - 1)).view(-1).tolist()
        ends = starts[1:] + [u.numel()]
        pages = page.to(torch.int32).numpy()
        tables = [(hh // self.n_kv_heads, hh % self.n_kv_heads, pages[a:b])
                  for hh, a, b in zip(head[starts].tolist(), starts, ends)]
        k, v = self.token_view()
        n = min(self._streams, len(tables))
        t2 = time.perf_counter()
        if n == 1:
            client.fetch_pages_into(context_id, tables, k, v, shape=shape)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._streams)
            futures = [self._pool.submit(client.fetch_pages_into, context_id, tables[i::n], k, v,
                                         shape) for i in range(n)]
            wait(futures)
            for f in futures:
                f.result()  # raises the first failure
        t3 = time.perf_counter()
        self.fill_fetch_s += t3 - t2
        self.present[u] = True
        self.units_fetched += int(u.numel())
        self.fill_s += t3 - t0
        return int(u.numel())

    def start_load(self, streams: int = 8) -> None:
        """On demand: starts the bulk load of the whole context into the tier in
        the background (the units already fetched come again with the same
        bytes); :meth:`complete` then says when it is done. No-op otherwise."""
        if self.present is None or self.load is not None:
            return
        client, context_id, shape = self._source
        k, v = self.token_view()
        self.load = client.start_load_kv(context_id, k, v, streams=streams, shape=shape)

    def complete(self) -> bool:
        """Whether every unit is in the tier (no host wait: an on-demand tier
        whose bulk load has finished becomes complete here, raising the
        load's error if it failed)."""
        if self.present is None:
            return True
        if self.load is None or not self.load.done:
            return False
        self.load.wait()  # raises the load's failure
        self.load.close()
        self.present = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        return True


@dataclass
class PoolOptions:
    # Slots of the HBM pool (one unit, K and V, each). Default: 0 = enough
    # for `fraction` of the context's units (and at least max_requests).
    n_slots: int = 0
    # With n_slots 0: the pool's share of the context's units. Default: 0.1.
    fraction: float = 0.1
    # The most unit requests one resolve takes (rows x pages per row).
    # Default: 0 = set by the first resolve's shape.
    max_requests: int = 0
    # The fewest slots, whatever n_slots or fraction say (a decoder's
    # working set: the units one step, or one hold, may ask for; capped at
    # the context's units). Default: 0.
    min_slots: int = 0


class PagePool:
    """An HBM pool of a :class:`HostTier`'s units (module docstring)."""

    def __init__(self, tier: HostTier, device: Any, options: Optional[PoolOptions] = None,
                 max_requests: int = 0) -> None:
        o = options or PoolOptions()
        self.tier, self.device = tier, torch.device(device)
        self.max_requests = max_requests or o.max_requests
        n = o.n_slots or max(int(math.ceil(o.fraction * tier.n_units)), self.max_requests, 1)
        n = min(max(n, o.min_slots), tier.n_units)
        if self._distinct(self.max_requests) > n:
            raise ValueError(f"PagePool: n_slots {n} < the {self._distinct(self.max_requests)} "
                             f"distinct units a resolve of max_requests {self.max_requests} "
                             f"may ask for: it could find no free slot")
        self.n_slots = n
        p, d = tier.page, tier.head_dim
        self.k = torch.zeros(n * p, d, dtype=tier.dtype, device=self.device)
        self.v = torch.zeros(n * p, d, dtype=tier.dtype, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.slot_of = torch.full((tier.n_units,), -1, **i32)
        self.page_of = torch.full((n,), -1, **i32)
        self.stamp = torch.full((n,), -1, **i32)
        self.ref = torch.zeros(n, **i32)
        self.clock = torch.zeros(4, **i32)        # hand, now, floor, window
        self.n_miss = torch.zeros(2, **i32)       # being counted, of the last resolve
        # Hit requests, missed requests, units copied, units left unplaced
        # (the last only if the contract above is broken).
        self.counts = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._miss_units: Optional[torch.Tensor] = None
        self._miss_slots: Optional[torch.Tensor] = None
        self._held = False

    def _distinct(self, n_req: int) -> int:
        """The most distinct units n_req requests of one layer can name."""
        return min(n_req, self.tier.n_kv_heads * self.tier.n_pages)

    @property
    def hbm_bytes(self) -> int:
        """Device bytes of the pool and its tables."""
        t = (self.k, self.v, self.slot_of, self.page_of, self.stamp, self.ref)
        return sum(x.numel() * x.element_size() for x in t)

    def _buffers(self, n_req: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._miss_units is None or self._miss_units.numel() < n_req:
            if self.max_requests and n_req > self.max_requests:
                raise ValueError(f"resolve: {n_req} requests > max_requests "
                                 f"{self.max_requests}")
            if self._distinct(n_req) > self.n_slots:
                raise ValueError(f"resolve: {n_req} requests may ask for more units than "
                                 f"n_slots {self.n_slots}")
            self.max_requests = max(self.max_requests, n_req)
            self._miss_units = torch.zeros(n_req, dtype=torch.int32, device=self.device)
            self._miss_slots = torch.zeros(n_req, dtype=torch.int32, device=self.device)
        return self._miss_units, self._miss_slots  # type: ignore[return-value]

    def preload(self) -> bool:
        """When the pool has a slot for every unit of the context: copies them
        all in, unit u to slot u (one bulk copy per layer, waiting for each
        layer of a background load), so no step misses. Returns whether it
        did (False: the pool is smaller than the context; nothing changes).
        Not capturable (call it before the first step)."""
        t = self.tier
        if self.n_slots < t.n_units:
            return False
        per_layer = t.n_kv_heads * t.n_pages * t.page
        for layer in range(t.n_layers):
            if t.load is not None:
                t.load.wait_layer(layer)
            rows = slice(layer * per_layer, (layer + 1) * per_layer)
            self.k[rows].copy_(t.k[layer].reshape(-1, t.head_dim), non_blocking=True)
            self.v[rows].copy_(t.v[layer].reshape(-1, t.head_dim), non_blocking=True)
        units = torch.arange(t.n_units, dtype=torch.int32, device=self.device)
        self.slot_of.copy_(units)
        self.page_of.fill_(-1)
        self.page_of[:t.n_units].copy_(units)
        self.ref.zero_()
        self.counts[2] += t.n_units
        return True

    def hold(self) -> None:
        """From now until :meth:`release`, units resolved stay resident (no
        host sync; capturable). Opens a window and ends any earlier ones."""
        self._held = True
        self.clock[2:3].copy_(self.clock[1:2])
        self.clock[3:4].copy_(self.clock[1:2])

    def hold_next(self) -> None:
        """Opens a new window and keeps the latest one held: units resolved
        since that window began stay resident, with those from now on, until
        the next hold_next, hold or release (no host sync; capturable). Units
        of earlier windows may go."""
        self._held = True
        self.clock[2:3].copy_(self.clock[3:4])
        self.clock[3:4].copy_(self.clock[1:2])

    def release(self) -> None:
        """Ends a hold: from the next resolve on, a slot is in use only for its
        own layer-step."""
        self._held = False
        self.clock[2:3].copy_(self.clock[1:2])
        self.clock[3:4].copy_(self.clock[1:2])

    def units(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Unit ids of ``pages`` [B, H, kp] (page ids per kv head) at ``layer``."""
        t = self.tier
        h = torch.arange(t.n_kv_heads, device=pages.device, dtype=torch.int64).view(1, -1, 1)
        return (layer * t.n_kv_heads + h) * t.n_pages + pages.to(torch.int64)

    def resolve(self, layer: int, pages: torch.Tensor) -> None:
        """Makes the units of ``pages`` [B, H, kp] (int32, page ids of each
        row's kv head, B sequences) resident. No host sync on CUDA."""
        if pages.dim() != 3 or pages.shape[1] != self.tier.n_kv_heads:
            raise ValueError(f"resolve: pages of shape {tuple(pages.shape)}, expected "
                             f"[B, {self.tier.n_kv_heads}, kp]")
        mu, ms = self._buffers(pages.numel())
        if self.device.type == "cuda":
            from ctxcache.engine import _triton
            _triton.resolve(self, layer, pages, mu, ms, self._held)
        else:
            self._resolve_reference(layer, pages, mu, ms)

    def _resolve_reference(self, layer: int, pages: torch.Tensor, mu: torch.Tensor,
                           ms: torch.Tensor) -> None:
        """The kernels' algorithm in torch, claims in request order (the
        kernels claim in the order their atomics land)."""
        units = self.units(layer, pages).reshape(-1)
        now = int(self.clock[1])
        floor = int(self.clock[2]) if self._held else now
        slots = self.slot_of[units]
        hit = slots >= 0
        self.stamp[slots[hit].long()] = now
        self.ref[slots[hit].long()] = 1
        seen, order = set(), []
        for u in units[~hit].tolist():
            if u not in seen:
                seen.add(u)
                order.append(u)
        m = len(order)
        hand, found, victims = int(self.clock[0]), 0, []
        steps = 0
        while found < m:
            if steps >= 2 * self.n_slots + 1:
                raise RuntimeError("resolve: no free slot (more distinct units than slots)")
            s = (hand + steps) % self.n_slots
            steps += 1
            if int(self.stamp[s]) >= floor:
                continue
            if int(self.ref[s]):
                self.ref[s] = 0
                continue
            victims.append(s)
            self.stamp[s] = now
            found += 1
        self.clock[0] = (hand + steps) % self.n_slots
        self.clock[1] = now + 1
        if not self._held:
            self.clock[2] = now + 1
        p, t = self.tier.page, self.tier
        kf = t.k.view(-1, t.head_dim)
        vf = t.v.view(-1, t.head_dim)
        for u, s in zip(order, victims):
            old = int(self.page_of[s])
            if old >= 0:
                self.slot_of[old] = -1
            self.slot_of[u] = s
            self.page_of[s] = u
            self.ref[s] = 0
            self.k[s * p:(s + 1) * p] = kf[u * p:(u + 1) * p].to(self.device)
            self.v[s * p:(s + 1) * p] = vf[u * p:(u + 1) * p].to(self.device)
        self.counts[0] += int(hit.sum())
        self.counts[1] += int((~hit).sum())
        self.counts[2] += m
        self.n_miss[1] = m
        if m:
            mu[:m] = torch.tensor(order, dtype=torch.int32)
            ms[:m] = torch.tensor(victims, dtype=torch.int32)

    def stats(self) -> Dict[str, int]:
        """Since the pool was made (one host sync): requests that hit and that
        missed, units copied (a unit missed by several requests of one
        resolve is copied once), their bytes, and units left unplaced (0
        unless a resolve asked for more distinct units than slots)."""
        h, m, c, lost = (int(x) for x in self.counts.tolist())
        return {"hit_requests": h, "miss_requests": m, "copies": c,
                "bytes_h2d": c * self.tier.unit_bytes, "unplaced": lost,
                "n_slots": self.n_slots}

    def check(self) -> None:
        """Asserts the tables' invariants (host sync; for tests)."""
        page_of = self.page_of.cpu()
        slot_of = self.slot_of.cpu()
        filled = torch.nonzero(page_of >= 0)[:, 0]
        assert torch.equal(slot_of[page_of[filled].long()], filled.to(torch.int32)), \
            "slot_of[page_of[s]] != s"
        resident = torch.nonzero(slot_of >= 0)[:, 0]
        assert torch.equal(page_of[slot_of[resident].long()], resident.to(torch.int32)), \
            "page_of[slot_of[u]] != u"
        assert not bool((slot_of == -2).any()), "a claim was left behind"
