#!/usr/bin/env python3
"""ctest dockerignore: .dockerignore keeps a built checkout's outputs out of
deploy/Dockerfile's build context, and keeps every tracked file in it.

Docker's rules, as far as .dockerignore uses them: a pattern is a path
relative to the context root in Go filepath.Match syntax plus `**` (any
number of directories); it excludes the paths it matches and everything
under them; a later `!pattern` re-includes. Exit 77 outside a git checkout.

Usage: dockerignore_test.py SOURCE_DIR
"""
from __future__ import annotations

import re
import subprocess
import sys
from typing import List, Tuple

# What a built checkout holds that must not be sent (scripts/test.sh,
# tests/python/run.sh, scripts/fuzz.sh, CMake's model unpacking, pytest).
MUST_EXCLUDE = [
    ".git/HEAD", "build/CMakeCache.txt", "build/bin/ctxcached", "build-asan/CMakeCache.txt",
    "build-fuzz/bin/fuzz_page", "python/build/lib/ctxcache/client.py",
    "python/ctxcache.egg-info/PKG-INFO", "python/ctxcache/v1/storage_pb2.py",
    "python/ctxcache/_health_pb2.py", "python/ctxcache/__pycache__/client.cpython-311.pyc",
    "models/ctxcache-ref/model.safetensors", "ctxcache-data/CURRENT", ".pack/x.tar.xz",
]


def to_regex(pattern: str) -> "re.Pattern[str]":
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out, i = out + "(?:/|)", i + 1  # "a/**/b" also matches "a/b"
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?$")  # a directory excludes what it holds


def read_rules(path: str) -> List[Tuple[bool, "re.Pattern[str]"]]:
    rules: List[Tuple[bool, "re.Pattern[str]"]] = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except FileNotFoundError:
        return rules  # no .dockerignore: the whole checkout is sent
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, to_regex(line.lstrip("!").strip("/"))))
    return rules


def excluded(rules, path: str) -> bool:
    out = False
    for negate, rx in rules:
        if rx.match(path):
            out = not negate
    return out


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else "."
    try:
        tracked = subprocess.run(["git", "-C", src, "ls-files", "-z"], check=True,
                                 capture_output=True).stdout.decode().split("\0")
    except (subprocess.CalledProcessError, FileNotFoundError):
        print("dockerignore_test: not a git checkout; skipped")
        return 77
    rules = read_rules(f"{src}/.dockerignore")
    failures = [f"not excluded: {p}" for p in MUST_EXCLUDE if not excluded(rules, p)]
    failures += [f"tracked file excluded: {p}" for p in tracked if p and excluded(rules, p)]
    for f in failures:
        print(f"dockerignore_test: {f}")
    print(f"dockerignore_test: {len(MUST_EXCLUDE)} build outputs, {len(tracked) - 1} tracked "
          f"files, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
