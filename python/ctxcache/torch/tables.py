"""What the torch session core (:mod:`ctxcache.torch.gpu_session`) loads
and plans with: one method's index artifacts of a whole context, parsed
(:mod:`ctxcache.torch.artifacts`) and checked (:class:`ContextTables`), and
the decode-session params (:class:`SessionParams`: ``session::SessionParams``,
the server's defaults and errors) with the token budget per q head and the
page cap's page budget, as the C++ session core (session/session_params.h,
index/) computes them.

The selection itself is the C++ session core's: the torch core runs the same
stages as tensor ops, and python/tests check it against the C++ core through
the native library (:class:`ctxcache.native.DecodeSession`).
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import numpy as np

from ctxcache.torch.artifacts import (CsaArtifact, OracleArtifact, QuestArtifact,
                                      StreamingArtifact, parse_csa_artifact,
                                      parse_oracle_artifact, parse_quest_artifact,
                                      parse_streaming_artifact)

__all__ = ["METHODS", "SKETCH_QUERY_MAX_CODE", "ContextTables", "SessionParams", "budget_for",
           "csa_missing_scores", "page_budget", "token_budget"]

SKETCH_QUERY_MAX_CODE = 2047  # kSketchQueryMaxCode in index/csa.cc


def budget_for(budget: int, rho: float, n: int) -> int:
    """``index::BudgetFor``."""
    k = budget if budget > 0 else int(math.ceil(rho * float(n)))
    return max(1, min(k, max(1, n)))


def _check_rerank_method(method: str) -> None:
    """The session param ``rerank`` is csa's (``SessionParams::Parse``)."""
    if method != "csa":
        raise ValueError("session param rerank applies to method csa only; this session's "
                         f"method is {method}")


@dataclass
class SessionParams:
    """``session::SessionParams``: a decode session's selection params.

    Build it with :meth:`parse` from the same params dict a server-side
    session gets (``rho``, ``budget``, ``page_fraction``, ``whole_pages``,
    ``subgroup``, ``recent_blocks``, ``estimate_mass`` = 0 only, and csa's
    per-session ``rerank``; docs/api.md),
    which applies the same
    defaults: ``page_fraction`` = rho unless ``budget`` is given (or the
    method is ``full``), ``whole_pages`` on when the page cap is.
    """

    rho: float = 0.05
    budget: int = 0             # 0 = use rho
    page_fraction: float = 0.0  # 0 = no page cap
    whole_pages: bool = False
    subgroup: int = 4
    recent_blocks: int = 1
    page_size: int = 16
    rerank: Optional[float] = None  # csa only; None = the context's build value

    @classmethod
    def parse(cls, params: Optional[Mapping[str, Any]] = None, method: str = "csa",
              page_size: int = 16) -> "SessionParams":
        """``SessionParams::Parse``; ValueError naming the bad param."""
        s = cls(page_size=page_size)
        params = {str(k): str(v) for k, v in (params or {}).items()}
        has_whole_pages = False
        for k, v in params.items():
            try:  # strtod: leading blanks allowed, nothing after the number
                x = float(v) if v == v.rstrip() and "_" not in v else math.nan
            except ValueError:
                x = math.nan
            if v == "" or not math.isfinite(x):
                raise ValueError(f"session param {k}='{v}' is not a number")
            if k == "rho":
                if not (0 < x <= 1):
                    raise ValueError("session param rho must be in (0, 1]")
                s.rho = x
            elif k == "budget":
                if x < 1:
                    raise ValueError("session param budget must be >= 1 token")
                s.budget = int(x)
            elif k == "page_fraction":
                if not (0 < x <= 1):
                    raise ValueError("session param page_fraction must be in (0, 1]")
                s.page_fraction = x
            elif k == "whole_pages":
                if x not in (0, 1):
                    raise ValueError("session param whole_pages must be 0 or 1")
                s.whole_pages = x == 1
                has_whole_pages = True
            elif k == "subgroup":
                if x < 1:
                    raise ValueError("session param subgroup must be >= 1")
                s.subgroup = int(x)
            elif k == "recent_blocks":
                if x < 0:
                    raise ValueError("session param recent_blocks must be >= 0")
                s.recent_blocks = int(x)
            elif k == "estimate_mass":
                if x not in (0, 1):
                    raise ValueError("session param estimate_mass must be 0 or 1")
                if x == 1:
                    raise ValueError("session param estimate_mass=1: client-side sessions do "
                                     "not estimate the captured attention mass; expected 0, or "
                                     "a server-side session (Client.open_session)")
            elif k == "rerank":
                _check_rerank_method(method)
                if not (x == 0 or 1 <= x <= 64):
                    raise ValueError("session param rerank must be 0 or in [1, 64]")
                s.rerank = x
            else:
                raise ValueError(f"unknown session param '{k}'; expected rho, budget, "
                                 "page_fraction, whole_pages, subgroup, recent_blocks, "
                                 "estimate_mass or rerank (csa)")
        if "page_fraction" not in params and s.budget == 0 and method != "full":
            s.page_fraction = s.rho
        if s.page_fraction >= 1.0:
            s.page_fraction = 0.0
        if not has_whole_pages:
            s.whole_pages = s.page_fraction > 0
        return s

    def token_budget(self, n: int) -> int:
        """``SessionParams::TokenBudget``: tokens per q head for n tokens."""
        return token_budget(n, self.rho, self.budget)


def token_budget(n: int, rho: float = 0.05, budget: int = 0) -> int:
    """Tokens per q head: ``budget`` clamped to [1, n], else max(1, ceil(rho * n))."""
    if budget > 0:
        return max(1, min(budget, n))
    return max(1, int(math.ceil(rho * float(n))))


def page_budget(fraction: float, n_tokens: int, page_size: int = 16) -> int:
    """``index::PageBudget``: max(1, ceil(fraction * pages))."""
    pages = (n_tokens + page_size - 1) // max(1, page_size)
    return max(1, int(math.ceil(fraction * pages)))


METHODS = ("csa", "quest", "streaming", "oracle")  # the methods with a torch session core

_ARTIFACTS = {"csa": (CsaArtifact, parse_csa_artifact),
              "quest": (QuestArtifact, parse_quest_artifact),
              "streaming": (StreamingArtifact, parse_streaming_artifact),
              "oracle": (OracleArtifact, parse_oracle_artifact)}

Artifact = Union[CsaArtifact, QuestArtifact, StreamingArtifact, OracleArtifact]


def csa_missing_scores(a: CsaArtifact) -> np.ndarray:
    """float32 [m, C]: the score ``CsaSelector`` imputes for a token missing
    from list (b, j): the list's tail mean (``missing=mean``), its lowest
    score (``missing=min``: the loader's heap root, a ``CSAP`` list's stored
    entry 0, a ``CSAC`` list's minimum), else 0."""
    o = a.options
    if o.impute_tail_mean:
        return np.asarray(a.tail_mean, dtype=np.float32)
    if o.impute_min:
        sc = a.scores.astype(np.float32)
        return sc.min(axis=2) if a.compact else sc[:, :, 0].copy()
    return np.zeros((o.m, o.C), dtype=np.float32)


class ContextTables:
    """One method's artifacts of a whole context, parsed and checked, with the
    session params: what a torch session loads onto its device.

    artifacts: ``{(layer, kv_head): bytes}`` as :meth:`ctxcache.Client.fetch_index`
    returns them (or already parsed artifacts), every (layer, kv head).
    params: a :class:`SessionParams` or the session params dict. A csa
    session's ``rerank`` is applied to each artifact's options (ValueError
    when it needs the key sketch an artifact was built without).
    ValueError for another method, a missing (layer, kv head), artifacts of
    different token counts or dims, or ``n_q_heads`` not a multiple of the
    kv heads.
    """

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 params: Union[SessionParams, Mapping[str, Any], None] = None,
                 method: str = "csa") -> None:
        if method not in METHODS:
            raise ValueError(f"method '{method}' has no client-side selection; expected one "
                             f"of {', '.join(METHODS)}")
        if not artifacts:
            raise ValueError(f"{method}: no artifacts")
        self.method = method
        self.params = (params if isinstance(params, SessionParams)
                       else SessionParams.parse(params, method=method))
        kind, parse = _ARTIFACTS[method]

        def parsed(a: Any) -> Artifact:
            return a if isinstance(a, kind) else parse(a)

        # Artifacts parse side by side (numpy drops the GIL in its bulk ops);
        # the first bad one in key order raises, as a loop would.
        items = list(artifacts.items())
        workers = min(len(items), os.cpu_count() or 1, 16)
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                arts = list(pool.map(parsed, (a for _, a in items)))
        else:
            arts = [parsed(a) for _, a in items]
        self.artifacts: Dict[Tuple[int, int], Artifact] = {
            (int(l), int(h)): a for ((l, h), _), a in zip(items, arts)}
        rerank = self.params.rerank
        if rerank is not None:  # csa's per-session stage-2 factor (SessionParams.parse checks)
            for key, a in self.artifacts.items():
                if rerank > 0 and a.sketch is None:
                    raise ValueError(f"csa: rerank={rerank:g} needs the key sketch, which the "
                                     f"index of (layer, kv head) {key} was built without "
                                     "(rerank=0 at build); expected rerank=0")
                self.artifacts[key] = replace(a, options=replace(a.options, rerank=rerank))
        self.n_layers = 1 + max(l for l, _ in self.artifacts)
        self.n_kv_heads = 1 + max(h for _, h in self.artifacts)
        missing = [(l, h) for l in range(self.n_layers) for h in range(self.n_kv_heads)
                   if (l, h) not in self.artifacts]
        if missing:
            raise ValueError(f"{method}: no artifact for (layer, kv head) {missing[0]}")
        if n_q_heads % self.n_kv_heads:
            raise ValueError(f"{method}: n_q_heads {n_q_heads} is not a multiple of "
                             f"n_kv_heads {self.n_kv_heads}")
        self.n_q_heads = n_q_heads
        self.group_size = n_q_heads // self.n_kv_heads
        first = self.artifacts[(0, 0)]
        self.n_tokens, self.head_dim = int(first.n_tokens), int(first.head_dim)
        for key, a in self.artifacts.items():
            if (a.n_tokens, a.head_dim) != (self.n_tokens, self.head_dim):
                raise ValueError(f"{method}: (layer, kv head) {key} covers {a.n_tokens} tokens "
                                 f"of dim {a.head_dim}, expected {self.n_tokens} of dim "
                                 f"{self.head_dim}")

    def layer(self, layer: int) -> list:
        """The artifacts of ``layer``'s kv heads, in kv head order."""
        return [self.artifacts[(layer, h)] for h in range(self.n_kv_heads)]
