"""pytest options for the cluster tests (tests/cluster/run.sh passes them)."""
from __future__ import annotations

import os

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bin-dir", default=os.environ.get("CTXCACHE_BIN_DIR",
                                                         os.path.join(REPO, "build", "bin")))
    parser.addoption("--model-dir", default=os.environ.get(
        "CTXCACHE_MODEL_DIR", os.path.join(REPO, "tests", "data", "golden")))


@pytest.fixture(scope="session")
def bin_dir(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--bin-dir")


@pytest.fixture(scope="session")
def model_dir(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--model-dir")
