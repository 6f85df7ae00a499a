"""The harness itself (ctest cluster): a first start whose port was taken
between free_port() and the process's bind (CI saw etcd exit with "address
already in use" under ctest -j2) comes up on fresh ports, and a node is
reported up only once its own port file appears, not because something else
accepts on its port."""
from __future__ import annotations

import os
import socket
import tempfile

import ctxcache
from cluster_harness import Etcd, Node, _ephemeral_range, free_port


def _held_listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_free_ports_avoid_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert not any(p in _ephemeral_range() for p in ports)


def test_first_starts_move_off_a_taken_port(bin_dir: str, model_dir: str) -> None:
    work = tempfile.mkdtemp(prefix="ctxcache-harness-")
    held = _held_listener()
    taken = held.getsockname()[1]
    etcd = Etcd(work)
    etcd.client_port = taken
    node = None
    try:
        etcd.start()
        assert etcd.client_port != taken
        assert "address already in use" in open(etcd.log_path, errors="replace").read()
        node = Node("n0", os.path.join(work, "n0"), f"etcd://{etcd.endpoint}/harness",
                    bin_dir, model_dir)
        node._set_ports(taken, node.metrics_port)
        assert f"127.0.0.1:{taken}" in node.args
        node.start()
        assert node.port != taken and node.address in node.args
        assert "cannot listen on" in open(node.log_path, errors="replace").read()
        with ctxcache.Client(node.address, timeout=5.0) as c:
            assert c.health() == "SERVING"
    finally:
        held.close()
        if node is not None:
            node.stop()
        etcd.stop()
