"""Server-less tests: crc32c, tensor conversion, error mapping, page decoding,
CSAC index artifact lists."""
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


def test_host_crc32c_is_the_native_extension() -> None:
    # The numpy implementation (100-300 MB/s) is gone: the host path is the
    # crc32c extension (Debian's python3-crc32c).
    import importlib
    mod = importlib.import_module("ctxcache.crc32c")
    assert mod._native is importlib.import_module("crc32c")
    assert not hasattr(mod, "_stripes")


def test_without_the_extension_crc32c_warns_and_stays_correct(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    mod = importlib.import_module("ctxcache.crc32c")
    monkeypatch.setattr(mod, "_native", None)
    mod._warn_no_extension.cache_clear()
    with pytest.warns(RuntimeWarning, match="python3-crc32c"):
        assert mod.crc32c(b"123456789") == 0xE3069283
    bufs = [bytes([i]) * 100 for i in range(5)]
    assert [int(x) for x in mod.crc32c_many(bufs, gpu=False)] == [crc32c_py(b) for b in bufs]


@pytest.mark.parametrize("n", [1, 255, 16383, 16384, 16385, 70000, 1 << 20, (1 << 20) + 77])
def test_crc32c_native_equals_bytewise_and_extends(n: int) -> None:
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


# Regression: build(tokens=[1.9, 2.7]) truncated to [1, 2] and built another
# context. Non-integers are a TypeError naming the field, before any call.
@pytest.mark.parametrize("tokens", [
    [1.9, 2.7], [1, 2.0], (3, "4"), [True, 2], np.array([1.9, 2.7]),
    np.array([1.0, 2.0], dtype=np.float32),
])
def test_build_rejects_non_integer_tokens_naming_the_field(tokens) -> None:
    with ctxcache.Client("127.0.0.1:1") as c:
        with pytest.raises(TypeError, match="tokens: expected integer token ids"):
            c.build(tokens=tokens)
        with pytest.raises(TypeError, match="tokens: expected integer token ids"):
            c.extend("00" * 16, tokens=tokens)


@pytest.mark.parametrize("tokens", [
    [1, 2, 3], (1, 2, 3), [np.int32(1), np.uint16(2), np.int64(3)],
    np.array([1, 2, 3], dtype=np.int32), np.array([1, 2, 3], dtype=np.uint32),
    np.array([1, 2, 3], dtype=np.int64),
])
def test_token_ids_accept_python_and_numpy_integers(tokens) -> None:
    from ctxcache.client import _token_ids
    ids = _token_ids(tokens)
    assert ids == [1, 2, 3] and all(type(t) is int for t in ids)


# Regression: inspect.signature(ctxcache.Client) showed __new__'s
# (address, *args, **kwargs).
def test_errors_subclass_the_matching_builtins() -> None:
    nf = ctxcache.errors.error_for_code(grpc.StatusCode.NOT_FOUND, "no such context",
                                        rpc="GetContext")
    de = ctxcache.errors.error_for_code(grpc.StatusCode.DEADLINE_EXCEEDED, "late")
    assert isinstance(nf, LookupError) and isinstance(nf, ctxcache.Error)
    assert isinstance(de, TimeoutError) and isinstance(de, ctxcache.Error)
    assert str(nf) == "NOT_FOUND: GetContext: no such context"
    assert nf.message == "no such context" and de.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(LookupError):
        raise nf


# protoc 3.20+ writes .pyi stubs of the messages (--pyi_out): the build installs
# them next to the modules, so type checkers see fields instead of Any.
def test_message_type_stubs_are_installed() -> None:
    import importlib
    import os
    import re
    import shutil
    import subprocess
    protoc = shutil.which("protoc")
    if not protoc:
        pytest.skip("no protoc on PATH")
    out = subprocess.run([protoc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m or (int(m.group(1)), int(m.group(2))) < (3, 20):
        pytest.skip(f"protoc without --pyi_out: {out.strip()}")
    mod = importlib.import_module("ctxcache.v1.ctxcache_service_pb2")
    pyi = os.path.splitext(mod.__file__)[0] + ".pyi"
    assert os.path.isfile(pyi), pyi
    assert "class BuildContextRequest(" in open(pyi).read()


def test_client_signature_lists_its_parameters() -> None:
    import inspect
    params = inspect.signature(ctxcache.Client).parameters
    assert list(params)[:3] == ["address", "timeout", "max_attempts"]
    assert "api_key" in params and "args" not in params and "kwargs" not in params
    assert params["timeout"].default == 30.0


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


# ------------------------------------------------------ CSAC list decoding --


def _csac_lists(rng: np.random.Generator, n_tokens: int, L: int, m: int, C: int,
                codings: list) -> tuple:
    """A CSAC version 3 artifact built here (docs/storage-format.md), its
    lists' contents and, per list, the offsets of its coding byte, ids,
    codebook and codes. `codings`: per list 0 (varints), 1 (bitmap) or
    ("ef", k)."""
    from ctxcache.torch import artifacts as art

    d = 2 * m
    fields = (m, C, 0.125, L, 4096, 8, 1, 42, 0.05, 32, 4, 1, 0.3, 1, 0, 0, 0, 1, 1,
              d, n_tokens, n_tokens, L)
    out = bytearray(b"CSAC" + (3).to_bytes(4, "little") + art._FIELDS.pack(*fields))
    out += rng.standard_normal(C * d + d + m * C).astype("<f4").tobytes()
    out.append(4)  # score bits
    levels = min(16, L)
    want, at = [], []
    for coding in codings:
        ids = np.sort(rng.choice(n_tokens, size=L, replace=False))
        book = np.sort(rng.standard_normal(levels)).astype(np.float16)
        codes = rng.integers(0, levels, size=L).astype(np.uint8)
        start = len(out)
        if coding == 0:
            out.append(0)
            for delta in np.diff(ids, prepend=-1).tolist():
                while delta >= 0x80:
                    out.append(delta & 0x7F | 0x80)
                    delta >>= 7
                out.append(delta)
        elif coding == 1:
            bits = np.zeros(8 * ((n_tokens + 7) // 8), dtype=np.uint8)
            bits[ids] = 1
            out += bytes([1]) + np.packbits(bits, bitorder="little").tobytes()
        else:
            k = coding[1]
            low = (ids[:, None] >> np.arange(k)) & 1
            low = np.concatenate([low.ravel(), np.zeros(-L * k % 8, dtype=low.dtype)])
            upper = np.zeros(8 * ((L + ((n_tokens - 1) >> k) + 1 + 7) // 8), dtype=np.uint8)
            upper[(ids >> k) + np.arange(L)] = 1
            out += bytes([2, k]) + np.packbits(low.astype(np.uint8), bitorder="little").tobytes()
            out += np.packbits(upper, bitorder="little").tobytes()
        book_at = len(out)
        out += book.astype("<f2").tobytes()
        nib = np.zeros(2 * ((L + 1) // 2), dtype=np.uint8)
        nib[:L] = codes
        out += (nib[0::2] | nib[1::2] << 4).tobytes()
        want.append((2 if isinstance(coding, tuple) else coding, ids, book, codes))
        at.append({"start": start, "ids": start + 1, "book": book_at,  # ids: from the k byte
                   "codes": book_at + 2 * levels})
    return bytes(out), want, at


@pytest.mark.parametrize("chunk", [None, (1, 1), (3000, 40)])
def test_csac_lists_decode_every_id_coding(chunk, monkeypatch: pytest.MonkeyPatch) -> None:
    art = pytest.importorskip("ctxcache.torch.artifacts")
    if chunk is not None:  # lists decoded together: bitmap bits, codes
        monkeypatch.setattr(art, "_CHUNK_BITS", chunk[0])
        monkeypatch.setattr(art, "_CHUNK_CODES", chunk[1])
    rng = np.random.default_rng(5)
    cases = [  # n_tokens (not a multiple of 8), L (odd, <16 and even), id codings
        (203, 17, [0, 1, ("ef", 0), ("ef", 1), ("ef", 2), ("ef", 3), 0, ("ef", 2),
                   ("ef", 5), 1, ("ef", 9), ("ef", 2)]),
        (1001, 5, [("ef", 31), ("ef", 17), ("ef", 26), 0, 1, ("ef", 7), ("ef", 7), 1]),
        (50, 50, [1, 0, ("ef", 0), ("ef", 1)]),
        (4000, 400, [("ef", 3)] * 6 + [1, ("ef", 3), 0, ("ef", 4)] + [("ef", 3)] * 6),
    ]
    for n_tokens, L, codings in cases:
        m = 2
        raw, want, _ = _csac_lists(rng, n_tokens, L, m, len(codings) // m, codings)
        a = art.parse_csa_artifact(raw)
        assert a.ids.dtype == np.int32 and a.scores.dtype == np.float16 and a.q.dtype == np.uint8
        assert a.id_coding.ravel().tolist() == [w[0] for w in want]
        for li, (_, ids, book, codes) in enumerate(want):
            b, j = divmod(li, a.C)
            assert np.array_equal(a.ids[b, j], ids)
            assert np.array_equal(a.book[b, j].view(np.uint16), book.view(np.uint16))
            assert np.array_equal(a.q[b, j], codes)
            assert np.array_equal(a.scores[b, j].view(np.uint16), book[codes].view(np.uint16))


def test_csac_lists_reject_corrupt_lists_in_stream_order() -> None:
    art = pytest.importorskip("ctxcache.torch.artifacts")
    rng = np.random.default_rng(6)
    n_tokens, L = 203, 5  # 5 codebook levels: codes 5..15 are bad
    codings = [("ef", 2), 0, 1, ("ef", 2), ("ef", 3), 0, 1, ("ef", 2), ("ef", 2), 0]
    raw, _, at = _csac_lists(rng, n_tokens, L, 2, 5, codings)
    art.parse_csa_artifact(raw)

    def ef(li, low, upper):  # Elias-Fano list li (k = 2) with these low and upper bytes
        upper_bytes = (L + ((n_tokens - 1) >> 2) + 1 + 7) // 8  # 56 bits
        assert len(low) == 2 and len(upper) <= upper_bytes
        return [(at[li]["ids"] + 1 + i, v) for i, v in
                enumerate(low + upper + [0] * (upper_bytes - len(upper)))]

    nan = np.float16(np.nan).view(np.uint16).tobytes()
    bad = [  # (list, message, (offset, new byte) edits)
        (0, "bad Elias-Fano ids", ef(0, [0, 0], [0x1F])),  # 5 ids 0: not increasing
        (1, "bad list ids \\(zero delta\\)", [(at[1]["ids"], 1), (at[1]["ids"] + 1, 0)]),
        (2, "bad list bitmap", [(at[2]["ids"] + n_tokens // 8, 0xF8)]),  # bits >= n_tokens
        (3, "bad Elias-Fano ids", [(at[3]["ids"] + 4, 0xFF)]),  # upper byte 1: more bits
        (4, "bad Elias-Fano low bits", [(at[4]["ids"], 32)]),
        (5, "bad list id coding", [(at[5]["start"], 7)]),
        (6, "bad score codebook", [(at[6]["book"] + 2, nan[0]), (at[6]["book"] + 3, nan[1])]),
        (7, "bad score code", [(at[7]["codes"] + 1, 0x70)]),
        # Ids 0, 1, 2, 3 and, the last upper bit set, one >= n_tokens.
        (8, "bad Elias-Fano ids", ef(8, [0xE4, 0], [0x0F, 0, 0, 0, 0, 0, 0x80])),
        (9, "bad list ids \\(id >= n_tokens=203\\)", [(at[9]["ids"] + e, 0x7F) for e in range(5)]),
    ]
    for i, (li, message, edits) in enumerate(bad):
        corrupt = bytearray(raw)
        for off, value in edits:
            corrupt[off] = value
        with pytest.raises(ValueError, match=message):
            art.parse_csa_artifact(bytes(corrupt))
        # Neither corrupt later lists nor a truncated last list change the message.
        for _, _, later in bad[i + 1:]:
            for off, value in later:
                corrupt[off] = value
        with pytest.raises(ValueError, match=message):
            art.parse_csa_artifact(bytes(corrupt))
        if li + 1 < len(at):
            with pytest.raises(ValueError, match=message):
                art.parse_csa_artifact(bytes(corrupt[:-1]))
    for cut, message in ((at[8]["start"], "truncated lists"),
                         (at[8]["ids"] + 3, "truncated Elias-Fano ids"),
                         (at[9]["ids"] + 2, "truncated varint"),
                         (at[9]["book"] + 1, "truncated score codebook"),
                         (len(raw) - 1, "truncated scores")):
        with pytest.raises(ValueError, match=message):
            art.parse_csa_artifact(raw[:cut])
