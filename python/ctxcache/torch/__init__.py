"""GPU-worker helpers: client-side page selection from the index artifacts.

* :mod:`ctxcache.torch.artifacts`: parsers of the csa artifacts (``CSAP``,
  ``CSAC``) that :meth:`ctxcache.Client.fetch_index` returns.
* :mod:`ctxcache.torch.selection`: the C++ sparse-session pipeline for csa
  (select, page cap, block-union page tables, whole-page widening) in numpy,
  selecting exactly what a server-side session selects (before any append).
  Accepts torch tensors.

Both need numpy only. ``ctxcache.torch.kernels`` (Triton GPU kernels of the
benchmark) is not imported here: it needs triton and a CUDA device; import it
explicitly.
"""
from ctxcache.torch.artifacts import CsaArtifact, CsaOptions, parse_csa_artifact
from ctxcache.torch.selection import (CsaIndex, CsaSelection, CsaSession, HeadStep, PageTable,
                                      SessionParams, session_step)

__all__ = ["CsaArtifact", "CsaOptions", "parse_csa_artifact", "CsaIndex", "CsaSelection",
           "CsaSession", "HeadStep", "PageTable", "SessionParams", "session_step"]
