"""The package's shape: no import cycle between its modules, every module
imports on its own, and the public classes' signatures are their __init__'s.

No server needed. The import graph counts every ``import ctxcache...`` of a
module, at the top or inside a function (a lazy import hides a cycle, it does
not remove it), except under ``if TYPE_CHECKING:``.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
from typing import Dict, List, Set

import pytest

import ctxcache

PKG_DIR = os.path.dirname(os.path.abspath(ctxcache.__file__))
# Modules whose optional dependencies may be missing on the test machine.
OPTIONAL = {"torch", "triton", "transformers"}


def _modules() -> Dict[str, str]:
    out = {}
    base = os.path.dirname(PKG_DIR)
    for dirpath, dirnames, filenames in os.walk(PKG_DIR):
        dirnames[:] = sorted(d for d in dirnames if d not in ("v1", "__pycache__"))
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            name = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
            out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
                os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _imports(name: str, path: str) -> Set[str]:
    is_pkg = path.endswith("__init__.py")
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    parts = parts[:len(parts) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in MODULES else base)
            visit(child)

    with open(path, encoding="utf-8") as f:
        visit(ast.parse(f.read()))
    return {m for m in found if m in MODULES and m != name}


def test_the_modules_import_one_another_without_a_cycle() -> None:
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    state: Dict[str, int] = {}  # 1 = on the path, 2 = done
    path: List[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                dfs(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    # The page codec is a leaf below the client and the session.
    assert "ctxcache.client" not in graph["ctxcache.page_codec"]
    assert "ctxcache.client" not in graph["ctxcache.session"]
    assert "ctxcache.cluster" not in graph["ctxcache.client"]


def _optional_missing() -> Set[str]:
    return {m for m in OPTIONAL if importlib.util.find_spec(m) is None}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_on_its_own(module: str) -> None:
    r = subprocess.run([sys.executable, "-c", f"import {module}"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    if r.returncode != 0:
        missing = _optional_missing()
        if any(f"No module named '{m}'" in r.stdout for m in missing):
            pytest.skip(f"{module} needs {sorted(missing)}")
        pytest.fail(f"import {module} failed:\n{r.stdout[-3000:]}")


PUBLIC_CLASSES = sorted(n for n in ctxcache.__all__
                        if inspect.isclass(getattr(ctxcache, n))
                        and getattr(ctxcache, n).__module__.startswith("ctxcache"))


@pytest.mark.parametrize("name", PUBLIC_CLASSES)
def test_public_signatures_are_readable(name: str) -> None:
    cls = getattr(ctxcache, name)
    sig = inspect.signature(cls)
    kinds = [p.kind for p in sig.parameters.values()]
    assert inspect.Parameter.VAR_POSITIONAL not in kinds, f"{name}{sig}"
    if "__init__" in vars(cls) or cls.__new__ is not object.__new__:
        init = inspect.signature(cls.__init__)
        assert list(sig.parameters) == [p for p in init.parameters if p != "self"], \
            f"{name}{sig} is not its __init__{init}"


def test_connect_picks_the_client_by_address() -> None:
    c = ctxcache.connect("127.0.0.1:1", timeout=2.0)
    try:
        assert type(c) is ctxcache.Client
        assert c.timeout == 2.0
    finally:
        c.close()
    rc = ctxcache.connect("etcd://127.0.0.1:1/nowhere", replicas=3)
    try:
        assert isinstance(rc, ctxcache.ClusterClient)
        assert rc.cluster == "nowhere" and rc.replicas == 3
    finally:
        rc.close()
    with pytest.raises(ValueError, match="connect"):
        ctxcache.Client("etcd://127.0.0.1:1/nowhere")
