#!/usr/bin/env python3
"""Which of jemalloc's size classes hold the free room inside live pages.

    bench/jemalloc_bins.py STATS SESSIONS [ROWS]

STATS is the text `malloc_stats_print` writes (jemalloc's own report; the first "bins:"
table is the one merged over arenas). SESSIONS divides the figures per idle session. Prints
the ROWS (default 6) size classes whose slabs hold the most free room — the slabs' pages
less the bytes live in them — and the sum over every class, beside the active − allocated
the same report gives.
"""
import re
import sys

PAGE = 4096


def bins(text):
    """(size, live bytes, live regions, slabs, regions per slab, pages per slab, nmalloc)
    per small size class of the first bins table. A data row's words line up with the
    header's after its "bins:" (each "(#/sec)" heads the rate after a counter)."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.lstrip().startswith("bins:"))
    head = lines[start].split()[1:]
    at = {name: head.index(name) for name in
          ("size", "allocated", "nmalloc", "curregs", "curslabs", "regs", "pgs")}
    rows = []
    for line in lines[start + 1:]:
        w = line.split()
        if not w or not re.fullmatch(r"\d+", w[0]):
            break
        get = lambda name: int(w[at[name]])
        rows.append((get("size"), get("allocated"), get("curregs"), get("curslabs"),
                     get("regs"), get("pgs"), get("nmalloc")))
    return rows


def active_allocated(text):
    m = re.search(r"Allocated: (\d+), active: (\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def main():
    path, sessions = sys.argv[1], int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    text = open(path).read()
    rows = []
    for size, live, regs_live, slabs, regs, pgs, nmalloc in bins(text):
        room = slabs * pgs * PAGE - live
        rows.append((room, size, live, regs_live, slabs, regs, pgs, nmalloc))
    rows.sort(reverse=True)
    per = lambda b: b / 1024 / sessions
    print(f"Per idle session ({sessions:,} sessions), from jemalloc's own report\n")
    print("| size class (B) | live objects | slabs (pages each) | slabs' use | free room in its "
          "slabs (kB) | allocations since start |")
    print("|---:|---:|---:|---:|---:|---:|")
    for room, size, live, regs_live, slabs, regs, pgs, nmalloc in rows[:n]:
        use = regs_live / (slabs * regs) if slabs else 0
        print(f"| {size:,} | {regs_live / sessions:.1f} | {slabs:,} ({pgs}) | {use:.1%} | "
              f"{per(room):.2f} | {nmalloc / sessions:,.0f} |")
    total = sum(r[0] for r in rows)
    print(f"\nEvery small class: {per(total):.2f} kB of free room in slabs per session", end="")
    aa = active_allocated(text)
    if aa:
        print(f"; active − allocated over the whole heap {per(aa[1] - aa[0]):.2f} kB", end="")
    print(".")


if __name__ == "__main__":
    main()
