"""GPU-worker helpers: client-side page selection from the index artifacts.

* :mod:`ctxcache.torch.artifacts`: parsers of the artifacts that
  :meth:`ctxcache.Client.fetch_index` returns for csa (``CSAP``, ``CSAC``),
  quest (``QST1``), streaming (``STR1``) and oracle (``ORCL``).
* :mod:`ctxcache.torch.tables`: one method's artifacts of a whole context,
  parsed and checked (:class:`ContextTables`), and the session params
  (:class:`SessionParams`) with the token and page budgets: what the torch
  session core loads and plans with.

Both need numpy only; :mod:`ctxcache.torch.gpu_session` (the session core as
torch tensor ops on a device, for csa, quest, streaming and oracle) needs
torch. The session core itself is the C++ one: in this process through the
native library (:class:`ctxcache.native.DecodeSession` with ``client_mode``),
or on the server (:meth:`ctxcache.Client.open_session`).
``ctxcache.torch.kernels`` (Triton GPU kernels of the benchmark) is not
imported here: it needs triton and a CUDA device; import it explicitly.
"""
from ctxcache.torch.artifacts import (CsaArtifact, CsaOptions, OracleArtifact, QuestArtifact,
                                      StreamingArtifact, parse_csa_artifact,
                                      parse_oracle_artifact, parse_quest_artifact,
                                      parse_streaming_artifact)
from ctxcache.torch.tables import ContextTables, SessionParams

__all__ = ["CsaArtifact", "CsaOptions", "parse_csa_artifact", "ContextTables", "SessionParams",
           "OracleArtifact", "QuestArtifact", "StreamingArtifact", "parse_oracle_artifact",
           "parse_quest_artifact", "parse_streaming_artifact"]
