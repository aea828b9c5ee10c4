"""`plexus simulate`'s side of the simulation benchmark (Flower's side: bench/flower_sim.py).

    python -m bench.simulate trivial --sizes 1M,10M --sites 8,32,128 --rounds 5 \
        --out bench/results/simulate_plexus_trivial.json
    python -m bench.simulate fmnist --rounds 20 --seeds 1 --out bench/results/simulate_plexus_fmnist.json
    python -m bench.simulate scale --sites 1000 --size 1M --rounds 3 --out bench/results/simulate_plexus_scale.json

trivial: the built-in `vector` model of P float32 parameters (4 tensors); every virtual site's "training" adds
its constant 0.001 × (i + 1) (bench/plexus_site.py's BenchSiteAgent, the Flower ClientApp's rule), FedAvg over
all N sites each round. Seconds per round: the median gap between round closes over rounds 2..R (real time),
as on Flower's side. The result is checked: after R rounds every parameter is R × the sites' mean constant.
fmnist: the Fashion-MNIST `cnn` (width 16) over 8 sites of a Dirichlet(0.3) split (split_seed 0, all 60k
rows), R rounds of 1 epoch, batch 32, SGD lr 0.05; accuracy of the final model on t10k. Like Flower's run, the
sites only train (FitOnlyAgent); `--site-evaluation` adds a Plexus job's per-round evaluation at every site.
scale: `trivial` with 1,000 sites: wall time and peak memory.

Memory: a process of its own (bench/memwatch.py) samples VmRSS of this process and every descendant (the
workers, the model worker) every 0.2 s; "peak_total_mb" is the largest sum seen, "peak_process_mb" the largest
VmHWM of any one process; "peak_total_pss_mb" the largest sum of PSS (every 0.5 s, as Flower's side), which
counts a page shared by processes (the workers' shared memory with the simulator) once, split among them, where
the sum of VmRSS counts it in each. Until 2026-12-05 a thread of this process sampled, and counted this
process's VmRSS twice.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.plexus_site import DELTA
from plexus.config import DatasetSpec, PolicySpec, SiteConfig
from plexus.memory import set_up_simulation
from simulation.partition import Partition, virtual_sites
from simulation.pool import ProcessPool
from simulation.simulator import Simulator, final_model
from simulation.worker import DEFAULT_AGENT
from site_agent.agent import SiteAgent

BENCH_AGENT = "bench.plexus_site:BenchSiteAgent"
FIT_ONLY_AGENT = "bench.simulate:FitOnlyAgent"
TRIVIAL_JOB = """\
name: trivial-{size}-{sites}
model: {{name: vector, args: {{size: {size}, chunks: 4}}}}
data: {{dataset: bench}}
rounds: {rounds}
strategy: {{name: fedavg}}
sites: {{min: {sites}, deadline_s: 3600}}
seed: 0
"""
FMNIST_JOB = """\
name: fmnist-cnn
model: {{name: cnn, args: {{width: 16}}}}
data: {{dataset: fashion-mnist}}
rounds: {rounds}
strategy: {{name: fedavg}}
sites: {{min: 8, deadline_s: 3600}}
train: {{epochs: 1, batch_size: 32, optimizer: {{name: sgd, lr: 0.05}}}}
seed: {seed}
"""


class FitOnlyAgent(SiteAgent):
    """The real site agent, but it does not evaluate the incoming global model on its held-out rows each round:
    Flower's run (fraction_evaluate 0) trains only, and the final model is evaluated once, here, on t10k."""

    def evaluate(self, model, data) -> dict[str, float]:
        return {}


class Memory:
    """Peak summed VmRSS of this process tree (this process and its descendants, each once), the largest single
    VmHWM and the peak summed PSS, sampled by bench/memwatch.py in a process of its own."""

    def __init__(self):
        self.peak_total_kb = self.peak_process_kb = self.peak_pss_kb = 0

    def __enter__(self):
        self._watch = subprocess.Popen([sys.executable, "-m", "bench.memwatch", str(os.getpid())],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       cwd=Path(__file__).resolve().parents[1])
        return self

    def __exit__(self, *exc):
        self._watch.stdin.close()
        peak = json.loads(self._watch.stdout.read())
        self._watch.wait()
        self.peak_total_kb, self.peak_process_kb, self.peak_pss_kb = (
            peak["peak_total_kb"], peak["peak_process_kb"], peak["peak_pss_kb"])


def parse_size(text: str) -> int:
    scale = {"K": 10 ** 3, "M": 10 ** 6}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def bench_sites(count: int) -> dict[str, SiteConfig]:
    """Sites whose dataset `bench` is never read (BenchSiteAgent trains nothing)."""
    placeholder = {"bench": DatasetSpec(kind="heart-disease", hospital="cleveland")}
    return {f"site-{i:04d}": SiteConfig(site=f"site-{i:04d}", coordinator="unused.invalid:1", kit=Path("unused"),
                                        datasets=placeholder, policy=PolicySpec(allowed_models=("vector",)))
            for i in range(count)}


def trivial_case(size: int, sites: int, rounds: int, workers: int, work: Path) -> dict:
    state = work / f"trivial-{size}-{sites}"
    job = TRIVIAL_JOB.format(size=size, sites=sites, rounds=rounds)
    with Memory() as memory:
        outcome = Simulator([job], bench_sites(sites), state, workers=workers, pool=ProcessPool,
                            agent=BENCH_AGENT).run()
    model = final_model(state, outcome.job_id)
    expected = rounds * DELTA * np.mean(np.arange(1, sites + 1))
    worst = max(float(np.max(np.abs(t - expected))) for t in model.values())
    closes = outcome.round_wall_s
    gaps = [b - a for a, b in zip(closes, closes[1:])]
    return {"size": size, "sites": sites, "rounds": rounds, "workers": workers, "status": outcome.status,
            "s_per_round": statistics.median(gaps) if gaps else None, "round_close_s": closes,
            "wall_s": outcome.wall_s, "result_ok": bool(worst < 1e-4 * max(expected, 1.0)), "max_abs_error": worst,
            "peak_total_mb": memory.peak_total_kb / 1024, "peak_process_mb": memory.peak_process_kb / 1024,
            "peak_total_pss_mb": memory.peak_pss_kb / 1024}


def fmnist_case(rounds: int, seed: int, workers: int, work: Path, *, site_evaluation: bool = False) -> dict:
    from plexus.datasets import load_dataset
    from plexus.models import build_model, load_numpy_state
    from simulation.cli import open_policy
    from site_agent.training import evaluate

    state = work / f"fmnist-{seed}"
    made = virtual_sites("fashion-mnist", dataset="fashion-mnist", out_dir=work / f"data-{seed}",
                         partition=Partition("dirichlet", alpha=0.3), sites=8, seed=0)
    policy = open_policy()
    sites = {name: SiteConfig(site=name, coordinator="unused.invalid:1", kit=Path("unused"), datasets=datasets,
                              policy=policy) for name, datasets in made.items()}
    started = time.monotonic()
    with Memory() as memory:
        outcome = Simulator([FMNIST_JOB.format(rounds=rounds, seed=seed)], sites, state, workers=workers,
                            pool=ProcessPool, agent=DEFAULT_AGENT if site_evaluation else FIT_ONLY_AGENT).run()
    wall = time.monotonic() - started
    model = build_model("cnn", {"width": 16}, seed=seed)
    load_numpy_state(model, final_model(state, outcome.job_id))
    test = load_dataset(next(iter(made.values()))["fashion-mnist"])
    accuracy = evaluate(model, test.x_test, test.y_test)["accuracy"]
    first = outcome.round_wall_s[0] if outcome.round_wall_s else 0.0
    return {"seed": seed, "rounds": rounds, "sites_evaluate_each_round": site_evaluation, "status": outcome.status,
            "wall_s": wall,
            "rounds_s": (outcome.round_wall_s[-1] - first) if outcome.round_wall_s else None,
            "first_round_close_s": first, "test_accuracy": accuracy, "test_rows": int(len(test.y_test)),
            "simulated_s": outcome.simulated_s, "peak_total_mb": memory.peak_total_kb / 1024,
            "peak_process_mb": memory.peak_process_kb / 1024, "peak_total_pss_mb": memory.peak_pss_kb / 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["trivial", "fmnist", "scale"])
    p.add_argument("--sizes", default="1M,10M")
    p.add_argument("--size", default="1M")
    p.add_argument("--sites", default="8,32,128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--site-evaluation", action="store_true",
                   help="fmnist: the sites evaluate each round's incoming model on their held-out rows (all of t10k "
                        "each), as a Plexus job does; off by default, as in Flower's run")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    set_up_simulation()   # this process is the simulator, set up as `plexus simulate` sets up its own
    result = {"what": args.what, "command": " ".join(["python -m bench.simulate", *(argv or sys.argv[1:])]),
              "machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                          "loadavg_at_start": os.getloadavg()}, "cases": []}
    with tempfile.TemporaryDirectory(prefix="plexus-bench-simulate-") as tmp:
        work = Path(tmp)
        if args.what == "fmnist":
            for seed in range(args.seeds):
                result["cases"].append(fmnist_case(args.rounds, seed, args.workers, work,
                                                   site_evaluation=args.site_evaluation))
                print(json.dumps(result["cases"][-1]), flush=True)
        else:
            sizes = [parse_size(s) for s in (args.sizes if args.what == "trivial" else args.size).split(",")]
            for size in sizes:
                for sites in (int(n) for n in args.sites.split(",")):
                    result["cases"].append(trivial_case(size, sites, args.rounds, args.workers, work))
                    print(json.dumps(result["cases"][-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
