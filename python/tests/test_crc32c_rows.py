"""crc32c_rows_torch (CRC-32C of equal-length rows as matrix products)
against the byte-table crc32c, on the CPU everywhere and on CUDA where
there is a device."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# ctxcache/__init__ re-exports the function crc32c, which hides the module.
crcmod = importlib.import_module("ctxcache.crc32c")
crc32c = crcmod.crc32c
crc32c_many = crcmod.crc32c_many
crc32c_rows_torch = crcmod.crc32c_rows_torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def expected(rows: np.ndarray) -> list:
    return [crc32c(r.tobytes()) for r in rows]


def rows_crc(rows: np.ndarray, device: str = "cpu") -> list:
    got = crc32c_rows_torch(torch.from_numpy(rows).to(device))
    assert got.dtype == torch.int64 and tuple(got.shape) == (rows.shape[0],)
    assert got.device.type == torch.device(device).type
    return got.cpu().tolist()


@pytest.mark.parametrize("n", [0, 1, 3, 255, 256, 257, 4096, 8192, 65536 + 7])
@pytest.mark.parametrize("m", [0, 1, 5])
def test_random_rows_match_crc32c(n: int, m: int) -> None:
    rng = np.random.default_rng(n * 10 + m)
    rows = rng.integers(0, 256, size=(m, n), dtype=np.uint8)
    assert rows_crc(rows) == expected(rows)


@pytest.mark.parametrize("n", [1, 255, 4096, 4000])
def test_many_rows(n: int) -> None:
    rng = np.random.default_rng(n)
    rows = rng.integers(0, 256, size=(300, n), dtype=np.uint8)
    assert rows_crc(rows) == expected(rows)


@pytest.mark.parametrize("n", [1, 256, 4096, 65536 + 7])
def test_all_zero_and_all_ones_rows(n: int) -> None:
    rows = np.stack([np.zeros(n, np.uint8), np.full(n, 0xFF, np.uint8)])
    assert rows_crc(rows) == expected(rows)


def test_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    rows = np.frombuffer(b"123456789", dtype=np.uint8)[None].copy()
    assert rows_crc(rows) == [0xE3069283]


def test_results_are_unsigned_32_bit() -> None:
    rng = np.random.default_rng(3)
    got = crc32c_rows_torch(torch.from_numpy(rng.integers(0, 256, (200, 64), dtype=np.uint8)))
    assert int(got.min()) >= 0 and int(got.max()) < 1 << 32
    assert int(got.max()) >= 1 << 31  # some have the top bit set, none went negative


def test_non_contiguous_rows() -> None:
    rng = np.random.default_rng(4)
    base = torch.from_numpy(rng.integers(0, 256, (6, 1000), dtype=np.uint8))
    view = base[::2, 100:700]  # strided rows
    assert not view.is_contiguous()
    assert crc32c_rows_torch(view).tolist() == expected(view.numpy())


def test_several_steps_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shrink the step so the stage-1 loop runs more than once, with a ragged end.
    monkeypatch.setattr(crcmod, "_ROW_STEP_CPU", 3 * crcmod._ROW_CHUNK)
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, size=(7, 1000), dtype=np.uint8)
    assert rows_crc(rows) == expected(rows)


def test_errors() -> None:
    with pytest.raises(ValueError, match="uint8"):
        crc32c_rows_torch(torch.zeros(2, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="uint8"):
        crc32c_rows_torch(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="2-D"):
        crc32c_rows_torch(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        crc32c_rows_torch(torch.zeros(2, 2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="torch.Tensor"):
        crc32c_rows_torch(np.zeros((2, 4), dtype=np.uint8))  # type: ignore[arg-type]


def test_crc32c_many_without_gpu_unchanged() -> None:
    rng = np.random.default_rng(6)
    sizes = [4096] * 20 + [4000] * 17 + [0, 9, 300]
    bufs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    assert crc32c_many(bufs, gpu=False).tolist() == [crc32c(b) for b in bufs]


@needs_cuda
@pytest.mark.parametrize("m,n", [(1, 1), (5, 255), (300, 4096), (42, 4000), (3, 65536 + 7),
                                 (1100, 4096)])
def test_cuda_matches_cpu(m: int, n: int) -> None:
    rng = np.random.default_rng(m + n)
    rows = rng.integers(0, 256, size=(m, n), dtype=np.uint8)
    rows[0] = 0xFF
    assert rows_crc(rows, "cuda") == rows_crc(rows) == expected(rows)


@needs_cuda
def test_crc32c_many_on_cuda_matches_cpu() -> None:
    rng = np.random.default_rng(9)
    sizes = [4096] * 42 + [4000] * 30 + [65536] * 2 + [9] * 3 + [300]
    bufs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    assert crc32c_many(bufs).tolist() == crc32c_many(bufs, gpu=False).tolist()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_large_buffers_go_in_chained_blocks(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # What crc32c_many does on a GPU with buffers of 64 KiB or more (index
    # artifacts): their whole blocks as rows of one length, several products
    # (a small row cap here), the block CRCs chained on the host, the tail
    # continued on the host.
    monkeypatch.setattr(crcmod, "_BLOCK_ROWS", 3)
    rng = np.random.default_rng(12)
    block = crcmod._BLOCK
    sizes = [block, 2 * block + 1, 3 * block + 20000, 5 * block - 1, block + 255]
    flats = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
    flats[1][:] = 0
    got = crcmod._crc32c_blocked(torch, flats, device)
    assert got == [crc32c(f.tobytes()) for f in flats]
