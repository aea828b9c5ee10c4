"""Site-side training throughput with 1 and N worker processes (site.yaml `training.workers`, site_agent/team.py).

    python -m bench.site_workers [--workers 1,2] [--cases fmnist,heart] [--repeats 3] [--threads T]
                                 [--fmnist-rows 20000] [--heart-epochs 1000] [--out FILE]

Each case trains the job's model with site_agent.training.train_local, from the same initial weights and seed,
once per worker count: 1 worker is plain train_local in this process with torch threads = cores; N workers is a
Team (this process is rank 0, N-1 helper processes, gloo on loopback) with cores // N threads each; `--threads`
sets the threads of every worker instead. A warm-up session of 10 steps comes first (it starts the helpers
and has them load the data); then `--repeats` sessions are timed, around the train_local call only (which
includes forming the session's process group), and the median is reported. samples/s = rows × epochs / seconds.
`max_abs_diff_vs_1_warmup` / `_trained`: the largest difference of any weight between the N-worker and the
1-worker model after the warm-up's 10 steps / after the whole training. The team trains the same batches, so
they differ by float rounding only (summation order, threads); over hundreds of SGD steps that rounding grows, as
it does between 1 and 2 threads in one process. `other_programs_cpu_share`: the machine's busy CPU time during
the row (warm-up included) less this process's and its helpers', as a share of cores × wall; on a shared
machine a row with more than a few percent is not a clean measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from plexus.config import DatasetSpec, SiteConfig, TrainingSpec, parse_round_config
from plexus.datasets import load_for_job
from plexus.models import build_job_model, state_to_numpy
from site_agent.team import Team
from site_agent.training import train_local

JOB = """\
name: site-workers-{name}
model: {model}
data: {{dataset: {dataset}}}
rounds: 1
strategy: {{name: fedavg}}
train: {{epochs: {epochs}, batch_size: {batch}, optimizer: {{name: sgd, lr: 0.05}}}}
seed: 0
"""
SEED = 7   # train_local's seed (batch order); the job's seed gives the initial weights
WARMUP_STEPS = 10


def cases(fmnist_rows: int, heart_epochs: int) -> dict[str, tuple[str, DatasetSpec]]:
    """Case name -> (job YAML, the site's dataset entry)."""
    return {
        # one site holding the first `fmnist_rows` training images (a Dirichlet split over 1 site keeps them all)
        "fmnist": (JOB.format(name="fmnist", model="{name: cnn, args: {width: 16}}", dataset="fashion-mnist",
                              epochs=1, batch=64),
                   DatasetSpec(kind="fashion-mnist", sites=1, index=0, alpha=1.0, limit=fmnist_rows)),
        # Cleveland's 199 training rows
        "heart": (JOB.format(name="heart", model="{name: mlp, args: {in_features: 13, hidden: [64]}}",
                             dataset="heart-disease", epochs=heart_epochs, batch=32),
                  DatasetSpec(kind="heart-disease", hospital="cleveland")),
    }


def measure(job_yaml: str, dataset: DatasetSpec, workers: int, threads: int, repeats: int):
    """With `workers` processes: (seconds of each timed train_local call, the model states after the warm-up and
    after training, training rows, the job's train spec)."""
    job = parse_round_config(job_yaml)
    split = load_for_job(dataset, job.data)
    x, y = split.x_train, split.y_train
    config = SiteConfig(site="bench", coordinator="unused.invalid:1", kit=Path("unused"),
                        datasets={job.data.dataset: dataset},
                        training=TrainingSpec(workers=workers, threads=threads) if workers > 1 else None)
    team = Team(config) if workers > 1 else None
    torch.set_num_threads(threads)   # 1 worker; a Team sets rank 0's threads itself for the session

    def run(steps: int | None = None) -> tuple[float, torch.nn.Module]:
        model = build_job_model(job)
        with team.session(job_yaml, job.name, model) if team is not None else contextlib.nullcontext():
            started = time.perf_counter()
            train_local(model, x, y, job.train, seed=SEED, steps=steps)
            return time.perf_counter() - started, model

    try:
        _, warm = run(steps=WARMUP_STEPS)   # helpers started, their data loaded, torch's first-call costs paid
        timed = [run() for _ in range(repeats)]
    finally:
        if team is not None:
            team.close()
    states = {"warmup": state_to_numpy(warm), "trained": state_to_numpy(timed[-1][1])}
    return [seconds for seconds, _ in timed], states, len(y), job.train


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process and its ended children) so far."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")   # all but idle and iowait
    mine = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return busy, mine


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts; 1 is the baseline")
    p.add_argument("--cases", default="fmnist,heart")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads per worker (default: cores // workers)")
    p.add_argument("--fmnist-rows", type=int, default=20000, help="Fashion-MNIST: first N training images, 1 epoch")
    p.add_argument("--heart-epochs", type=int, default=1000)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    known = cases(args.fmnist_rows, args.heart_epochs)
    unknown = [c for c in args.cases.split(",") if c not in known]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {sorted(known)}")
    worker_counts = sorted({int(w) for w in args.workers.split(",")})
    cores = os.cpu_count() or 1
    result = {"what": "site_workers", "command": " ".join(["python -m bench.site_workers",
                                                             *(argv if argv is not None else sys.argv[1:])]),
              "machine": {"platform": platform.platform(), "cores": cores, "loadavg_at_start": os.getloadavg(),
                          "torch": torch.__version__}, "cases": []}
    for name in args.cases.split(","):
        job_yaml, dataset = known[name]
        baseline = None
        for workers in worker_counts:
            threads = args.threads or max(1, cores // workers)
            (busy, mine), started = cpu_seconds(), time.monotonic()
            seconds, states, rows, train = measure(job_yaml, dataset, workers, threads, args.repeats)
            (busy_end, mine_end), wall = cpu_seconds(), time.monotonic() - started
            median = statistics.median(seconds)
            row = {"case": name, "workers": workers, "threads_per_worker": threads, "rows": rows,
                   "epochs": train.epochs, "batch_size": train.batch_size, "seconds": median,
                   "seconds_each": seconds, "samples_per_s": rows * train.epochs / median,
                   "other_programs_cpu_share": max(0.0, (busy_end - busy) - (mine_end - mine)) / (cores * wall)}
            if workers == 1:
                baseline = (row, states)
            elif baseline is not None:
                row["ratio_vs_1"] = row["samples_per_s"] / baseline[0]["samples_per_s"]
                for when, state in states.items():
                    row[f"max_abs_diff_vs_1_{when}"] = max_abs_diff(state, baseline[1][when])
            result["cases"].append(row)
            print(json.dumps(row), flush=True)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
