#!/usr/bin/env python3
"""Summarises Nsight Compute's per-kernel durations of the DiT forwards one run profiled
(scripts/gpu-dit.sh --full profiles two: the timed one and the host-issue one).

Input: `ncu --csv --print-units base --metrics gpu__time_duration.sum ...` output (the driven
program's own stdout lines are mixed in and skipped). Prints the total kernel time, the top kernels
by total time (summed per name), and one block's launches in order (from the launch after one self-attention to
the next; the attention kernel is the name with the largest total time, twice per block).
"""
import csv
import sys
from collections import Counter, defaultdict


def main(path):
    rows, header = [], None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if header is None:
                if r and r[0] == "ID" and "Kernel Name" in r:
                    header = r
                continue
            if len(r) == len(header):
                rows.append(dict(zip(header, r)))
    rows = [r for r in rows if r["Metric Name"] == "gpu__time_duration.sum"]
    if not rows:
        sys.exit("no gpu__time_duration.sum rows in " + path)
    unit = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
    launches = [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * unit[r["Metric Unit"]])
                for r in rows]
    total = sum(ms for _, ms in launches)
    per_name = defaultdict(float)
    count = Counter()
    for name, ms in launches:
        per_name[name] += ms
        count[name] += 1
    print(f"all kernels: {total:.1f} ms in {len(launches)} launches")
    print(f"{'total ms':>10} {'launches':>8} {'mean us':>9}  name")
    for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{ms:10.2f} {count[name]:8d} {1e3 * ms / count[name]:9.1f}  {name[:120]}")

    # The attention kernel (the name with the largest total time) runs twice per block: self- then
    # cross-attention. One block: from the launch after one self-attention to the next one.
    attn = max(per_name, key=lambda n: per_name[n])
    at = [i for i, (name, _) in enumerate(launches) if name == attn]
    if len(at) >= 5:
        mid = len(at) // 4 * 2
        lo, hi = at[mid] + 1, at[mid + 2]
        block = launches[lo:hi + 1]
        print(f"\none block's launches in order (after attention launch #{mid} to #{mid + 2}): "
              f"{sum(ms for _, ms in block):.3f} ms in {len(block)} launches")
        for name, ms in block:
            print(f"{1e3 * ms:10.1f} us  {name[:120]}")


if __name__ == "__main__":
    main(sys.argv[1])
