"""A real etcd and N real ctxcached processes on loopback (no mocks), for the
cluster tests and the cluster bench.

etcd comes from Debian's etcd-server package (/usr/bin/etcd), with a temp
data dir and random free ports; each ctxcached gets its own data dir, a fixed
free port (cluster nodes advertise their listen address) and --cluster
etcd://127.0.0.1:<port>/<name>.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _ephemeral_range() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


_handed_out: set = set()


def free_port() -> int:
    """A loopback port that is free now, chosen outside the kernel's ephemeral
    range: ports from bind(0) come from that range, so every outgoing connection
    of a concurrently running test could take one between this check and the
    server's own bind (CI saw etcd exit with "address already in use"). Still a
    check-then-use race against other tests that pick ports this way; Etcd and
    Node retry their first start on a fresh port when the bind fails."""
    eph = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, 65536)
        if port in eph or port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Attempts for a first start whose bind lost the race above.
_BIND_ATTEMPTS = 5


def _log_since(path: str, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def _log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _start_retrying_bind(start_once, log_path: str, lost_bind_marker: str, new_ports,
                         attempts: int = _BIND_ATTEMPTS):
    """Calls start_once() (which raises RuntimeError when the process exits);
    when it fails and the process's log since this attempt holds
    lost_bind_marker, calls new_ports() and tries again, up to `attempts`."""
    for attempt in range(attempts):
        offset = _log_size(log_path)
        try:
            return start_once()
        except RuntimeError:
            lost_bind = lost_bind_marker in _log_since(log_path, offset)
            if not lost_bind or attempt + 1 == attempts:
                raise
            new_ports()
    raise AssertionError("unreachable")


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


class Etcd:
    def __init__(self, workdir: str, binary: str = "") -> None:
        # $CTXCACHE_ETCD_BIN overrides Debian's /usr/bin/etcd.
        self.binary = binary or os.environ.get("CTXCACHE_ETCD_BIN", "/usr/bin/etcd")
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(workdir, "etcd.log")
        # Command prefix (e.g. ["taskset", "-c", "6-15"]); default none.
        self.prefix: List[str] = []

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> "Etcd":
        """Starts etcd and waits for /health; on a first start whose bind fails
        ("address already in use") it retries on fresh ports."""
        def new_ports() -> None:
            shutil.rmtree(os.path.join(self.workdir, "etcd"), ignore_errors=True)
            self.client_port, self.peer_port = free_port(), free_port()
        return _start_retrying_bind(self._start_once, self.log_path, "address already in use",
                                    new_ports)

    def _start_once(self) -> "Etcd":
        url_c = f"http://127.0.0.1:{self.client_port}"
        url_p = f"http://127.0.0.1:{self.peer_port}"
        args = [*self.prefix, self.binary, "--name", "test",
                "--data-dir", os.path.join(self.workdir, "etcd"),
                "--listen-client-urls", url_c, "--advertise-client-urls", url_c,
                "--listen-peer-urls", url_p, "--initial-advertise-peer-urls", url_p,
                "--initial-cluster", f"test={url_p}", "--log-level", "warn"]
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(url_c + "/health", timeout=1) as r:
                    return b"true" in r.read()
            except OSError:
                return False
        wait_for(healthy, 30, "etcd health")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Node:
    def __init__(self, name: str, workdir: str, cluster_uri: str, bin_dir: str, model_dir: str,
                 extra: Optional[List[str]] = None,
                 client_kwargs: Optional[dict] = None) -> None:
        self.name = name
        # Client options for the readiness check (e.g. tls_ca for TLS nodes).
        self.client_kwargs = dict(client_kwargs or {})
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.log_path = os.path.join(workdir, "ctxcached.log")
        # ctxcached writes it after both of its ports are bound.
        self.port_file = os.path.join(workdir, "ports")
        self.args = [os.path.join(bin_dir, "ctxcached"),
                     "--data-dir", os.path.join(workdir, "data"), "--port-file", self.port_file,
                     "--listen", self.address, "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
                     "--model-dir", model_dir, "--default-model", "llama3",
                     "--max-context-tokens", "65536", "--cluster", cluster_uri,
                     "--node-id", name, *(extra or [])]
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 30.0) -> "Node":
        """Starts ctxcached and waits for SERVING. A first start whose bind
        fails retries on fresh ports; a restart keeps its address."""
        return _start_retrying_bind(lambda: self._start_once(timeout), self.log_path,
                                    "cannot listen on",
                                    lambda: self._set_ports(free_port(), free_port()),
                                    attempts=_BIND_ATTEMPTS if self.proc is None else 1)

    def _set_ports(self, port: int, metrics_port: int) -> None:
        old = [f"127.0.0.1:{self.port}", f"127.0.0.1:{self.metrics_port}"]
        self.port, self.metrics_port = port, metrics_port
        self.address = f"127.0.0.1:{self.port}"
        new = [self.address, f"127.0.0.1:{self.metrics_port}"]
        self.args = [new[old.index(a)] if a in old else a for a in self.args]

    def _start_once(self, timeout: float) -> "Node":
        if os.path.exists(self.port_file):
            os.remove(self.port_file)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        # Wait for the port file first (not a connect: another process could be
        # listening on a port this one failed to bind); a gRPC channel that
        # failed to connect backs off for seconds before it tries again.
        def listening() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ctxcached {self.name} exited ({self.proc.returncode}):\n"
                                   + self.log_tail())
            return os.path.exists(self.port_file)
        wait_for(listening, timeout, f"ctxcached {self.name} listening", interval=0.05)
        import ctxcache
        with ctxcache.Client(self.address, timeout=5.0, **self.client_kwargs) as c:
            wait_for(lambda: c.health() == "SERVING", timeout, f"{self.name} SERVING")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> Dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as r:
            text = r.read().decode()
        out: Dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            k, v = line.rsplit(" ", 1)
            try:
                out[k] = float(v)
            except ValueError:
                pass
        return out

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class Cluster:
    """etcd + n nodes named n0..n{n-1}; close() stops everything."""

    def __init__(self, n: int, bin_dir: str, model_dir: str, name: str = "test",
                 extra: Optional[List[str]] = None,
                 client_kwargs: Optional[dict] = None) -> None:
        self.client_kwargs = dict(client_kwargs or {})
        self.tmp = tempfile.mkdtemp(prefix="ctxcache-cluster-")
        self.bin_dir = bin_dir
        self.model_dir = model_dir
        self.name = name
        self.extra = extra or []
        self.etcd = Etcd(self.tmp).start()
        self.uri = f"etcd://{self.etcd.endpoint}/{name}"
        self.nodes: List[Node] = []
        for i in range(n):
            self.add_node()

    def add_node(self, extra: Optional[List[str]] = None) -> Node:
        i = len(self.nodes)
        node = Node(f"n{i}", os.path.join(self.tmp, f"n{i}"), self.uri, self.bin_dir,
                    self.model_dir, [*self.extra, *(extra or [])], self.client_kwargs)
        self.nodes.append(node)
        return node.start()

    def live(self) -> List[Node]:
        return [n for n in self.nodes if n.alive()]

    def close(self, keep: bool = False) -> None:
        for n in self.nodes:
            n.stop()
        self.etcd.stop()
        if not keep:
            shutil.rmtree(self.tmp, ignore_errors=True)
