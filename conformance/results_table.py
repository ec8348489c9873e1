#!/usr/bin/env python3
"""Print the RESULTS.md table from run.py --json files, one column per server.

Usage: results_table.py prosody=/tmp/conformance-prosody/results.json [presenced=FILE ...]
A server given without a file (e.g. `presenced=`) gets an empty column to fill in later.
Rows follow the order of the first file; a result is pass / FAIL / skip.
"""
import json
import sys


def main(argv):
    cols = []
    for arg in argv:
        name, _, path = arg.partition("=")
        results = {}
        if path:
            with open(path) as fh:
                for r in json.load(fh)["results"]:
                    results[r["scenario"]] = r
        cols.append((name, results))
    rows = [(r["scenario"], r["rfc"], r["file"]) for r in next(iter(c for _, c in cols if c)).values()]
    print("| scenario | RFC section | " + " | ".join(n for n, _ in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, rfc, _ in rows:
        cells = []
        for _, res in cols:
            r = res.get(name)
            cells.append("" if r is None else {"pass": "pass", "fail": "**FAIL**", "error": "**ERROR**", "skip": "skip"}[r["status"]])
        print(f"| {name} | {rfc} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
