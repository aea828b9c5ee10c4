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
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.split import CUTS, accuracy, load, run as bench_run
from plexus.models import build_model
from plexus.split import (
    ServerStep,
    SiteStep,
    average_site_parts,
    epoch_batches,
    split,
    splitfed_epoch,
    synchronous_epoch,
    train_batch,
    turn_shares,
)

METHODS = ("pooled", "splitfed", "interleaved", "splitfed-equal-turns", "synchronous")
EPOCH_SEED = 101         # as bench.split: epoch e of seed s shuffles with s * 101 + e
SITE_SEED = 1_000_003    # and site k with that * 1_000_003 + k (plexus.split's schedules)


def _plans(sites, seed: int, batch: int, equal_turns: bool) -> list[list[torch.Tensor]]:
    """Each site's batches for one epoch: of `batch` rows, or (equal_turns) its rows in as many batches as a
    turn of `batch` rows from every site takes."""
    generators = [torch.Generator().manual_seed(seed * SITE_SEED + k) for k in range(len(sites))]
    if not equal_turns:
        return [epoch_batches(len(x), batch, g) for (x, _), g in zip(sites, generators)]
    turns = -(-sum(len(x) for x, _ in sites) // batch)
    return [turn_shares(len(x), turns, g) for (x, _), g in zip(sites, generators)]


def run(method: str, sites_n: int, seed: int, *, epochs: int, lr: float, batch: int) -> float:
    name, args, data, test = load("fashion-mnist", sites_n, seed)
    if method == "pooled":
        return bench_run("pooled", name, args, data, test, epochs=epochs, seed=seed, lr=lr, batch=batch)["accuracy"]
    torch.manual_seed(seed)
    model = build_model(name, args, seed=seed)
    sites = [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in data]
    make = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)   # noqa: E731
    cuts = CUTS[name]["u-shaped"]
    if method == "interleaved":
        opt = make(model.parameters())
        for epoch in range(epochs):
            plans = _plans(sites, seed * EPOCH_SEED + epoch, batch, equal_turns=False)
            for turn in range(max(map(len, plans))):
                for k, (x, y) in enumerate(sites):
                    if turn < len(plans[k]):
                        rows = plans[k][turn]
                        opt.zero_grad()
                        F.cross_entropy(model(x[rows]), y[rows]).backward()
                        opt.step()
        return accuracy(model, test)
    parts = split(model, "u-shaped", cuts)
    server = ServerStep(parts, make(parts.middle.parameters()))
    for epoch in range(epochs):
        seed_e = seed * EPOCH_SEED + epoch
        if method in ("splitfed", "synchronous"):
            epoch_of = splitfed_epoch if method == "splitfed" else synchronous_epoch
            epoch_of(model, "u-shaped", cuts, server, sites, make, batch_size=batch, seed=seed_e)
            continue
        plans = _plans(sites, seed_e, batch * len(sites), equal_turns=True)   # splitfed-equal-turns
        copies, steps = [], []
        for k in range(len(sites)):
            mine = build_model(name, args, seed=seed)
            mine.load_state_dict(model.state_dict())
            mine_parts = split(mine, "u-shaped", cuts)
            mine_parts.middle = parts.middle
            copies.append(mine)
            steps.append(SiteStep(mine_parts, make([p for m in mine_parts.site_modules for p in m.parameters()])))
        for turn in range(max(map(len, plans))):
            for k, (x, y) in enumerate(sites):
                if turn < len(plans[k]) and len(plans[k][turn]):
                    rows = plans[k][turn]
                    train_batch(steps[k], server, x[rows], y[rows])
        average_site_parts(model, "u-shaped", cuts, copies, [len(x) for x, _ in sites])
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
            for method in args.methods.split(","):
                started = time.perf_counter()
                acc = run(method, sites, seed, epochs=args.epochs, lr=args.lr, batch=args.batch)
                rows.append({"sites": sites, "seed": seed, "method": method, "accuracy": acc,
                             "seconds": time.perf_counter() - started})
                print(f"{sites} sites seed {seed} {method:>21}: accuracy {acc:.4f}, {rows[-1]['seconds']:.0f} s",
                      flush=True)
                if args.out:
                    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
