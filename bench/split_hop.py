"""Split learning's compute-worker hop: the per-batch cost of sending a batch's activations to the server part in its
own process (coordinator/split_worker.py: framed pipes, raw tensor bytes) and its gradient back, against the
batch's compute there.

    python -m bench.split_hop --out bench/results/split_hop.json

Per case, 300 batches after 10 of warm-up, each batch taken twice, in turn first: through the compute worker, as
the coordinator's Split sessions call it (each reply's tensors turned into wire messages straight from the shared
segment), and by the same server part computing in this process (the batch's checks, the compute, the reply's
wire messages made from its tensors), as a coordinator without the worker would. The hop = the median of the
worker's round trips less its own time on them (what it reports: the batch's checks and the server part's compute)
- the median of the in-process batches less their checks and compute: what a batch costs more for the process
boundary. As a share of the worker's median compute. The goal (#16): hop <= 10 % of the batch's compute at the
server. This process stands in for the coordinator, so `main` sets its malloc up as `plexus coordinator run` sets
up the coordinator's (call plexus.memory.set_up_coordinator first when calling `run_case` yourself).

Also given, the measure used until 2026-12-05: the median round trip less the worker's compute less the wire
messages' time when made in a loop of their own (warm caches, so lower than after a compute: that over-counts the
hop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from coordinator.split_worker import SplitWorker, check_batch
from plexus.memory import set_up_coordinator
from plexus.models import build_model
from plexus.split import ServerStep, num_classes, split
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


class _InProcess:
    """The server part computing in this process: what the coordinator would do per batch without the worker."""

    def __init__(self, name, args, variant, cuts, rows):
        model = build_model(name, args, seed=0)
        self.parts = split(model, variant, cuts)
        self.step = ServerStep(self.parts, torch.optim.SGD(self.parts.middle.parameters(), lr=0.01))
        self.classes, self.rows = num_classes(model), rows
        self.spent = 0.0

    def call(self, op: str, tensors: list[np.ndarray]) -> list:
        started = time.perf_counter()
        with warnings.catch_warnings():   # arrays over a message's read-only bytes, as the worker's over the segment
            warnings.simplefilter("ignore", UserWarning)
            t = [torch.from_numpy(x) for x in tensors]
        if op == "vanilla":
            check_batch(tensors[0], tuple(tensors[0].shape[1:]), max_rows=self.rows, labels=tensors[1],
                        classes=self.classes)
            out = self.step.vanilla(*t)[0]
        elif op == "forward":
            check_batch(tensors[0], tuple(tensors[0].shape[1:]), max_rows=self.rows)
            out = self.step.forward(t[0])
        else:
            if not np.isfinite(tensors[0]).all():
                raise ValueError("the gradient contains NaN or Inf")
            out = self.step.backward(t[0])
        out = out.numpy()
        self.spent += time.perf_counter() - started
        return [tensor_message(out)]


def run_case(name, args, variant, cuts, row_in, classes, rows, *, batches=300, warmup=10, threads=1,
             shared_memory=True) -> dict:
    torch.set_num_threads(threads)   # the in-process server part computes on as many threads as the worker
    parts = split(build_model(name, args, seed=0), variant, cuts)
    with torch.no_grad():
        cut = parts.bottom(torch.zeros(1, *row_in))
        out_shape = list(parts.middle(cut).shape[1:]) if variant == "u-shaped" else None
    row_shape = list(cut.shape[1:])
    worker = SplitWorker(shared_memory=shared_memory)
    local = _InProcess(name, args, variant, cuts, rows)
    compute, trips, local_compute, local_rest = [], [], [], []
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
            calls = [("vanilla", [a, y])] if variant == "vanilla" else [("forward", [a]), ("backward", [g])]
            for through_worker in ((True, False) if k % 2 == 0 else (False, True)):
                started = time.perf_counter()
                if through_worker:
                    spent = 0.0
                    for op, tensors in calls:
                        worker.call(op, tensors, consume=_wire)
                        spent += worker.compute_s
                else:
                    local.spent = 0.0
                    for op, tensors in calls:
                        local.call(op, tensors)
                    spent = local.spent
                trip = time.perf_counter() - started
                if k >= warmup:
                    if through_worker:
                        compute.append(spent)
                        trips.append(trip)
                    else:
                        local_compute.append(spent)
                        local_rest.append(trip - spent)
    finally:
        worker.close()
    hops = [t - c for t, c in zip(trips, compute)]
    rest = statistics.median(local_rest)   # the in-process batch's own cost beyond compute: its wire messages
    c, h = statistics.median(compute), statistics.median(hops) - rest
    # The earlier measure: the replies' wire tensors made from arrays in a loop of their own (warm caches).
    replies = [(rows, *row_shape)] if variant == "vanilla" else [(rows, *out_shape), (rows, *row_shape)]
    w = statistics.median(_time_wire(replies) for _ in range(batches))
    return {"model": name, "args": args, "variant": variant, "cuts": cuts, "rows": rows,
            "transport": "shared memory" if shared_memory else "pipe", "batches": batches,
            "activation_bytes": int(np.prod(row_shape)) * 4 * rows, "compute_ms": c * 1e3,
            "in_process_compute_ms": statistics.median(local_compute) * 1e3, "in_process_rest_ms": rest * 1e3,
            "hop_ms": h * 1e3, "hop_p90_ms": (statistics.quantiles(hops, n=10)[-1] - rest) * 1e3, "hop_share": h / c,
            "wire_ms": w * 1e3, "hop_less_warm_wire_ms": (statistics.median(hops) - w) * 1e3,
            "hop_less_warm_wire_share": (statistics.median(hops) - w) / c}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    set_up_coordinator()   # this process stands in for the coordinator: its malloc as `plexus coordinator run` has it
    rows = []
    for case in CASES:
        for shared in (True, False):
            row = run_case(*case, shared_memory=shared)
            rows.append(row)
            print(f"{row['model']} {row['args']} {row['variant']} {row['cuts']} ({row['transport']}): "
                  f"{row['activation_bytes'] / 1e6:.2f} MB of activations, compute {row['compute_ms']:.2f} ms, "
                  f"hop {row['hop_ms']:.2f} ms (90th percentile {row['hop_p90_ms']:.2f}) = "
                  f"{100 * row['hop_share']:.1f} % of compute (in process: compute {row['in_process_compute_ms']:.2f} "
                  f"ms, the rest {row['in_process_rest_ms']:.2f} ms; less warm wire messages only: "
                  f"{row['hop_less_warm_wire_ms']:.2f} ms = {100 * row['hop_less_warm_wire_share']:.1f} %)",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
