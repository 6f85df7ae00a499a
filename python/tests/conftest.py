"""Fixtures: a real ctxcached on loopback (no mocks).

The server binary comes from $CTXCACHE_BIN_DIR (default: <repo>/build/bin),
the models from --model-dir / $CTXCACHE_MODEL_DIR (default:
<repo>/tests/data/golden, tiny HF models; the tests use llama3: 2 layers,
4 q / 2 kv heads, head_dim 32). Like tests/service/server_process.h, the
server gets --listen 127.0.0.1:0 and --port-file, and the fixture waits for
the port file, then for health SERVING.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator, List, Optional

import numpy as np
import pytest

import ctxcache

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--model-dir", default=None,
                     help="ctxcached --model-dir (default $CTXCACHE_MODEL_DIR or "
                          "<repo>/tests/data/golden)")
    parser.addoption("--bin-dir", default=None,
                     help="folder holding ctxcached "
                          "(default $CTXCACHE_BIN_DIR or <repo>/build/bin)")


def _bin_dir(config: pytest.Config) -> str:
    return (config.getoption("--bin-dir") or os.environ.get("CTXCACHE_BIN_DIR")
            or os.path.join(REPO, "build", "bin"))


def _model_dir(config: pytest.Config) -> str:
    return (config.getoption("--model-dir") or os.environ.get("CTXCACHE_MODEL_DIR")
            or os.path.join(REPO, "tests", "data", "golden"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """ctxcached as a child process with its own data dir and log file."""

    def __init__(self, binary: str, model_dir: str, workdir: str, extra: Optional[List[str]] = None,
                 listen: str = "127.0.0.1:0") -> None:
        self.binary = binary
        self.workdir = workdir
        self.data_dir = os.path.join(workdir, "data")
        self.port_file = os.path.join(workdir, "ports")
        self.log_path = os.path.join(workdir, "ctxcached.log")
        self.args = [binary, "--data-dir", self.data_dir, "--port-file", self.port_file,
                     "--listen", listen, "--metrics-listen", "", "--model-dir", model_dir,
                     "--default-model", "llama3",
                     # the golden llama3 declares 256 positions; tests use longer contexts
                     "--max-context-tokens", "65536", *(extra or [])]
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        # Client options for the readiness check (e.g. tls_ca for a TLS server).
        self.client_kwargs: dict = {}

    def start(self, timeout: float = 30.0) -> "Server":
        if os.path.exists(self.port_file):
            os.remove(self.port_file)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ctxcached exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with open(self.port_file) as f:
                    fields = f.read().split()
                if fields:
                    self.port = int(fields[0])
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.02)
        else:
            self.stop()
            raise RuntimeError(f"ctxcached wrote no port file in {timeout} s:\n{self.log()}")
        with ctxcache.Client(self.address, timeout=5, **self.client_kwargs) as c:
            c.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM (then SIGKILL after timeout); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        code = self.proc.returncode
        self.proc = None
        return code


@pytest.fixture(scope="session")
def ctxcached_bin(pytestconfig: pytest.Config) -> str:
    bin_dir = _bin_dir(pytestconfig)
    path = os.path.join(bin_dir, "ctxcached")
    explicit = bool(pytestconfig.getoption("--bin-dir") or os.environ.get("CTXCACHE_BIN_DIR"))
    # The binary may be briefly missing while it is relinked: wait a little.
    deadline = time.monotonic() + (60 if explicit else 2)
    while not os.access(path, os.X_OK) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not os.access(path, os.X_OK):
        if explicit:
            pytest.fail(f"{path} not found: build the project first (cmake --build build)")
        pytest.skip(f"{path} not found (set CTXCACHE_BIN_DIR to the folder holding ctxcached)")
    return path


@pytest.fixture(scope="session")
def model_dir(pytestconfig: pytest.Config) -> str:
    d = _model_dir(pytestconfig)
    if not os.path.isdir(os.path.join(d, "llama3")):
        pytest.fail(f"no llama3 model under {d} (pass --model-dir or set CTXCACHE_MODEL_DIR)")
    return d


@pytest.fixture(scope="session")
def tmp_root() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="ctxcache-pytest-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def make_server(ctxcached_bin: str, model_dir: str, tmp_root: str) -> Iterator:
    """Factory: make_server(extra_flags, listen=...) -> a started Server (stopped at the end)."""
    servers: List[Server] = []

    def make(extra: Optional[List[str]] = None, listen: str = "127.0.0.1:0",
             start: bool = True) -> Server:
        workdir = tempfile.mkdtemp(prefix="server-", dir=tmp_root)
        s = Server(ctxcached_bin, model_dir, workdir, extra, listen)
        servers.append(s)
        return s.start() if start else s

    yield make
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def server(make_server) -> Server:
    """The shared server: default indexes csa and tactic."""
    return make_server(["--default-indexes", "csa,tactic"])


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[ctxcache.Client]:
    with ctxcache.Client(server.address, timeout=60) as c:
        yield c


def session_queries(rng: np.random.Generator, n_q: int, d: int, i: int) -> np.ndarray:
    """Step i's [n_q, d] float32 queries for selection cross-checks: random
    scale; every third step half the sub-queries zero (skipped), every third
    fp16-rounded (coarse values: many exactly tied sums)."""
    q = rng.standard_normal((n_q, d)) * 10.0 ** rng.uniform(-1.5, 1.5)
    if i % 3 == 1:
        q[:, : d // 2] = 0
    if i % 3 == 2:
        q = q.astype(np.float16)
    return q.astype(np.float32)


def assert_library_steps_match_server(heads, r, group: int, where: str) -> None:
    """A layer-step of the C++ session core through the native library (one
    ctxcache.native.HeadStep per kv head) equals the server session's step
    r: per-q-head tokens and fetched pages."""
    for qh in range(len(r.selections)):
        got = heads[qh // group].per_q_head[qh % group]
        assert got.tolist() == r.selections[qh].tolist(), f"{where} q head {qh}"
    assert len(heads) == len(r.heads), where
    for h, head in enumerate(r.heads):
        assert heads[h].pages.tolist() == head.blocks, f"{where} kv head {h}"


def random_tokens(n: int, seed: int, vocab: int = 512) -> List[int]:
    """Like tests/service/service_test.cc: random ids with repetitive structure."""
    rng = np.random.default_rng(seed)
    t = rng.integers(1, vocab, n).tolist()
    for i in range(n):
        if i % 97 >= 40:
            t[i] = t[i % 40]
    return t


@pytest.fixture(scope="session")
def built(client: ctxcache.Client) -> ctxcache.pb.ContextInfo:
    """A 300-token context (19 pages, the last one of 12 tokens) with csa and tactic."""
    done = client.build(tokens=random_tokens(300, 1), name="shared", labels={"suite": "py"})
    return done.context
