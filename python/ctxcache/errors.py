"""Exceptions: one class per gRPC status code, all subclasses of :class:`Error`;
:class:`NotFound` is also a :class:`LookupError` and :class:`DeadlineExceeded`
a :class:`TimeoutError`, so code written against the built-ins catches them.

Every failed call raises the class of its status code, carrying the server's
message (``.message``), the code (``.code``, a :class:`grpc.StatusCode`) and
the RPC that failed (``.rpc``). In-band decode errors (``DecodeResponse.error``,
after which the session stays usable) map the same way.

>>> try:
...     client.get("00112233445566778899aabbccddeeff")
... except ctxcache.NotFound as e:
...     print(e.code, e.message)
"""
from __future__ import annotations

from typing import Dict, Optional, Type, Union

import grpc

__all__ = [
    "Error",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
    "error_for_code",
    "from_rpc_error",
]


class Error(Exception):
    """Base class of every error the ctxcache client raises for a failed call.

    Attributes:
        code: the gRPC status code (``grpc.StatusCode``).
        message: the server's (or the client's) message, without prefixes.
        rpc: the RPC or operation that failed, e.g. ``"GetContext"`` (may be "").
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "", code: Optional[grpc.StatusCode] = None,
                 rpc: str = "") -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.rpc = rpc
        super().__init__(message)

    def __str__(self) -> str:
        where = f"{self.rpc}: " if self.rpc else ""
        return f"{self.code.name}: {where}{self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, rpc={self.rpc!r})"


class Cancelled(Error):
    """CANCELLED: the call was cancelled (usually by the caller)."""

    code = grpc.StatusCode.CANCELLED


class Unknown(Error):
    """UNKNOWN: an error the server did not classify."""

    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(Error):
    """INVALID_ARGUMENT: malformed id, wrong shape/dtype, NaN/Inf, unknown method or param,
    layer out of range, empty input, token outside the vocabulary."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(Error, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline (``Client(timeout=...)``) passed.
    Also a :class:`TimeoutError`."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(Error, LookupError):
    """NOT_FOUND: unknown context or model. Also a :class:`LookupError`."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(Error):
    """ALREADY_EXISTS: the tokens are stored with other indexes or index params."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(Error):
    """PERMISSION_DENIED."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(Error):
    """RESOURCE_EXHAUSTED: build queue full, too many sessions, message too large, store full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(Error):
    """FAILED_PRECONDITION: context not READY, index not built, out-of-order session message,
    evicting a pinned context or a parent."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(Error):
    """ABORTED: e.g. an ingest stream that ended without its commit (nothing stored)."""

    code = grpc.StatusCode.ABORTED


class OutOfRange(Error):
    """OUT_OF_RANGE."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(Error):
    """UNIMPLEMENTED: the server does not have this RPC."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(Error):
    """INTERNAL: a server bug or a malformed stream."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(Error):
    """UNAVAILABLE: server unreachable or draining (retried with backoff before raising)."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(Error):
    """DATA_LOSS: a page or index artifact failed its crc32c (server or client side)."""

    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(Error):
    """UNAUTHENTICATED."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[grpc.StatusCode, Type[Error]] = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}
_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_for_code(code: Union[int, grpc.StatusCode], message: str, rpc: str = "") -> Error:
    """Returns the exception for a status code given as a ``grpc.StatusCode`` or its
    number (as in ``RequestError.code``). Unknown numbers give :class:`Unknown`."""
    if not isinstance(code, grpc.StatusCode):
        code = _BY_NUMBER.get(int(code), grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, Unknown)
    return cls(message, code=code if cls is Unknown else None, rpc=rpc)


def from_rpc_error(e: grpc.RpcError, rpc: str = "") -> Error:
    """Converts a ``grpc.RpcError`` (a failed call) to the matching :class:`Error`."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return error_for_code(code or grpc.StatusCode.UNKNOWN, details or "", rpc)
