#!/usr/bin/env python3
"""Regenerate, or check, every generated table in the benchmark documents.

    tables.py            rewrite each generated block from its committed raw results
    tables.py --check    exit 1, naming the block, when any block differs from what its
                         command prints now (tests/run.sh runs this)

A generated block in BENCHMARKS.md or BENCHMARKS-ARCHIVE.md is

    <!-- generated: bench/ratio.py bench/results/2026-12-06-peers-n1000-k10/run* -->
    ...what the command printed...
    <!-- end generated -->

The command is one of this directory's scripts with its arguments, run by python3 from the
repository's root; an argument with a wildcard is expanded (sorted) as a shell would. No
table in these files is typed by hand: a figure someone wants to quote comes from a block.
"""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["BENCHMARKS.md", "BENCHMARKS-ARCHIVE.md"]
BLOCK = re.compile(
    r"(<!-- generated: (?P<cmd>[^\n]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
SCRIPT = re.compile(r"bench/[a-z_]+\.py")


def expand(cmd):
    """The argv for a block's command: its script, then its arguments with wildcards
    expanded against the repository."""
    words = cmd.split()
    if not words or not SCRIPT.fullmatch(words[0]):
        raise ValueError(f"not a bench script: {cmd!r}")
    argv = [sys.executable, words[0]]
    for w in words[1:]:
        if any(c in w for c in "*?["):
            hits = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, w)))
            if not hits:
                raise ValueError(f"{w!r} matches nothing")
            argv += hits
        else:
            argv.append(w)
    return argv


def output(cmd):
    run = subprocess.run(expand(cmd), cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {run.stderr.strip()}")
    out = run.stdout
    return out if out.endswith("\n") else out + "\n"


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    blocks = 0
    for doc in DOCS:
        path = os.path.join(ROOT, doc)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()

        def redo(m):
            nonlocal blocks
            blocks += 1
            fresh = output(m.group("cmd"))
            if fresh != m.group("body"):
                line = text.count("\n", 0, m.start()) + 1
                stale.append(f"{doc}:{line}: {m.group('cmd')}")
            return m.group(1) + fresh + m.group(4)

        new = BLOCK.sub(redo, text)
        if not check and new != text:
            with open(path, "w") as f:
                f.write(new)
    if check:
        for s in stale:
            print(f"stale generated table: {s}", file=sys.stderr)
        print(f"{blocks} generated tables, {len(stale)} stale")
        sys.exit(1 if stale else 0)
    print(f"{blocks} generated tables, {len(stale)} rewritten")


if __name__ == "__main__":
    main()
