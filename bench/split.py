"""Split learning against FedAvg and pooled training at equal epochs, in process (plexus.split's schedules; no
network): test accuracy, and the bytes one site sends and receives per epoch (split: activations, gradients and,
for vanilla, labels, counted from the tensors' sizes; FedAvg: the model down and the update up each round).

    python -m bench.split --data fashion-mnist --sites 4,8 --epochs 5 --seeds 0,1,2 --out bench/results/split.json
    python -m bench.split --data heart-disease --epochs 20 --seeds 0,1,2

Fashion-MNIST: `cnn` (width 16), Dirichlet(0.3) label skew over the sites, the t10k set as test rows.
Heart disease: `mlp` (hidden 32, 16) over its four hospitals, their pooled held-out rows as test rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from plexus.models import build_model
from plexus.split import ServerStep, SiteOptions, message_bytes, sequential_epoch, split, splitfed_epoch

CUTS = {"cnn": {"vanilla": ["block1"], "u-shaped": ["block1", "features"]},
        "mlp": {"vanilla": ["hidden1"], "u-shaped": ["hidden1", "hidden2"]}}
METHODS = ("pooled", "fedavg", "splitfed u-shaped", "splitfed vanilla", "sequential u-shaped", "sequential vanilla",
           "splitfed u-shaped logit-adjusted")


def load(data: str, sites: int, seed: int):
    """(model name, args, [(x, y) per site], (x_test, y_test))."""
    if data == "fashion-mnist":
        from plexus.datasets.fashion import fashion_mnist

        parts = [fashion_mnist(sites=sites, index=k, alpha=0.3, split_seed=seed) for k in range(sites)]
        return "cnn", {"width": 16}, [(p.x_train, p.y_train) for p in parts], (parts[0].x_test, parts[0].y_test)
    from plexus.datasets import HOSPITALS, heart_disease

    parts = [heart_disease(h) for h in HOSPITALS]
    test = (np.concatenate([p.x_test for p in parts]), np.concatenate([p.y_test for p in parts]))
    return "mlp", {"in_features": parts[0].x_train.shape[1], "hidden": [32, 16]}, \
        [(p.x_train, p.y_train) for p in parts], test


def accuracy(model, test) -> float:
    x, y = torch.as_tensor(test[0]), torch.as_tensor(test[1])
    with torch.no_grad():
        right = sum(int((model(x[k:k + 4096]).argmax(1) == y[k:k + 4096]).sum()) for k in range(0, len(x), 4096))
    return right / len(x)


def _epoch(model, opt, x, y, batch: int, generator: torch.Generator) -> None:
    order = torch.randperm(len(x), generator=generator)
    for k in range(0, len(x), batch):
        rows = order[k:k + batch]
        opt.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def run(method: str, name: str, args: dict, sites, test, *, epochs: int, seed: int, lr: float, batch: int) -> dict:
    torch.manual_seed(seed)
    model = build_model(name, args, seed=seed)
    tensors = [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in sites]
    make = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)   # noqa: E731
    started = time.perf_counter()
    per_site_bytes = 0.0
    if method == "pooled":
        x = torch.cat([x for x, _ in tensors])
        y = torch.cat([y for _, y in tensors])
        opt = make(model.parameters())
        g = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            _epoch(model, opt, x, y, batch, g)
    elif method == "fedavg":
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        per_site_bytes = 2.0 * model_bytes   # the model down, the update up, once per epoch (one local epoch a round)
        for epoch in range(epochs):
            states, weights = [], []
            for k, (x, y) in enumerate(tensors):
                local = copy.deepcopy(model)
                _epoch(local, make(local.parameters()), x, y, batch,
                       torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1009 + k))
                states.append(local.state_dict())
                weights.append(len(x))
            total = sum(weights)
            model.load_state_dict({n: sum(w / total * s[n].double() for w, s in zip(weights, states)).float()
                                   for n in states[0]})
    else:
        schedule, variant, *adjusted = method.split()
        options = SiteOptions(logit_adjustment=1.0 if adjusted else 0.0)   # τ = 1 (split.logit_adjustment)
        cuts = CUTS[name][variant]
        parts = split(model, variant, cuts)
        server = ServerStep(parts, make(parts.middle.parameters()))
        sizes = [message_bytes(parts, x[:batch]) for x, _ in tensors[:1]][0]
        batches = statistics.mean(-(-len(x) // batch) for x, _ in tensors)
        per_site_bytes = batches * (sizes["up"] + sizes["down"])
        site_bytes = sum(p.numel() * 4 for m in parts.site_modules for p in m.parameters())
        # the site-side weights: sequential hands them over once per site turn (up and down), SplitFed averages them
        per_site_bytes += 2.0 * site_bytes
        for epoch in range(epochs):
            if schedule == "sequential":
                sequential_epoch(model, parts, server, tensors, make, batch_size=batch, seed=seed * 101 + epoch,
                                 options=options)
            else:
                splitfed_epoch(model, variant, cuts, server, tensors, make, batch_size=batch, seed=seed * 101 + epoch,
                               options=options)
    return {"method": method, "seed": seed, "accuracy": accuracy(model, test),
            "bytes_per_epoch_per_site": per_site_bytes, "seconds": time.perf_counter() - started}


CROSSOVER_MODELS = [("cnn", {"width": w}, (1, 1, 28, 28)) for w in (16, 64, 256, 1024)] + \
    [("mlp", {"in_features": 784, "hidden": [h, h], "num_classes": 10}, (1, 784)) for h in (256, 1024, 4096)]


def crossover() -> list[dict]:
    """Rows per site below which split learning moves fewer bytes per epoch than FedAvg (one local epoch a round),
    for Fashion-MNIST-shaped models at several sizes and cuts: FedAvg moves 2·|model| per site per epoch; split
    learning moves, per row, the cut's activations up and their gradients down (and, vanilla, an 8-byte label;
    u-shaped, the server's output and its gradient too), plus the site's part of the weights up and down once."""
    out = []
    for name, args, row_shape in CROSSOVER_MODELS:
        with torch.device("meta"):
            model = build_model(name, args, seed=0)
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        for variant, cuts in CUTS_FOR_CROSSOVER[name]:
            parts = split(model, variant, cuts)
            site_bytes = sum(p.numel() * 4 for m in parts.site_modules for p in m.parameters())
            with torch.device("meta"):
                sizes = message_bytes(parts, torch.empty(row_shape))
            row_bytes = sizes["up"] + sizes["down"]
            out.append({"model": name, "args": args, "params": model_bytes // 4, "variant": variant, "cuts": cuts,
                        "bytes_per_row": row_bytes, "crossover_rows": (2 * model_bytes - 2 * site_bytes) / row_bytes})
    return out


CUTS_FOR_CROSSOVER = {"cnn": [("vanilla", ["block1"]), ("vanilla", ["features"]), ("u-shaped", ["block1", "features"])],
                      "mlp": [("vanilla", ["hidden1"]), ("u-shaped", ["hidden1", "hidden2"])]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=("fashion-mnist", "heart-disease"), default="fashion-mnist")
    p.add_argument("--sites", default="4,8", help="fashion-mnist only: site counts")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seeds", default="0")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", type=Path)
    p.add_argument("--crossover", action="store_true", help="print the bytes crossover table only")
    args = p.parse_args(argv)
    if args.crossover:
        for row in crossover():
            shape = f"width {row['args']['width']}" if row["model"] == "cnn" else f"hidden {row['args']['hidden']}"
            print(f"{row['model']} {shape:>18} ({row['params']:>11,} params) {row['variant']:>8} "
                  f"{','.join(row['cuts']):>15}: {row['bytes_per_row']:>9,} B/row; split moves fewer bytes below "
                  f"{row['crossover_rows']:,.0f} rows per site", flush=True)
        return 0
    torch.set_num_threads(2)
    counts = [int(n) for n in args.sites.split(",")] if args.data == "fashion-mnist" else [4]
    rows = []
    for sites in counts:
        for seed in (int(s) for s in args.seeds.split(",")):
            name, margs, data, test = load(args.data, sites, seed)
            for method in args.methods.split(","):
                row = {"data": args.data, "sites": sites, "epochs": args.epochs,
                       **run(method, name, margs, data, test, epochs=args.epochs, seed=seed, lr=args.lr,
                             batch=args.batch)}
                keep(rows, row, args.out, f"{args.data} {sites} sites seed {seed} {method:>20}: accuracy "
                     f"{row['accuracy']:.4f}, {row['bytes_per_epoch_per_site'] / 1e6:8.2f} MB/epoch/site, "
                     f"{row['seconds']:.0f} s")
    return 0


def keep(rows: list[dict], row: dict, out: Path | None, line: str) -> None:
    """Print a result's line and add it to `rows`, written whole to `out` after each (a long run keeps its part)."""
    rows.append(row)
    print(line, flush=True)
    if out:
        out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
