"""Server-less tests: crc32c, tensor conversion, error mapping, page decoding."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

import ctxcache
from ctxcache import tensors
from ctxcache.crc32c import crc32c, crc32c_py


# RFC 3720 (iSCSI) B.4 test vectors, plus the common "123456789" check value.
@pytest.mark.parametrize("data,want", [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
])
def test_crc32c_known_vectors(data: bytes, want: int) -> None:
    assert crc32c(data) == want
    assert crc32c_py(data) == want


@pytest.mark.parametrize("n", [1, 255, 16383, 16384, 16385, 70000, 1 << 20, (1 << 20) + 77])
def test_crc32c_vectorised_equals_bytewise_and_extends(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = crc32c_py(data)
    assert crc32c(data) == want
    assert crc32c(np.frombuffer(data, dtype=np.uint8)) == want
    cut = n // 3
    assert crc32c(data[cut:], crc32c(data[:cut])) == want


def test_bf16_conversion_round_trips_and_rounds_to_nearest_even() -> None:
    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0], dtype=np.float32)
    bits = tensors.float32_to_bf16(x)
    assert bits.dtype == np.uint16
    back = tensors.bf16_to_float32(bits)
    assert np.array_equal(back[:3], x[:3])  # exactly representable
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -8)
    # 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
    assert tensors.bf16_to_float32(tensors.float32_to_bf16(np.float32([1 + 2 ** -8])))[0] == 1.0


def test_encode_tensor_checks_shape_and_converts() -> None:
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    t = tensors.encode_tensor(a, (3, 4))
    assert t.dtype == ctxcache.storage_pb.DTYPE_F32 and list(t.shape) == [3, 4]
    assert np.array_equal(np.frombuffer(t.data, "<f4").reshape(3, 4), a)
    t16 = tensors.encode_tensor(a, (3, 4), dtype="bf16")
    assert t16.dtype == ctxcache.storage_pb.DTYPE_BF16 and len(t16.data) == 24
    assert np.array_equal(tensors.decode_array(t16.data, t16.dtype, (3, 4)), a)
    with pytest.raises(ValueError, match="shape"):
        tensors.encode_tensor(a, (4, 3))


def test_torch_tensors_keep_bf16() -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, dtype=torch.float32).to(torch.bfloat16)
    t = tensors.encode_tensor(x, (2, 3))
    assert t.dtype == ctxcache.storage_pb.DTYPE_BF16
    raw = tensors.decode_array(t.data, t.dtype, (2, 3), "raw")
    back = tensors.to_torch(raw, t.dtype)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)


ALL_CODES = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]


@pytest.mark.parametrize("code", ALL_CODES, ids=[c.name for c in ALL_CODES])
def test_every_status_code_has_its_own_error_class(code: grpc.StatusCode) -> None:
    e = ctxcache.error_for_code(code, "the message", "GetContext")
    assert isinstance(e, ctxcache.Error)
    assert e.code == code and e.message == "the message" and e.rpc == "GetContext"
    assert type(e) is not ctxcache.Error
    assert type(e).code == code  # the class itself carries the code
    # Numeric codes (DecodeResponse.error.code) map the same way.
    assert type(ctxcache.error_for_code(code.value[0], "m")) is type(e)
    assert code.name in str(e) and "the message" in str(e)


def test_named_error_classes() -> None:
    names = {"NotFound": "NOT_FOUND", "InvalidArgument": "INVALID_ARGUMENT",
             "FailedPrecondition": "FAILED_PRECONDITION",
             "ResourceExhausted": "RESOURCE_EXHAUSTED", "DataLoss": "DATA_LOSS",
             "Unavailable": "UNAVAILABLE", "AlreadyExists": "ALREADY_EXISTS",
             "PermissionDenied": "PERMISSION_DENIED", "Unauthenticated": "UNAUTHENTICATED",
             "DeadlineExceeded": "DEADLINE_EXCEEDED", "Cancelled": "CANCELLED",
             "Aborted": "ABORTED", "Internal": "INTERNAL"}
    for cls_name, code in names.items():
        cls = getattr(ctxcache, cls_name)
        assert issubclass(cls, ctxcache.Error) and cls.code.name == code
    assert type(ctxcache.error_for_code(999, "x")) is ctxcache.Unknown


def test_decode_page_checks_crc_and_decodes_bf16() -> None:
    k = np.linspace(-1, 1, 16 * 4, dtype=np.float32).reshape(16, 4)
    v = -k
    kb, vb = tensors.float32_to_bf16(k).tobytes(), tensors.float32_to_bf16(v).tobytes()
    page = ctxcache.pb.Page(layer=1, kv_head=0, block=3, n_tokens=16,
                            dtype=ctxcache.storage_pb.DTYPE_BF16, k=kb, v=vb,
                            crc32c=crc32c(kb + vb))
    p = ctxcache.decode_page(page)
    assert p.k.shape == (16, 4) and p.k.dtype == np.float32 and p.dtype == "bf16"
    assert np.allclose(p.k, k, atol=1e-2) and np.allclose(p.v, v, atol=1e-2)
    raw = ctxcache.decode_page(page, dtype="raw")
    assert raw.k.dtype == np.uint16 and raw.k.tobytes() == kb
    page.k = bytes([page.k[0] ^ 1]) + page.k[1:]  # one flipped bit
    with pytest.raises(ctxcache.DataLoss, match="crc32c"):
        ctxcache.decode_page(page)


def test_client_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ctxcache.Client("")
    with pytest.raises(ValueError):
        ctxcache.Client("127.0.0.1:1", timeout=0)
    with ctxcache.Client("127.0.0.1:1") as c:
        with pytest.raises(ValueError, match="exactly one"):
            c.build()
        with pytest.raises(ValueError, match="uint32"):
            c.build(tokens=[1, -2])


def test_crc32c_many_matches_one_at_a_time() -> None:
    from ctxcache.crc32c import crc32c, crc32c_many
    rng = np.random.default_rng(7)
    sizes = [4096] * 40 + [2048] * 3 + [0, 1, 255, 256, 257, 1234, 20000, 70000]
    bufs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    assert [int(x) for x in crc32c_many(bufs)] == [crc32c(b) for b in bufs]
    assert int(crc32c_many([b"123456789"])[0]) == 0xE3069283


def test_crc32c_many_on_the_gpu_matches_the_cpu() -> None:
    # Groups over 4 MiB take the lock step on the GPU when there is one.
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ctxcache.crc32c import crc32c_many
    rng = np.random.default_rng(8)
    sizes = [4096] * 1500 + [4000] * 1100 + [9] * 2
    bufs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]
    bufs[5] = bytes(4096)
    gpu = crc32c_many(bufs)
    cpu = crc32c_many(bufs, gpu=False)
    assert gpu.tolist() == cpu.tolist()
