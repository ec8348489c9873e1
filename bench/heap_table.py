#!/usr/bin/env python3
"""Where an idle session's heap bytes are: the table of BENCHMARKS.md from a heap profile
written by tests/heap_profile.rs (dhat's JSON, gzipped, and the test's profile.json).

    heap_table.py DIR      (DIR holds dhat-heap.json.gz and profile.json)
    heap_table.py DIR LO-HI

Each of dhat's allocation sites counts the bytes still allocated when the profile ended
("eb"): with every profiled session idle and connected, what those sessions hold. Sites are
grouped by the code that allocated (the innermost frame outside the standard library and
the containers of hashbrown) and by the innermost frame of presenced's own code that led
there; each row is bytes and blocks per profiled session.

With LO-HI, only the sites whose live blocks are LO to HI bytes long on average, sorted by
blocks rather than bytes: the long-lived objects of one of the allocator's size classes
(17-32 is jemalloc's 32-byte class), which keep its slabs from being given back.
"""
import gzip
import json
import os
import re
import sys

# Crates whose frames are the containers and glue an allocation passes through, not the
# code that decided to allocate.
GLUE = {"alloc", "core", "std", "hashbrown", "dhat", "backtrace", "__rust_alloc",
        "__rustc", "smallvec", "bytes"}
ROWS = 20


def short(frame):
    """'0x…: name (file:line:col)' -> ('crate', 'short::name', 'file:line')."""
    m = re.match(r"0x[0-9a-f]+: (.*) \((.*?)(?::(\d+):\d+)?\)$", frame)
    if not m:
        return ("?", frame, "")
    name, file, line = m.group(1), m.group(2), m.group(3) or "0"
    if name.startswith("<"):
        # <Type as Trait>::method -> Type::method
        depth, i = 0, 0
        for i, c in enumerate(name):
            depth += c == "<"
            depth -= c == ">"
            if depth == 0:
                break
        inner, rest = name[1:i], name[i + 1:]
        # The type, unless it is a primitive or a parameter (`<u8 as
        # alloc::slice::hack::ConvertVec>`): then the trait says whose code it is.
        ty, _, trait = inner.partition(" as ")
        inner = ty if "::" in ty or not trait else trait
        name = inner + rest
    # Drop generic arguments and closure markers.
    out, depth = [], 0
    for c in name:
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif depth == 0:
            out.append(c)
    name = "".join(out).replace("{{closure}}", "{closure}")
    segs = [s for s in name.split("::") if s]
    crate = segs[0].lstrip("&*") if segs else "?"
    # The standard library's own files name it whatever the symbol looks like
    # (`<u8 as <[_]>::to_vec_in::ConvertVec>::to_vec`).
    top = file.split("/", 1)[0]
    if top in ("alloc", "core", "std"):
        crate = top
    return (crate, "::".join(segs[-3:]), f"{file}:{line}")


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        sys.exit(2)
    d = sys.argv[1]
    lo, hi = 0, float("inf")
    if len(sys.argv) == 3:
        lo, hi = (int(x) for x in sys.argv[2].split("-"))
    with open(os.path.join(d, "profile.json")) as f:
        meta = json.load(f)
    with gzip.open(os.path.join(d, "dhat-heap.json.gz"), "rt") as f:
        prof = json.load(f)
    n = meta["sessions"]
    frames = [short(s) for s in prof["ftbl"]]
    groups, crates = {}, {}
    total_b = total_k = 0
    for pp in prof["pps"]:
        eb, ebk = pp.get("eb") or 0, pp.get("ebk") or 0
        if not eb or not lo <= eb / ebk <= hi:
            continue
        total_b += eb
        total_k += ebk
        fs = [frames[i] for i in pp["fs"] if prof["ftbl"][i] != "[root]"]
        site = next((f for f in fs if f[0] not in GLUE), fs[0] if fs else ("?", "?", ""))
        ours = next((f for f in fs if f[0] == "presenced"), None)
        key = (site[1], ours[1] + " (" + ours[2] + ")" if ours else "–")
        b, k = groups.get(key, (0, 0))
        groups[key] = (b + eb, k + ebk)
        cb, ck = crates.get(site[0], (0, 0))
        crates[site[0]] = (cb + eb, ck + ebk)
    contacts = meta.get("contacts", 0)
    sizes = f" of {lo} to {hi} bytes (each site's mean)" if len(sys.argv) == 3 else ""
    print(f"{n} idle sessions profiled, {contacts} mutual contacts each, all online "
          f"({meta['build']} build, after {meta['warm']} warm-up "
          f"sessions): {total_b / n:,.0f} B in {total_k / n:.1f} blocks{sizes} per session "
          "still allocated when the profile ended.")
    print()
    print("| allocated in | reached from presenced's | B per session | blocks per session |")
    print("|---|---|---:|---:|")
    if sizes:
        rows = sorted(groups.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    else:
        rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    for (site, ours), (b, k) in rows[:ROWS]:
        print(f"| `{site}` | `{ours}` | {b / n:,.0f} | {k / n:.2f} |")
    rest = rows[ROWS:]
    if rest:
        rb = sum(b for _, (b, _k) in rest)
        rk = sum(k for _, (_b, k) in rest)
        print(f"| {len(rest)} other sites | | {rb / n:,.0f} | {rk / n:.2f} |")
    print()
    print("By the crate that allocated: " + ", ".join(
        f"{c} {b / n:,.0f} B ({100 * b / total_b:.0f} %)"
        for c, (b, _k) in sorted(crates.items(), key=lambda kv: -kv[1][0]) if b / n >= 1)
          + ".")


if __name__ == "__main__":
    main()
