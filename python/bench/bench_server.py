"""A ctxcached of the benches on loopback: started on an ephemeral port,
waited for through its port file, stopped with SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, Sequence, Tuple

__all__ = ["start_ctxcached", "stop_ctxcached"]


def start_ctxcached(bin_dir: str, work: str, args: Sequence[str] = (),
                    timeout_s: float = 60.0) -> Tuple[Any, str]:
    """Starts ``bin_dir/ctxcached`` with its data in ``work/data``, its log in
    ``work/ctxcached.log`` and extra ``args``; returns (process, "127.0.0.1:PORT")
    once its port file is written. RuntimeError when it exits first or writes
    no port file within ``timeout_s`` (then it is killed)."""
    ports = os.path.join(work, "ports")
    if os.path.exists(ports):
        os.remove(ports)
    logf = open(os.path.join(work, "ctxcached.log"), "ab")
    proc = subprocess.Popen(
        [os.path.join(bin_dir, "ctxcached"), "--data-dir", os.path.join(work, "data"),
         "--listen", "127.0.0.1:0", "--port-file", ports, "--metrics-listen", "", *args],
        stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ctxcached exited with {proc.returncode} (log {work})")
        if os.path.exists(ports) and os.path.getsize(ports) > 0:
            return proc, "127.0.0.1:" + open(ports).read().split()[0]
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"ctxcached wrote no port file in {timeout_s} s")


def stop_ctxcached(proc: Any, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; a no-op for None or an
    exited process."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
