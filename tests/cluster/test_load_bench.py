"""The cluster load generator runs (ctest cluster_load): ctxcache-cluster-load
through bench/cluster/cluster_scaling.py against 1 and 2 nodes for 1 s each
reads pages through the C++ routing client with no failed call, and the
pages are served by the nodes (their page-read counters move)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.load
def test_load_generator_reads_from_one_and_two_nodes(bin_dir: str, model_dir: str,
                                                     tmp_path) -> None:
    binary = os.path.join(bin_dir, "ctxcache-cluster-load")
    if not os.path.exists(binary):
        pytest.fail(f"{binary} not built (cmake -DCTXCACHE_BUILD_BENCH=ON, target "
                    "ctxcache-cluster-load)")
    out = tmp_path / "scaling.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "cluster",
                                                     "cluster_scaling.py"),
                        "--nodes", "1,2", "--seconds", "1", "--warmup-s", "0.2",
                        "--contexts", "4", "--tokens", "512", "--pages", "16",
                        "--concurrency", "4", "--bin-dir", bin_dir, "--model-dir", model_dir,
                        "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [x["live_nodes"] for x in res["runs"]] == [1, 2]
    assert [x["replicas"] for x in res["runs"]] == [1, 2]
    for run in res["runs"]:
        assert run["errors"] == 0, run["first_error"]
        assert run["pages"] > 0 and run["pages"] == run["calls"] * 16
        assert run["pages_per_s"] > 0 and run["p99_ms"] >= run["p50_ms"] > 0
        served = [n["page_bytes_read"] for n in run["nodes"].values()]
        assert len(served) == run["live_nodes"] and sum(served) > 0
    assert res["ratios"][0] == 1.0
