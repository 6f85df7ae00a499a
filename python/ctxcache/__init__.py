"""ctxcache: Python client for ctxcached, the persistent context-cache service.

Usable from PyTorch workers: arrays go in and come out as numpy arrays, or
as torch tensors when asked (``as_torch=True``; torch is optional).

>>> import ctxcache
>>> with ctxcache.connect("127.0.0.1:7700") as client:
...     done = client.build(tokens=list(range(1, 300)), name="doc")
...     ctx = done.context                       # a ContextInfo message
...     with client.open_session(ctx.context_id, method="csa") as s:
...         r = s.step(0, queries)               # [n_q_heads, head_dim]
...         r.heads[0].per_q_head[0], r.heads[0].pages[0].k

Contents:

* :func:`connect`: a :class:`Client` for ``HOST:PORT``, a :class:`ClusterClient`
  (same methods, routed to the nodes holding each context) for
  ``etcd://host:port/<cluster>``.
* :class:`Client`: every RPC (build, extend, ingest, get, list, evict, pin,
  stats, watch, fetch_index, fetch_pages, open_session, health), with
  deadlines and retries on UNAVAILABLE like the C++ SDK.
* :class:`Session`: server-select decode sessions (step, append, close).
* :class:`Error` and one subclass per gRPC status code (``NotFound``,
  ``InvalidArgument``, ...): :mod:`ctxcache.errors`.
* :func:`crc32c` (Castagnoli), :class:`Page`, :class:`StepResult`.
* ``ctxcache.v1``: the generated protobuf/gRPC modules
  (``ctxcache.v1.ctxcache_service_pb2`` etc.), also re-exported as
  ``ctxcache.pb``.

Generated stubs: ``ctxcache.v1`` is not in git. It is generated from the
repository's ``proto/`` folder when the package is built (``pip install``
runs ``gen_protos.py`` via setup.py) with Debian's protoc 3.21 (+
grpc_python_plugin), else grpcio-tools, else plain protoc (messages only:
the client builds its gRPC stubs from the service descriptors). Each
candidate's output is import-tested against the installed protobuf runtime
before it is used. protoc 3.21's output loads under protobuf 3.21 (Debian
12) and protobuf 7.x (checked with 7.36 / grpcio 1.84), so a wheel built on
Debian also runs on a GPU host with newer grpcio/protobuf. The proto package
``ctxcache.v1`` is also the Python package ``ctxcache.v1``, so the generated
imports need no rewriting. See python/README.md.
"""
from __future__ import annotations

try:
    from ctxcache.v1 import ctxcache_service_pb2 as pb
    from ctxcache.v1 import storage_pb2 as storage_pb
except ImportError as _e:  # pragma: no cover - a source checkout without stubs
    raise ImportError(
        "ctxcache: the generated protobuf stubs (ctxcache/v1/*_pb2.py) are missing; install "
        "the package (pip install --no-index --no-build-isolation ./python) or run "
        "python3 python/gen_protos.py"
    ) from _e

from ctxcache.client import Client, Watcher
from ctxcache.cluster import ClusterClient, FailoverSession, connect
from ctxcache.crc32c import crc32c
from ctxcache.page_codec import decode_page
from ctxcache.errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                             Error, FailedPrecondition, Internal, InvalidArgument, NotFound,
                             OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                             Unavailable, Unimplemented, Unknown, error_for_code)
from ctxcache.session import Session
from ctxcache.types import HeadResult, Page, StepResult

__version__ = "0.1.0"

__all__ = [
    "connect", "Client", "ClusterClient", "FailoverSession", "Session", "Watcher", "Page",
    "HeadResult", "StepResult", "crc32c",
    "decode_page", "pb", "storage_pb", "error_for_code",
    "Error", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
    "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted",
    "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss", "Unauthenticated",
]
