"""Split learning's compute-worker hop: the per-batch cost of sending a batch's activations to the server part in its
own process (coordinator/split_worker.py: framed pipes, raw tensor bytes) and its gradient back, against the
batch's compute there.

    python -m bench.split_hop --out bench/results/split_hop.json

Per case, 300 batches after 10 of warm-up. Each batch's hop = its round trip seen by the caller as the coordinator's
Split sessions make it (each reply's tensors turned into wire messages straight from the shared segment) - the
worker's own time on it (what it reports: the batch's checks and the server part's compute; the copy a forward's
activations take out of the segment is the hop's). The median hop, less the time the wire messages take to make from
arrays in process (which a server part computing in the coordinator would pay too), as a share of the median compute.
The goal (#16): hop <= 10 % of the batch's compute at the server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from coordinator.split_worker import SplitWorker
from plexus.models import build_model
from plexus.split import split
from plexus.split_wire import tensor_message

CASES = [("cnn", {"width": 16}, "vanilla", ["block1"], (1, 28, 28), 10, 64),
         ("cnn", {"width": 16}, "u-shaped", ["block1", "features"], (1, 28, 28), 10, 64),
         ("cnn", {"width": 64}, "vanilla", ["block1"], (1, 28, 28), 10, 64),
         ("mlp", {"in_features": 784, "hidden": [1024, 1024], "num_classes": 10}, "vanilla", ["hidden1"], (784,), 10,
          64)]


def _wire(header: dict, views: list) -> tuple[dict, list]:
    """What the coordinator does with a reply: wire tensors made straight from the shared segment."""
    return header, [tensor_message(v) for v in views]


def _time_wire(shapes) -> float:
    arrays = [np.ones(s, np.float32) for s in shapes]
    started = time.perf_counter()
    for a in arrays:
        tensor_message(a)
    return time.perf_counter() - started


def run_case(name, args, variant, cuts, row_in, classes, rows, *, batches=300, warmup=10, threads=1,
             shared_memory=True) -> dict:
    parts = split(build_model(name, args, seed=0), variant, cuts)
    with torch.no_grad():
        cut = parts.bottom(torch.zeros(1, *row_in))
        out_shape = list(parts.middle(cut).shape[1:]) if variant == "u-shaped" else None
    row_shape = list(cut.shape[1:])
    worker = SplitWorker(shared_memory=shared_memory)
    compute, hops = [], []
    try:
        worker.call("load", model=name, args=args, seed=0, variant=variant, cuts=cuts, max_rows=rows, lr=0.01,
                    threads=threads)
        rng = np.random.default_rng(0)
        for k in range(warmup + batches):
            # as the coordinator has them: arrays over a received message's bytes
            a = np.frombuffer(rng.normal(size=(rows, *row_shape)).astype(np.float32).tobytes(), np.float32)
            a = a.reshape(rows, *row_shape)
            y = rng.integers(0, classes, rows)
            g = np.full((rows, *out_shape), 1e-4, np.float32) if out_shape else None
            started = time.perf_counter()
            if variant == "vanilla":
                header, _ = worker.call("vanilla", [a, y], consume=_wire)
                spent = header["compute_s"]
            else:
                header, _ = worker.call("forward", [a], consume=_wire)
                spent = header["compute_s"]
                header, _ = worker.call("backward", [g], consume=_wire)
                spent += header["compute_s"]
            trip = time.perf_counter() - started
            if k >= warmup:
                compute.append(spent)
                hops.append(trip - spent)
    finally:
        worker.close()
    # The replies' wire tensors, made from arrays in this process: what a server part computing in the coordinator
    # would pay too, so not the hop's.
    replies = [(rows, *row_shape)] if variant == "vanilla" else [(rows, *out_shape), (rows, *row_shape)]
    w = statistics.median(_time_wire(replies) for _ in range(batches))
    c, h = statistics.median(compute), statistics.median(hops) - w
    return {"model": name, "args": args, "variant": variant, "cuts": cuts, "rows": rows, "wire_ms": w * 1e3,
            "transport": "shared memory" if shared_memory else "pipe", "batches": batches,
            "activation_bytes": int(np.prod(row_shape)) * 4 * rows, "compute_ms": c * 1e3, "hop_ms": h * 1e3,
            "hop_p90_ms": (statistics.quantiles(hops, n=10)[-1] - w) * 1e3, "hop_share": h / c}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    for case in CASES:
        for shared in (True, False):
            row = run_case(*case, shared_memory=shared)
            rows.append(row)
            print(f"{row['model']} {row['args']} {row['variant']} {row['cuts']} ({row['transport']}): "
                  f"{row['activation_bytes'] / 1e6:.2f} MB of activations, compute {row['compute_ms']:.2f} ms, "
                  f"hop {row['hop_ms']:.2f} ms (90th percentile {row['hop_p90_ms']:.2f}) = "
                  f"{100 * row['hop_share']:.1f} % of compute", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
