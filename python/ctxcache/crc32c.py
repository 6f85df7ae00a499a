"""CRC-32C (Castagnoli), the checksum of ctxcache's pages and index artifacts.

The same variant as the server's common/crc32c.h (iSCSI/ext4/RocksDB):
reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF;
``crc32c(b"123456789") == 0xE3069283``.

On the host the ``crc32c`` extension computes it (Debian's python3-crc32c,
PyPI's crc32c: the SSE4.2 instruction where the CPU has it, several GB/s).
Without it, a byte-table loop in pure Python gives the same values at a few
MB/s, with a RuntimeWarning saying what to install.

Rows that are already torch tensors (pages on a GPU) go through
crc32c_rows_torch: the CRC as two GF(2) matrix products, exact in floating
point, a handful of kernels per call on any torch device.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Dict, List, Tuple, Union

import numpy as np

try:
    import crc32c as _native  # the extension module, not this one (absolute import)
except ImportError:  # pragma: no cover - depends on the host
    _native = None

if TYPE_CHECKING:
    import torch

__all__ = ["crc32c", "crc32c_many", "crc32c_py", "crc32c_rows_torch"]

_POLY = 0x82F63B78


def _make_table() -> List[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE: List[int] = _make_table()
_TABLE_NP = np.array(_TABLE, dtype=np.uint32)

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]


def crc32c_py(data: Buffer, crc: int = 0) -> int:
    """Byte-at-a-time CRC-32C of data continuing from ``crc`` (0 to start)."""
    t = _TABLE
    r = ~crc & 0xFFFFFFFF
    for b in bytes(memoryview(data).cast("B")) if not isinstance(data, bytes) else data:
        r = t[(r ^ b) & 0xFF] ^ (r >> 8)
    return ~r & 0xFFFFFFFF


# --- the zero-bytes operator ------------------------------------------------
# Z_n(r) is the CRC register after feeding n zero bytes to register r. It is
# linear over GF(2): stored as the images of the 32 unit vectors.

def _apply(cols: Tuple[int, ...], x: int) -> int:
    out = 0
    i = 0
    while x:
        if x & 1:
            out ^= cols[i]
        x >>= 1
        i += 1
    return out


def _compose(a: Tuple[int, ...], b: Tuple[int, ...]) -> Tuple[int, ...]:
    """a after b."""
    return tuple(_apply(a, c) for c in b)


_ZERO_OPS: Dict[int, Tuple[int, ...]] = {
    1: tuple(_TABLE[(1 << i) & 0xFF] ^ ((1 << i) >> 8) for i in range(32))
}


def _zeros_op(n: int) -> Tuple[int, ...]:
    """Z_n for n a power of two (cached)."""
    op = _ZERO_OPS.get(n)
    if op is None:
        half = _zeros_op(n // 2)
        op = _ZERO_OPS[n] = _compose(half, half)
    return op


_BYTE_TABLES: Dict[int, np.ndarray] = {}
_BITS = ((np.arange(256, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)) & 1)


def _byte_tables(n: int) -> np.ndarray:
    """Z_n as 4 tables of 256 entries: Z_n(x) = xor_k T[k][byte k of x]."""
    tabs = _BYTE_TABLES.get(n)
    if tabs is None:
        cols = np.array(_zeros_op(n), dtype=np.uint32).reshape(4, 8)
        tabs = np.zeros((4, 256), dtype=np.uint32)
        for k in range(4):
            for i in range(8):
                tabs[k] ^= _BITS[:, i] * cols[k, i]
        _BYTE_TABLES[n] = tabs
    return tabs


def _zeros_after(n: int, x):
    """Z_n(x) through _byte_tables(n): x a register (int) or uint32 array."""
    tabs = _byte_tables(n)
    return (tabs[0][x & 0xFF] ^ tabs[1][(x >> 8) & 0xFF] ^ tabs[2][(x >> 16) & 0xFF]
            ^ tabs[3][x >> 24])


def _flat(data: Buffer) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _host_crc(flat: np.ndarray, crc: int = 0) -> int:
    if _native is not None:
        return int(_native.crc32c(flat, crc))
    _warn_no_extension()
    return crc32c_py(flat.tobytes(), crc)


@functools.lru_cache(maxsize=1)
def _warn_no_extension() -> None:
    import warnings
    warnings.warn("ctxcache: the crc32c extension is missing, so page and index checksums "
                  "run in pure Python (a few MB/s): apt-get install python3-crc32c (Debian) "
                  "or pip install crc32c", RuntimeWarning, stacklevel=3)


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C of ``data`` (bytes-like or a numpy array's raw bytes), continuing
    from ``crc`` (0 to start): ``crc32c(b, crc32c(a)) == crc32c(a + b)``."""
    return _host_crc(_flat(data), crc)


# --- many equal-length rows as one matrix product ----------------------------
# The CRC is affine over GF(2): for rows of n bytes, crc(x) = L_n(x) ^ crc(0^n)
# with L_n(x) the register after feeding x to a zero register, linear in the
# 8n bits of x. Leading zero bytes leave a zero register at zero, so a row is
# left-padded to k chunks of _ROW_CHUNK bytes; then
#   L_n(x) = xor_i Z_{(k-1-i)C}(L_C(chunk_i))   (C = _ROW_CHUNK).
# Stage 1 computes every L_C(chunk_i) as bits[8C] @ A (A: [8C, 32], the
# register bits of each single input bit) and takes the counts mod 2; stage 2
# shifts and xors the k chunk registers of a row as parity[32k] @ B_k
# (B_k: [32k, 32], the bits of Z_{(k-1-i)C} applied to each register bit).

_ROW_CHUNK = 256  # 2048 bits: a stage-1 count is at most 2048, exact in float16
_ROW_STEP_CUDA = 4 << 20   # input bytes per stage-1 step: bounds the unpacked bits
_ROW_STEP_CPU = 64 << 10   # (on the CPU, small enough for them to stay in cache)
_SHIFTS8 = np.arange(8, dtype=np.uint32)
_SHIFTS32 = np.arange(32, dtype=np.uint32)


def _register_bits(regs: np.ndarray) -> np.ndarray:
    """[...] uint32 -> [..., 32] uint8 0/1, bit t of each value at index t."""
    return ((regs[..., None] >> _SHIFTS32) & 1).astype(np.uint8)


def _chunk_matrix_np() -> np.ndarray:
    """A: [8C, 32]; row 8j + b holds the register after feeding a zero
    register the byte (1 << b) at position j of a C-byte chunk, i.e. the
    byte (1 << b) followed by C - 1 - j zero bytes."""
    regs = np.empty((_ROW_CHUNK, 8), dtype=np.uint32)
    v = _TABLE_NP[1 << _SHIFTS8]
    for j in range(_ROW_CHUNK - 1, -1, -1):
        regs[j] = v
        v = _TABLE_NP[v & 0xFF] ^ (v >> 8)
    return _register_bits(regs.reshape(-1))


def _shift_matrix_np(k: int) -> np.ndarray:
    """B_k: [32k, 32]; row 32i + t holds Z_{(k-1-i)C}(1 << t), the
    contribution of bit t of chunk i's register to the row's register."""
    ops = np.array([1 << t for t in range(32)], dtype=np.uint32)[None]  # ops[s] = Z_{sC}
    length = _ROW_CHUNK
    while ops.shape[0] < k:  # doubling: Z_{(s + 2^p)C} = Z_{2^p C} o Z_{sC}
        ops = np.concatenate([ops, _zeros_after(length, ops)])
        length *= 2
    return _register_bits(ops[:k][::-1].reshape(-1))


@functools.lru_cache(maxsize=1024)
def _zero_row_crc(n: int) -> int:
    return crc32c(bytes(n))


@functools.lru_cache(maxsize=8)
def _chunk_matrix(device, dtype):
    import torch
    return torch.from_numpy(_chunk_matrix_np()).to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=16)
def _shift_matrix(k: int, device):
    import torch
    return torch.from_numpy(_shift_matrix_np(k)).to(device=device, dtype=torch.float32)


def crc32c_rows_torch(rows: "torch.Tensor") -> "torch.Tensor":
    """CRC-32C (from 0) of each row of ``rows`` (uint8 [m, n], any torch
    device), as int64 [m] on that device, values in [0, 2**32).

    Two matrix products of 0/1 values (see the comment above), exact by
    construction: a stage-1 output sums at most 2048 ones (float16 on CUDA,
    float32 elsewhere: both hold every integer up to 2048, whatever the
    accumulation order), a stage-2 output at most n / 8 (float32: exact for
    n < 128 MiB; TF32 rounding keeps 0/1 inputs exact too).

    Memory: cached per device, A (2048 x 32: 128 KiB in float16, 256 KiB in
    float32) and, per row length, B_k (16 n bytes; the 16 most recent
    lengths are kept). Per call: a left-padded copy of ``rows`` when n is not
    a multiple of 256, the chunk parities (0.5 bytes per input byte) and the
    unpacked bits of one step (24 bytes per step byte on CUDA, 40 on the
    CPU: about 96 MiB for a 4 MiB CUDA step, 2.5 MiB for a 64 KiB CPU one),
    whatever m and n are."""
    import torch
    if not isinstance(rows, torch.Tensor):
        raise TypeError("crc32c_rows_torch: rows must be a torch.Tensor, "
                        f"got {type(rows).__name__}")
    if rows.dtype != torch.uint8:
        raise ValueError(f"crc32c_rows_torch: rows must be uint8, got {rows.dtype}")
    if rows.dim() != 2:
        raise ValueError("crc32c_rows_torch: rows must be 2-D [m, n], "
                         f"got shape {tuple(rows.shape)}")
    m, n = rows.shape
    dev = rows.device
    if m == 0 or n == 0:
        return torch.zeros(m, dtype=torch.int64, device=dev)
    c = _ROW_CHUNK
    k = -(-n // c)
    if k * c != n:
        rows = torch.nn.functional.pad(rows, (k * c - n, 0))
    chunks = rows.reshape(m * k, c)
    a = _chunk_matrix(dev, torch.float16 if dev.type == "cuda" else torch.float32)
    sh8 = torch.arange(8, dtype=torch.uint8, device=dev)
    par = torch.empty(m * k, 32, dtype=torch.float32, device=dev)
    step = (_ROW_STEP_CUDA if dev.type == "cuda" else _ROW_STEP_CPU) // c
    for s in range(0, m * k, step):
        u = chunks[s:s + step, :, None] >> sh8  # bit b of byte j at column 8j + b
        u &= 1
        par[s:s + step] = torch.remainder(u.to(a.dtype).view(-1, 8 * c) @ a, 2)
    if k > 1:
        par = torch.remainder(par.view(m, 32 * k) @ _shift_matrix(k, dev), 2)
    sh32 = torch.arange(32, dtype=torch.int64, device=dev)
    return (par.to(torch.int64) << sh32).sum(1) ^ _zero_row_crc(n)


# crc32c_many's contract for gpu=True: a group of equal-length buffers holding
# at least _TORCH_MIN_BYTES goes to crc32c_rows_torch on the CUDA device when
# torch imports and sees one; smaller groups stay on the host and never
# import torch or touch the device. Without CUDA everything stays on the host:
# the matrix products take ~512 flops per byte, far slower on a CPU than the
# extension.
_TORCH_MIN_BYTES = 64 << 10


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# Buffers of at least _BLOCK bytes go to the device as _BLOCK-byte rows (one
# row length for every buffer: one cached B_k, whatever the buffers' sizes),
# at most _BLOCK_ROWS rows per product; their CRCs are chained on the host.
_BLOCK = 64 << 10
_BLOCK_ROWS = 256


def _crc32c_blocked(torch, flats: "List[np.ndarray]", device) -> List[int]:
    """CRC-32C of each buffer (each at least _BLOCK bytes): its whole
    _BLOCK-byte blocks by crc32c_rows_torch on ``device``, chained with
    R <- Z(R) ^ raw(block) (Z: _BLOCK zero bytes, raw = crc ^ crc of zeros),
    then the tail on the host."""
    counts = [f.size // _BLOCK for f in flats]
    where = [(b, k) for b, c in enumerate(counts) for k in range(c)]
    block_crc = np.empty(len(where), dtype=np.uint32)
    for lo in range(0, len(where), _BLOCK_ROWS):
        part = where[lo:lo + _BLOCK_ROWS]
        mat = np.stack([flats[b][k * _BLOCK:(k + 1) * _BLOCK] for b, k in part])
        block_crc[lo:lo + len(part)] = crc32c_rows_torch(
            torch.from_numpy(mat).to(device)).cpu().numpy()
    zero = _zero_row_crc(_BLOCK)
    out, pos = [], 0
    for f, c in zip(flats, counts):
        r = 0xFFFFFFFF
        for v in block_crc[pos:pos + c].tolist():
            r = int(_zeros_after(_BLOCK, r)) ^ v ^ zero
        pos += c
        out.append(crc32c(f[c * _BLOCK:], ~r & 0xFFFFFFFF) if f.size > c * _BLOCK
                   else ~r & 0xFFFFFFFF)
    return out


def crc32c_many(buffers: "List[Buffer]", gpu: bool = True) -> np.ndarray:
    """CRC-32C of each buffer (from 0), as uint32 values: many small buffers
    (decode pages, a few KB each) in one pass, on the host by the extension.
    With ``gpu`` and torch seeing a CUDA device, groups of at least 64 KiB go to
    crc32c_rows_torch on the GPU instead (see _TORCH_MIN_BYTES), and so do
    the whole 64 KiB blocks of buffers of 64 KiB or more (index artifacts:
    one row length for all of them, chained on the host)."""
    out = np.zeros(len(buffers), dtype=np.uint32)
    flats = [_flat(b) for b in buffers]
    big = [i for i, f in enumerate(flats) if f.size >= _BLOCK]
    blocked = _torch_cuda() if gpu and big else None
    if blocked is not None:
        out[big] = _crc32c_blocked(blocked, [flats[i] for i in big], "cuda")
    groups: Dict[int, List[int]] = {}
    for i, f in enumerate(flats):
        if blocked is None or f.size < _BLOCK:
            groups.setdefault(f.size, []).append(i)
    for n, idx in groups.items():
        torch = _torch_cuda() if gpu and n * len(idx) >= _TORCH_MIN_BYTES else None
        if torch is not None:
            rows = torch.from_numpy(np.stack([flats[i] for i in idx])).to("cuda")
            out[idx] = crc32c_rows_torch(rows).cpu().numpy()
            continue
        for i in idx:
            out[i] = _host_crc(flats[i])
    return out
