"""The decode-session params and budgets the torch session core
(:mod:`ctxcache.torch.gpu_session`) plans with: ``session::SessionParams``
(:meth:`SessionParams.parse`, the server's defaults and errors), the token
budget per q head and the page cap's page budget, as the C++ session core
(session/session_params.h, index/) computes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["SKETCH_QUERY_MAX_CODE", "SessionParams", "budget_for", "page_budget",
           "token_budget"]

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
