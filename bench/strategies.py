"""Strategy benchmark: pooled, local-only and every FL strategy on Fed-Heart-Disease and Fashion-MNIST.

    python -m bench.strategies [--quick] [--seeds 3] [--datasets heart,fmnist] [--out results.json]

An in-process simulation of the round engine: the coordinator's own strategy objects
(`coordinator.strategies.make_strategy`), the site's own training code (`site_agent.local.local_update`),
and the coordinator's exact fixed-point `WeightedSum` over `plexus.wire.encode`d updates (weight 1 for a
uniformly weighted rule, else num_samples), with the engine's per-site seeds (`site_seed`). There is no
gRPC, TLS, spooling or process boundary here: the end-to-end path is covered by the integration tests.

Equal local compute (R rounds, E epochs, K sites): pooled and each site alone train R×E epochs; every
FL strategy runs R rounds of E epochs at every site; CWT runs R×K rounds (one site each) of E epochs; the
ensemble runs R rounds in which each member trains E epochs. Every method starts from the same initial
model (the job seed) and uses the same local optimizer. Seeds vary model init and training; the data
splits (heart's train/test split, the Fashion-MNIST Dirichlet split, split_seed 0) are fixed.

Metrics: heart, accuracy and ROC AUC on the union of the four hospitals' test rows; Fashion-MNIST,
accuracy on the balanced 10k t10k test set. "local (mean)" averages the K single-site models' scores,
"local (best)" takes the best site per seed. See bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from coordinator.aggregate import WeightedSum
from coordinator.drivers import sync as rules
from coordinator.drivers.rounds import Action, RoundView, can_open, decide, training_over
from coordinator.strategies import Update, make_strategy
from coordinator.tasks import site_seed
from plexus.config import DatasetSpec, RoundConfig, parse_round_config
from plexus.datasets import HOSPITALS, Split, load_dataset
from plexus.models import build_job_model, load_numpy_state, state_to_numpy
from plexus.wire import Layout, encode
from site_agent.local import local_update
from site_agent.training import evaluate, train_local

METHODS = ("pooled", "local", "fedavg", "fedprox", "fedadam", "fedyogi", "scaffold", "cwt", "ensemble")
# FLamby (NeurIPS 2022) Fed-Heart-Disease accuracy, same compute as pooled, mean of 5 seeds.
FLAMBY_HEART = {"pooled": 0.735, "local (best)": 0.722, "fedavg": 0.685, "best FL": 0.731}

JOB = """\
name: bench-{strategy}
model: {model}
data: {{dataset: {dataset}}}
rounds: {rounds}
strategy: {{name: {strategy}, args: {args}}}
sites: {{min: 1}}
train: {train}
seed: {seed}
"""


@dataclass(frozen=True)
class Task:
    """One dataset column: the sites' data, the shared test set and the training recipe."""

    name: str
    sites: dict[str, Split]
    x_test: np.ndarray
    y_test: np.ndarray
    model: dict
    optimizer: dict
    batch_size: int
    rounds: int          # R
    epochs: int          # E
    strategy_args: dict[str, dict] = field(default_factory=dict)
    setup: dict = field(default_factory=dict)   # recorded in the JSON as is
    # Per-site test sets: "site_accuracy" is the unweighted mean of the accuracies on each, FLamby's metric.
    groups: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def heart_task(quick: bool) -> Task:
    """The four FLamby hospitals; logistic regression, plain SGD (SCAFFOLD's update assumes it)."""
    sites = {h: load_dataset(DatasetSpec(kind="heart-disease", hospital=h)) for h in HOSPITALS}
    rounds, epochs = (5, 1) if quick else (50, 1)   # 50 epochs of compute, like FLamby's pooled baseline
    fedopt = {"eta": 0.1, "tau": 1e-3}
    return Task(
        name="heart", sites=sites,
        x_test=np.concatenate([s.x_test for s in sites.values()]),
        y_test=np.concatenate([s.y_test for s in sites.values()]),
        model={"name": "logistic", "args": {"in_features": 13, "num_classes": 2}},
        optimizer={"name": "sgd", "lr": 0.05}, batch_size=16, rounds=rounds, epochs=epochs,
        strategy_args={"fedprox": {"mu": 0.01}, "fedadam": fedopt, "fedyogi": fedopt, "scaffold": {"eta_g": 1.0}},
        setup={"sites": list(HOSPITALS), "test": "union of the 4 hospitals' test rows; and the mean of the "
                                                  "accuracies on each hospital's test rows (FLamby's metric)"},
        groups={h: (s.x_test, s.y_test) for h, s in sites.items()},
    )


def fmnist_task(quick: bool) -> Task:
    """8 sites of a Dirichlet(0.3) label-skew split of the first `limit` training images; a small CNN."""
    sites_n, alpha, limit = 8, 0.3, (2000 if quick else 16000)
    sites = {f"site-{i}": load_dataset(DatasetSpec(kind="fashion-mnist", sites=sites_n, index=i, alpha=alpha,
                                                   split_seed=0, limit=limit)) for i in range(sites_n)}
    first = next(iter(sites.values()))
    rounds, epochs = (3, 1) if quick else (12, 1)
    fedopt = {"eta": 0.03, "tau": 1e-3}
    return Task(
        name="fmnist", sites=sites, x_test=first.x_test, y_test=first.y_test,
        model={"name": "cnn", "args": {"width": 16}},
        optimizer={"name": "sgd", "lr": 0.05}, batch_size=32, rounds=rounds, epochs=epochs,
        strategy_args={"fedprox": {"mu": 0.01}, "fedadam": fedopt, "fedyogi": fedopt, "scaffold": {"eta_g": 1.0}},
        setup={"sites": sites_n, "alpha": alpha, "split_seed": 0, "limit": limit,
               "rows_per_site": {s: len(d.y_train) for s, d in sites.items()}, "test": "t10k (10,000, balanced)"},
    )


TASKS = {"heart": heart_task, "fmnist": fmnist_task}


@functools.cache
def task_for(name: str, quick: bool) -> Task:
    """Each worker process loads a dataset once."""
    return TASKS[name](quick)


def job_config(task: Task, strategy: str, *, rounds: int, epochs: int, seed: int,
               args: dict | None = None) -> RoundConfig:
    """The round config a real job would be submitted with (JSON is YAML flow syntax)."""
    if args is None:
        args = task.strategy_args.get(strategy, {})
    train = {"epochs": epochs, "batch_size": task.batch_size, "optimizer": task.optimizer}
    return parse_round_config(JOB.format(strategy=strategy, model=json.dumps(task.model), dataset=task.name,
                                         rounds=rounds, args=json.dumps(args), train=json.dumps(train), seed=seed))


def scores(model: torch.nn.Module, task: Task) -> dict[str, float]:
    metrics = evaluate(model, task.x_test, task.y_test)
    out = {k: metrics[k] for k in ("accuracy", "auc") if k in metrics}
    if task.groups:
        out["site_accuracy"] = float(np.mean([evaluate(model, x, y)["accuracy"] for x, y in task.groups.values()]))
    return out


def centralised(task: Task, seed: int, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Train the job's initial model on (x, y) for R×E epochs."""
    job = job_config(task, "fedavg", rounds=1, epochs=task.rounds * task.epochs, seed=seed)
    model = build_job_model(job)
    train_local(model, x, y, job.train, seed=seed)
    return scores(model, task)


def run_pooled(task: Task, seed: int) -> dict[str, float]:
    sites = task.sites.values()
    return centralised(task, seed, np.concatenate([s.x_train for s in sites]),
                       np.concatenate([s.y_train for s in sites]))


def run_local(task: Task, seed: int) -> dict[str, dict[str, float]]:
    return {name: centralised(task, seed, s.x_train, s.y_train) for name, s in task.sites.items()}


def run_federated(task: Task, strategy_name: str, seed: int, state_root: Path) -> dict[str, float]:
    names = sorted(task.sites)
    rounds = task.rounds * len(names) if strategy_name == "cwt" else task.rounds
    args = {"members": names} if strategy_name == "ensemble" else None
    job = job_config(task, strategy_name, rounds=rounds, epochs=task.epochs, seed=seed, args=args)
    model = build_job_model(job)
    load_numpy_state(model, simulate(task, job, f"{task.name}-{strategy_name}-{seed}", state_root))
    return scores(model, task)


def simulate(task: Task, job: RoundConfig, job_id: str, state_root: Path) -> dict[str, np.ndarray]:
    """The engine's round cycle over one job, in process, every site online and answering: the final model.

    It runs by the same decisions (coordinator.drivers.rounds) and the same strategy calls
    (coordinator.drivers.sync) as the engine's SyncRounds driver; tests/integration/test_simulate.py checks
    that it ends with `plexus simulate`'s bits, and those with a real federation's over gRPC."""
    names = sorted(task.sites)
    strategy = make_strategy(job)
    current = state_to_numpy(build_job_model(job))
    sizes = {s: len(task.sites[s].y_train) for s in names}
    closed = 0
    while not training_over(model_round=closed, rounds=job.rounds, budget_stop=False,
                            strategy_done=rules.strategy_done(strategy, closed)):
        round_ = closed + 1
        participants = rules.choose(strategy, round_, names, names)
        if not can_open(participants, evaluating=False, sites_min=1):
            raise RuntimeError(f"{job.strategy.name}: round {round_} chose no sites out of {names}")
        rules.opened(strategy, round_, participants, names)
        served = {**current, **rules.served_extras(strategy, current)}
        updates = []
        for site in participants:
            model = build_job_model(job)
            load_numpy_state(model, {k: served[k] for k in current})
            local = local_update(job, model, served, task.sites[site], site=site, job_id=job_id,
                                 seed=site_seed(job.seed, round_, site),
                                 local_steps=rules.local_steps(strategy, site, sizes), state_dir=state_root / site)
            local.commit()   # the coordinator accepted the update
            updates.append((site, local.result.num_samples, local.update))
        view = RoundView(kind="train", participants=participants, outcomes={s: "submitted" for s in participants},
                         contributors=len(updates), needed=max(1, rules.min_contributors(strategy)))
        decision = decide(view, 0.0)
        if decision.action != Action.CLOSE:
            raise RuntimeError(f"{job.strategy.name}: round {round_} would not close ({decision.action}) with "
                               f"{len(updates)} update(s)")
        current = _aggregate(strategy, round_, current, updates)
        closed += 1
    return current


def _aggregate(strategy, round_: int, current: dict, updates: list) -> dict:
    """What the engine does when a round closes: hold every update, or fold them into an exact weighted mean."""
    layout = Layout.of(current)
    update_layout = Layout.build([(t.name, t.dtype, t.shape) for t in layout.tensors]
                                 + rules.update_extras(strategy, layout))
    if rules.holds_updates(strategy):
        held = [Update(site, n, update) for site, n, update in sorted(updates, key=lambda u: u[0])]
        return rules.aggregate_held(strategy, round_, current, held)
    total = WeightedSum(update_layout)
    for _, n, update in updates:
        got, blob = encode(update)
        update_layout.require_same(got)
        max_abs = max(float(np.abs(a).max()) if a.size else 0.0 for a in update.values())
        total.fold([blob], 1 if rules.uniform_weights(strategy, None) else n, max_abs, nbytes=len(blob))
    mean = total.mean()
    contributors = sorted(site for site, _, _ in updates)
    return rules.aggregate_mean(strategy, round_, current if rules.reads_current(strategy) else None, mean,
                                contributors)


def run_method(task: Task, method: str, seed: int, state_root: Path) -> dict[str, dict[str, float]]:
    """{row label: scores} for one method and seed."""
    if method == "pooled":
        return {"pooled": run_pooled(task, seed)}
    if method == "local":
        per_site = run_local(task, seed)
        metrics = next(iter(per_site.values()))
        best = {k: max(s[k] for s in per_site.values()) for k in metrics}   # the best site for each metric
        mean = {k: float(np.mean([s[k] for s in per_site.values()])) for k in metrics}
        return {"local (mean)": mean, "local (best)": best}
    return {method: run_federated(task, method, seed, state_root / method)}


def _work(dataset: str, quick: bool, method: str, seed: int, state_root: str, threads: int) -> tuple:
    """One (dataset, method, seed) cell, run in a worker process: (rows, seconds)."""
    torch.set_num_threads(threads)
    task = task_for(dataset, quick)
    t0 = time.monotonic()
    rows = run_method(task, method, seed, Path(state_root) / dataset / f"seed{seed}")
    return rows, time.monotonic() - t0


def run_all(datasets: list[str], methods: list[str], seeds: list[int], *, quick: bool, jobs: int,
            threads: int, started: float) -> dict:
    """Every (dataset, method, seed) cell, `jobs` at a time; {dataset: {"rows", "seconds"}}."""
    cells = [(d, m, seed) for d in datasets for m in methods for seed in seeds]
    per_row: dict = {d: {} for d in datasets}
    seconds: dict = {d: {} for d in datasets}
    # Fork keeps the parent's imports; the parent never runs torch ops, so no thread pool is copied mid-use.
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="plexus-bench-strategies-") as tmp, \
            ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {cell: pool.submit(_work, *cell[:1], quick, *cell[1:], tmp, threads) for cell in cells}
        for (d, method, seed), future in futures.items():
            rows, took = future.result()
            seconds[d][method] = seconds[d].get(method, 0.0) + took
            for label, s in rows.items():
                for metric, value in s.items():
                    per_row[d].setdefault(label, {}).setdefault(metric, []).append(value)
            print(f"[{time.monotonic() - started:7.1f}s] {d} {method} seed {seed}: {took:.1f}s, "
                  + ", ".join(f"{label} acc {s['accuracy']:.3f}" for label, s in rows.items()), flush=True)
    return {d: {"rows": {label: {m: {**summarise(v), "values": v} for m, v in metrics.items()}
                         for label, metrics in per_row[d].items()},
                "seconds": seconds[d]} for d in datasets}


def summarise(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0}


def cell(stats: dict | None) -> str:
    return "–" if stats is None else f"{stats['mean']:.3f} ± {stats['std']:.3f}"


def table(results: dict, datasets: list[str]) -> str:
    rows = list(dict.fromkeys(label for d in datasets for label in results[d]["rows"]))
    head, sep = ["method"], ["---"]
    if "heart" in datasets:
        head += ["heart acc (all test rows)", "heart acc (mean of 4 hospitals)", "heart AUC", "FLamby heart acc"]
        sep += ["---:"] * 4
    if "fmnist" in datasets:
        head += ["F-MNIST acc"]
        sep += ["---:"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(sep) + "|"]
    for label in rows:
        line = [label]
        if "heart" in datasets:
            r = results["heart"]["rows"].get(label, {})
            flamby = FLAMBY_HEART.get(label)
            line += [cell(r.get("accuracy")), cell(r.get("site_accuracy")), cell(r.get("auc")),
                     "–" if flamby is None else f"{flamby:.3f}"]
        if "fmnist" in datasets:
            line.append(cell(results["fmnist"]["rows"].get(label, {}).get("accuracy")))
        lines.append("| " + " | ".join(line) + " |")
    if "heart" in datasets:
        flamby = ["FLamby best FL (FedAdagrad/FedYogi)", "", "", "", f"{FLAMBY_HEART['best FL']:.3f}"]
        lines.append("| " + " | ".join(flamby + [""] * (len(head) - len(flamby))) + " |")
    return "\n".join(lines)


def ratios(results: dict, datasets: list[str]) -> list[str]:
    """The issue's goals per dataset and metric: best strategy / pooled, and against the best single site."""
    out = []
    for d in datasets:
        rows = results[d]["rows"]
        results[d]["best_strategy"] = {}
        for metric in ("accuracy", "site_accuracy"):
            fl = {k: v[metric]["mean"] for k, v in rows.items()
                  if k in METHODS and k not in ("pooled", "local") and metric in v}
            if not fl or "pooled" not in rows:
                continue
            best = max(fl, key=fl.get)
            pooled = rows["pooled"][metric]["mean"]
            local = rows.get("local (best)", {}).get(metric, {}).get("mean")   # None: --methods without local
            versus = "" if local is None else \
                f"; best single site {local:.3f} ({'beaten' if fl[best] > local else 'not beaten'})"
            out.append(f"{d} {metric}: best strategy {best} {fl[best]:.3f} / pooled {pooled:.3f} = "
                       f"{fl[best] / pooled:.3f}{versus}")
            results[d]["best_strategy"][metric] = {"name": best, "value": fl[best],
                                                   "ratio_to_pooled": fl[best] / pooled, "best_local": local}
    if "heart" in datasets:
        out.append(f"heart (FLamby): best FL {FLAMBY_HEART['best FL']} / pooled {FLAMBY_HEART['pooled']} = "
                   f"{FLAMBY_HEART['best FL'] / FLAMBY_HEART['pooled']:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds on a small Fashion-MNIST subset (minutes)")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds 0..N-1 (default 3; 2 with --quick)")
    ap.add_argument("--datasets", default="heart,fmnist", help="comma-separated subset of: heart, fmnist")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of: {', '.join(METHODS)}")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPU count)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per worker (default 1: small batches gain little from more, and extra "
                         "threads spin when the cores are shared)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    datasets = [d for d in args.datasets.split(",") if d]
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(datasets) - set(TASKS)) + sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown dataset/method {unknown}; datasets: {sorted(TASKS)}, methods: {list(METHODS)}")
    seeds = list(range(args.seeds if args.seeds is not None else (2 if args.quick else 3)))
    if not seeds or args.jobs < 1 or args.threads < 1:
        ap.error("--seeds, --jobs and --threads must be at least 1")

    started = time.monotonic()
    results: dict = {"seeds": seeds, "quick": args.quick, "jobs": args.jobs, "torch_threads": args.threads,
                     "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    for d, measured in run_all(datasets, methods, seeds, quick=args.quick, jobs=args.jobs, threads=args.threads,
                               started=started).items():
        task = task_for(d, args.quick)
        results[d] = {"config": {"model": task.model, "optimizer": task.optimizer, "batch_size": task.batch_size,
                                 "rounds": task.rounds, "epochs": task.epochs, "strategy_args": task.strategy_args,
                                 **task.setup}, **measured}
    wall = time.monotonic() - started
    results["wall_s"] = wall
    print()
    print(table(results, datasets))
    print()
    for line in ratios(results, datasets):
        print(line)
    for d in datasets:
        c = results[d]["config"]
        print(f"{d}: {c['model']['name']} {c['model']['args']}, {c['optimizer']}, batch {c['batch_size']}, "
              f"R={c['rounds']} rounds × E={c['epochs']} epoch(s), strategy args {c['strategy_args']}")
    print(f"seeds {seeds}; wall time {wall:.0f}s on {os.cpu_count()} CPU(s), {args.jobs} worker(s) × "
          f"{args.threads} torch thread(s)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
