#!/usr/bin/env python3
"""Result files are a cited manifest (bench/results/MANIFEST):
- every MANIFEST entry is a tracked file, listed once, under a '$ ' command;
- every file under bench/results/ and training/results/ is in MANIFEST;
- every result path that a doc, script or source file cites (a file, a glob
  such as gda-*.json or e2e-{ref,llama8b}.json, or a folder ending in '/')
  names at least one listed file;
- every listed file is cited (a file no doc cites is deleted; git keeps it).
docs/history.md may name results that were deleted and is not read.
Exit 77 (ctest skip) outside a git checkout.
  results_manifest_test.py REPO_ROOT
"""
import os
import re
import subprocess
import sys

ROOTS = ("bench/results/", "training/results/")
MANIFEST = "bench/results/MANIFEST"
NOT_READ = ("docs/history.md", "tests/repo/results_manifest_test.py")
CITE = re.compile(r"(?:bench|training)/results/[A-Za-z0-9_.{},*/-]*")
# A path broken after a '/' at the end of a line continues on the next one.
WRAPPED = re.compile(r"((?:bench|training)/results/[A-Za-z0-9_.{},*/-]*/)\n[ \t>#/*`]*")


def tracked(root):
    r = subprocess.run(["git", "-C", root, "ls-files"], stdout=subprocess.PIPE, text=True)
    return r.stdout.split() if r.returncode == 0 else None


def read_manifest(path, errors):
    entries, command = [], None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            if line.startswith("$ "):
                command = line[2:].strip()
            elif line.startswith("  "):
                if command is None:
                    errors.append(f"{MANIFEST}:{n}: a continuation line before any command")
            elif command is None:
                errors.append(f"{MANIFEST}:{n}: {line} has no '$ ' command above it")
            else:
                entries.append((n, line))
    return entries


def expand(cite):
    m = re.search(r"\{([^{}]*)\}", cite)
    if not m:
        return [cite]
    return [x for alt in m.group(1).split(",")
            for x in expand(cite[:m.start()] + alt + cite[m.end():])]


def matches(cite, path):
    if cite.endswith("/"):
        return path.startswith(cite) and "/" not in path[len(cite):]
    pattern = "".join("[^/]*" if ch == "*" else re.escape(ch) for ch in cite)
    return re.fullmatch(pattern, path) is not None


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    files = tracked(root)
    if files is None:
        print(f"results_manifest_test: {root} is not a git work tree; skipped")
        return 77
    errors = []
    results = sorted(f for f in files if f.startswith(ROOTS) and f != MANIFEST)
    entries = read_manifest(os.path.join(root, MANIFEST), errors)
    listed = set()
    for n, path in entries:
        if path in listed:
            errors.append(f"{MANIFEST}:{n}: {path} is listed twice")
        listed.add(path)
        if path not in results:
            errors.append(f"{MANIFEST}:{n}: {path} is not a tracked result file")
    for path in results:
        if path not in listed:
            errors.append(f"{path} is not in {MANIFEST}: list it with its command, or delete it")

    cited = set()
    for doc in files:
        if doc.startswith(ROOTS) or doc in NOT_READ:
            continue
        try:
            with open(os.path.join(root, doc), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        text = WRAPPED.sub(r"\1", text)
        for raw in CITE.findall(text):
            cite = raw.rstrip(".,")
            for c in expand(cite):
                if c == MANIFEST:
                    continue
                hits = [p for p in results if matches(c, p)]
                # A folder counts as named while anything lies below it.
                if not hits and not any(p.startswith(c) for p in results):
                    errors.append(f"{doc}: cites {c}, which names no result file")
                cited.update(hits)
    for path in results:
        if path not in cited:
            errors.append(f"{path} is cited by no doc: cite it where its numbers are, or delete it")
    for e in errors:
        print("FAIL:", e, file=sys.stderr)
    print(f"{len(results)} result files, {len(listed)} listed, {len(cited)} cited; "
          f"{len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
