"""Aggregation speed: coordinator.aggregate.WeightedSum.fold on one 50M-float32 update vs a plain memcpy
(np.copyto of the same bytes) in the same process. Goal: fold ≥ 0.5 × memcpy.

    python -m bench.aggregate_speed [--size 50000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from coordinator.aggregate import WeightedSum
from plexus.wire import encode, iter_chunks


def measure(size: int = 50_000_000, repeats: int = 3, chunks: int = 4) -> dict:
    rng = np.random.default_rng(0)
    bounds = [size * i // chunks for i in range(chunks + 1)]
    state = {f"parts.{i}": rng.standard_normal(b - a, dtype=np.float32) for i, (a, b) in
             enumerate(zip(bounds, bounds[1:]))}
    layout, blob = encode(state)
    nbytes = len(blob)
    max_abs = float(max(np.abs(a).max() for a in state.values()))
    src = np.frombuffer(blob, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm the pages
    copy_times, fold_times = [], []
    total = WeightedSum(layout)
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        copy_times.append(time.perf_counter() - t)
        # As the engine calls it: the update arrives as 4 MiB blocks (the spool read size).
        t = time.perf_counter()
        total.fold((piece for _, piece in iter_chunks(blob, 4 << 20)), 100, max_abs, nbytes=nbytes)
        fold_times.append(time.perf_counter() - t)
    fold = nbytes / min(fold_times) / 1e9
    memcpy = nbytes / min(copy_times) / 1e9
    return {"size": size, "bytes": nbytes, "fold_gb_s": fold, "memcpy_gb_s": memcpy, "ratio": fold / memcpy,
            "fold_s": fold_times, "memcpy_s": copy_times}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=50_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    r = measure(args.size, args.repeats)
    print(f"update: {r['size']:,} float32 = {r['bytes'] / 2**20:.0f} MiB")
    print(f"WeightedSum.fold : {r['fold_gb_s']:8.3f} GB/s  (best of {args.repeats}: {min(r['fold_s']):.3f} s)")
    print(f"np.copyto memcpy : {r['memcpy_gb_s']:8.3f} GB/s  (best of {args.repeats}: {min(r['memcpy_s']):.3f} s)")
    print(f"ratio fold/memcpy: {r['ratio']:.4f}  (goal >= 0.5: {'ok' if r['ratio'] >= 0.5 else 'MISS'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
