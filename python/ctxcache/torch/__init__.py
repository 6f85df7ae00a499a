"""GPU-worker helpers: client-side page selection from the index artifacts.

* :mod:`ctxcache.torch.artifacts`: parsers of the artifacts that
  :meth:`ctxcache.Client.fetch_index` returns for csa (``CSAP``, ``CSAC``),
  quest (``QST1``), streaming (``STR1``) and oracle (``ORCL``).
* :mod:`ctxcache.torch.selection`: the C++ sparse-session pipeline for csa,
  quest, streaming and oracle (select, page cap, block-union page tables,
  whole-page widening) in numpy, selecting exactly what a server-side session
  selects (before any append). Accepts torch tensors.

Both need numpy only; :mod:`ctxcache.torch.gpu_session` (the same pipeline as
torch tensor ops on a device) needs torch. ``ctxcache.torch.kernels`` (Triton GPU kernels of the
benchmark) is not imported here: it needs triton and a CUDA device; import it
explicitly.
"""
from ctxcache.torch.artifacts import (CsaArtifact, CsaOptions, OracleArtifact, QuestArtifact,
                                      StreamingArtifact, parse_csa_artifact,
                                      parse_oracle_artifact, parse_quest_artifact,
                                      parse_streaming_artifact)
from ctxcache.torch.selection import (ClientSession, CsaIndex, CsaSelection, CsaSession,
                                      HeadStep, OracleIndex, PageTable, QuestIndex,
                                      SessionParams, StreamingIndex, make_index, session_step)

__all__ = ["CsaArtifact", "CsaOptions", "parse_csa_artifact", "CsaIndex", "CsaSelection",
           "CsaSession", "HeadStep", "PageTable", "SessionParams", "session_step",
           "ClientSession", "OracleArtifact", "OracleIndex", "QuestArtifact", "QuestIndex",
           "StreamingArtifact", "StreamingIndex", "make_index", "parse_oracle_artifact",
           "parse_quest_artifact", "parse_streaming_artifact"]
