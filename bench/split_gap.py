"""Where U-shaped SplitFed's accuracy gap to pooled training comes from, in process: candidate schedules measured
against pooled training at equal epochs on Fashion-MNIST with Dirichlet(0.3) label skew. None of the candidates
is a schedule Plexus runs; this is the evidence a new one would be built on.

    python -m bench.split_gap --sites 4,8 --seeds 0,1,2 --out bench/results/split_gap.json

Methods (all `cnn` width 16, SGD lr 0.02 momentum 0.9, 5 epochs; every epoch each site's rows in its own seeded
order; u-shaped cuts block1 and features):
- `pooled`: one model on all rows shuffled together, batches of 64 (bench.split's pooled).
- `splitfed`: U-shaped SplitFed as Plexus runs it (plexus.split.splitfed_epoch): each site's batches of 64 take
  turns through the one server part; the site parts are averaged at the epoch's end.
- `interleaved`: one unsplit model trained on the batches SplitFed's server sees, in the same order (each
  batch from one site): what the label skew of the batches alone costs.
- `splitfed-equal-turns`: SplitFed with every site cutting its rows into the same number of batches (the
  turns of 64 × sites rows), so that no site trains alone at an epoch's end.
- `synchronous`: U-shaped synchronous SplitFed (plexus.split.synchronous_epoch, in process only): every turn
  takes each site's share of 64 rows, proportional to its rows; the server steps once on the turn's
  activations from all sites, and every site applies the sum of the sites' gradients of their parts, so the
  site parts stay equal. That is one unsplit model's step on the turn's rows, up to the order of float sums.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.split import CUTS, accuracy, keep, load, run as bench_run
from plexus.models import build_model
from plexus.split import (
    ServerStep,
    epoch_batches,
    site_generator,
    split,
    splitfed_epoch,
    synchronous_epoch,
    turn_shares,
)

METHODS = ("pooled", "splitfed", "interleaved", "splitfed-equal-turns", "synchronous")
EPOCH_SEED = 101   # as bench.split: epoch e of seed s shuffles with s * 101 + e


def run(method: str, loaded, seed: int, *, epochs: int, lr: float, batch: int) -> float:
    """One method's test accuracy; `loaded` is bench.split.load's (model name, args, sites, test rows)."""
    name, args, data, test = loaded
    if method == "pooled":
        return bench_run("pooled", name, args, data, test, epochs=epochs, seed=seed, lr=lr, batch=batch)["accuracy"]
    torch.manual_seed(seed)
    model = build_model(name, args, seed=seed)
    sites = [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in data]
    make = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)   # noqa: E731
    if method == "interleaved":
        opt = make(model.parameters())
        for epoch in range(epochs):
            seed_e = seed * EPOCH_SEED + epoch
            plans = [epoch_batches(len(x), batch, site_generator(seed_e, k)) for k, (x, _) in enumerate(sites)]
            for turn in range(max(map(len, plans))):
                for k, (x, y) in enumerate(sites):
                    if turn < len(plans[k]):
                        rows = plans[k][turn]
                        opt.zero_grad()
                        F.cross_entropy(model(x[rows]), y[rows]).backward()
                        opt.step()
        return accuracy(model, test)
    cuts = CUTS[name]["u-shaped"]
    parts = split(model, "u-shaped", cuts)
    server = ServerStep(parts, make(parts.middle.parameters()))
    # equal turns: each site's rows in as many batches as turns of batch × sites rows take
    turns = -(-sum(len(x) for x, _ in sites) // (batch * len(sites)))
    equal = {"plan": lambda n, generator: turn_shares(n, turns, generator)} if method == "splitfed-equal-turns" else {}
    epoch_of = synchronous_epoch if method == "synchronous" else splitfed_epoch
    for epoch in range(epochs):
        epoch_of(model, "u-shaped", cuts, server, sites, make, batch_size=batch, seed=seed * EPOCH_SEED + epoch,
                 **equal)
    return accuracy(model, test)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", default="4,8")
    p.add_argument("--seeds", default="0")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for sites in (int(n) for n in args.sites.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            loaded = load("fashion-mnist", sites, seed)   # once for every method
            for method in args.methods.split(","):
                started = time.perf_counter()
                acc = run(method, loaded, seed, epochs=args.epochs, lr=args.lr, batch=args.batch)
                seconds = time.perf_counter() - started
                keep(rows, {"sites": sites, "seed": seed, "method": method, "accuracy": acc, "seconds": seconds},
                     args.out, f"{sites} sites seed {seed} {method:>21}: accuracy {acc:.4f}, {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
