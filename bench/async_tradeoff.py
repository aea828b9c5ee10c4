"""Synchronous vs asynchronous training with stragglers: accuracy against wall-clock time.

    python -m bench.async_tradeoff [--quick] [--seeds 3] [--cases fmnist,heart] [--methods ...] [--out DIR]

What runs: a whole federation in one process, through the real engine. A `coordinator.store.Store` in a
temp dir and a `coordinator.engine.Engine` (its thread never started: the loop here calls `engine.tick()`)
run the job as submitted (`Engine.submit`, the model built by the model worker); the sites call the
engine's public site calls directly (join, next_task, model_for, submit_update, report; no gRPC, TLS or
processes) and train with the site's own code (`site_agent.local.local_update`, the task's seed and
local_steps). Synchronous FedAvg is a round config without `asynchronous:` (the engine's SyncRounds);
FedAsync and FedBuff are the same config with an `asynchronous:` block (coordinator/drivers/async_.py).
This module does not know which driver runs: every method goes through the same loop.

Virtual time. The engine's wall and monotonic clocks (and the store's) are one virtual clock that only this
loop moves. A site that starts a task at virtual time t finishes it at
    t + (the task's minibatch steps) × step_s × slowdown(site) + transfer_s,
and its update reaches the engine then. step_s is a constant measured once on the development machine
(the mean real seconds of one minibatch step of the case's model on 1 core, `STEP_S`); slowdown is the
site's speed handicap; transfer_s is a fixed per-task fetch + upload time. Events are processed in
virtual-time order (ties by site name); whenever the clock moves, every idle site polls for a task, so a
site that finishes picks up its next task at once (asynchronous) or waits for the next round (synchronous).
So virtual time is the wall-clock of a federation in which every hospital computes in parallel at its own
speed, while the real compute happens here, one task after another. Results are deterministic (seeded)
and do not depend on this machine's load. The real seconds per step are measured again in every run and
reported beside STEP_S.

Evaluation is outside virtual time: after a run, the global model of the versions (synchronous: rounds)
is read back from the store's checkpoints and scored on the case's test set: every version until the
job has aggregated as many updates as synchronous FedAvg does in all its rounds, at most one per
`eval_every` updates (FedAsync makes a version per update); coarser after that; and always the version
standing at the equal-update and equal-time comparison points and the last one.

Cases (see bench/README.md): Fashion-MNIST, cnn, Dirichlet(0.3) over 8 sites, one site 5× and two 2× slower,
the same local steps per task for every method; Fed-Heart-Disease, the four hospitals at equal speed,
one epoch per task (so a task's time ∝ its hospital's rows). Asynchronous methods run until the virtual
time synchronous FedAvg of the same seed took to finish, so they are compared at an equal wall-clock and,
on the way, at an equal number of aggregated updates.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from coordinator.drivers.sync import SyncRounds
from coordinator.engine import Engine
from coordinator.store import Store
from coordinator.tasks import Binding, JoinInfo, TaskGrant, TaskResult, UpdateHeader
from plexus.config import MAX_WAIT_S, DatasetSpec, RoundConfig, parse_round_config
from plexus.datasets import HOSPITALS, Split, load_dataset
from plexus.errors import PlexusError
from plexus.models import build_job_model, load_numpy_state, state_views
from plexus.vocab import TERMINAL, TaskKind, TaskStatus
from plexus.wire import assemble, decode, encode, iter_chunks
from site_agent.local import local_update, served_layout
from site_agent.training import evaluate

# Mean real seconds of one minibatch step on this repository's 2-core development VM (1 torch thread,
# measured over 2 × 200 steps after a warm-up): cnn {width: 16}, batch 32, on a Fashion-MNIST site;
# logistic {in_features: 13}, batch 16, on Cleveland's rows.
STEP_S = {"cnn": 4.6e-3, "logistic": 1.0e-4}
# Fashion-MNIST's fixed fetch + upload time per task: the 82 KB cnn down and back up (~70 Mbit/s and latency).
TRANSFER_S = 0.02
T0 = 1_000_000.0           # the virtual clock's origin (times are reported relative to it)
NEVER = MAX_WAIT_S         # deadlines and windows the virtual run never reaches: a day, the most a config allows
CHUNK_BYTES = 64 << 10


@dataclass(frozen=True)
class Method:
    """One row: a label and the round config's `asynchronous:` block (None: synchronous rounds)."""

    label: str
    asynchronous: dict | None = None

    @property
    def buffer(self) -> int:
        return 0 if self.asynchronous is None else self.asynchronous["buffer"]


# Staleness τ is at most ~30 versions here (FedAsync, the 5× site); max_staleness is set above that so no
# update is refused and staleness acts only through its weight s(τ).
MAX_STALENESS = 100
POLY = {"fn": "polynomial", "a": 0.5}
METHODS = {
    "sync": Method("sync FedAvg"),
    "fedasync": Method("FedAsync (K=1, α=0.6)", {"buffer": 1, "mixing": 0.6, "staleness": POLY,
                                                  "max_staleness": MAX_STALENESS}),
    "fedbuff2": Method("FedBuff K=2", {"buffer": 2, "staleness": POLY, "max_staleness": MAX_STALENESS}),
    "fedbuff4": Method("FedBuff K=4", {"buffer": 4, "staleness": POLY, "max_staleness": MAX_STALENESS}),
}


@dataclass(frozen=True)
class Case:
    """One dataset: the sites (data and speed), the test set, the training recipe and the clock's constants."""

    name: str
    dataset: str                   # the round config's data.dataset, and the name sites map it under
    sites: dict[str, Split]
    slowdown: dict[str, float]
    x_test: np.ndarray
    y_test: np.ndarray
    model: dict
    train: dict                    # the round config's train section
    rounds: int                    # synchronous FedAvg's R
    target: float                  # the accuracy whose time-to-reach is reported
    step_s: float
    transfer_s: float
    methods: tuple[str, ...]
    eval_every: int = 1            # evaluate at most one version per this many aggregated updates...
    eval_every_after: int = 1      # ...and per this many once past synchronous FedAvg's update count
    setup: dict = field(default_factory=dict)

    @property
    def updates(self) -> int:
        """U: the updates synchronous FedAvg aggregates (every site, every round)."""
        return self.rounds * len(self.sites)

    def duration(self, site: str, steps: int) -> float:
        return steps * self.step_s * self.slowdown[site] + self.transfer_s


def fmnist_case(quick: bool) -> Case:
    """8 sites of a Dirichlet(0.3) label-skew split of Fashion-MNIST; site-0 5× slower, site-1/site-2 2×."""
    n, alpha, limit = 8, 0.3, (4000 if quick else None)
    sites = {f"site-{i}": load_dataset(DatasetSpec(kind="fashion-mnist", sites=n, index=i, alpha=alpha, split_seed=0,
                                                   limit=limit)) for i in range(n)}
    slowdown = {s: 1.0 for s in sites} | {"site-0": 5.0, "site-1": 2.0, "site-2": 2.0}
    first = next(iter(sites.values()))
    steps, rounds = (10, 4) if quick else (25, 24)
    return Case(
        name="fmnist", dataset="fashion-mnist", sites=sites, slowdown=slowdown,
        x_test=first.x_test[:2000] if quick else first.x_test, y_test=first.y_test[:2000] if quick else first.y_test,
        model={"name": "cnn", "args": {"width": 16}},
        train={"steps": steps, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.1}},
        rounds=rounds, target=0.6 if quick else 0.80, step_s=STEP_S["cnn"], transfer_s=TRANSFER_S,
        methods=("sync", "fedasync", "fedbuff2", "fedbuff4"), eval_every=4, eval_every_after=4 if quick else 16,
        setup={"sites": n, "alpha": alpha, "split_seed": 0, "limit": limit,
               "rows_per_site": {s: len(d.y_train) for s, d in sites.items()},
               "test": "t10k (first 2,000)" if quick else "t10k (10,000, balanced)"})


def heart_case(quick: bool) -> Case:
    """The four FLamby hospitals at equal speed; one epoch per task, so a task's time is ∝ its hospital's rows."""
    sites = {h: load_dataset(DatasetSpec(kind="heart-disease", hospital=h)) for h in HOSPITALS}
    return Case(
        name="heart", dataset="heart-disease", sites=sites, slowdown={h: 1.0 for h in sites},
        x_test=np.concatenate([s.x_test for s in sites.values()]),
        y_test=np.concatenate([s.y_test for s in sites.values()]),
        model={"name": "logistic", "args": {"in_features": 13, "num_classes": 2}},
        train={"epochs": 1, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.05}},
        rounds=5 if quick else 50, target=0.78, step_s=STEP_S["logistic"], transfer_s=0.0,
        methods=("sync", "fedbuff2", "fedasync"),
        setup={"sites": list(sites), "rows_per_site": {s: len(d.y_train) for s, d in sites.items()},
               "test": "union of the 4 hospitals' test rows"})


CASES = {"fmnist": fmnist_case, "heart": heart_case}


@functools.cache
def case_for(name: str, quick: bool) -> Case:
    """Each worker process loads a case's data once."""
    return CASES[name](quick)


JOB = """\
name: async-tradeoff-{method}
model: {model}
data: {{dataset: {dataset}}}
rounds: {rounds}
strategy: {{name: fedavg}}
sites: {sites}
train: {train}
seed: {seed}
"""


def job_yaml(case: Case, name: str, seed: int, *, versions: int, time_budget_s: float | None = None) -> str:
    """The round config a real job would be submitted with (JSON is YAML flow syntax). Every job starts once
    all sites are online; no deadline is ever reached (synchronous rounds wait for every site)."""
    method = METHODS[name]
    sites = {"min": len(case.sites), "deadline_s": NEVER}
    text = JOB.format(method=name, model=json.dumps(case.model), dataset=case.dataset,
                      rounds=versions, sites=json.dumps(sites), train=json.dumps(case.train), seed=seed)
    if method.asynchronous is not None:
        spec = dict(method.asynchronous, idle_timeout_s=NEVER)
        if time_budget_s is not None:
            spec["time_budget_s"] = time_budget_s
        text += f"asynchronous: {json.dumps(spec)}\n"
    return text


class VirtualClock:
    """The one clock of a run: the engine's wall and monotonic clocks and the store's. Moves only when set."""

    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Chunk(NamedTuple):
    offset: int
    data: bytes


@dataclass
class Pending:
    """A task being trained: what the site uploads when its virtual time comes."""

    site: str
    grant: TaskGrant
    header: UpdateHeader
    blob: bytearray
    start: float
    steps: int
    commit: object


@dataclass
class Trace:
    """What one run did: versions as they appeared, every task, and the real time it took."""

    versions: list[dict] = field(default_factory=list)   # {"version", "t", "updates"}
    tasks: list[dict] = field(default_factory=list)      # {"site", "start", "end", "steps", "from", "tau", "outcome"}
    steps: int = 0
    train_s: float = 0.0


def simulate(case: Case, name: str, seed: int, work: Path, *,
             horizon: float | None = None) -> tuple[str, Trace, Store]:
    """Run one job to its end; the job id, the trace and the store, whose checkpoints hold every version.

    Synchronous: `rounds` rounds. Asynchronous with a horizon: the driver's own asynchronous.time_budget_s
    ends training at that virtual time (the job's versions are a bound never reached); without one, as
    many versions as make synchronous FedAvg's number of updates."""
    method = METHODS[name]
    clock = VirtualClock()
    store = Store(work / "state", clock=clock)
    engine = Engine(store, poll_timeout_s=NEVER, clock=clock, monotonic=clock)
    for site, data in case.sites.items():
        engine.join(site, JoinInfo(agent_version="bench", models=(case.model["name"],), datasets=(case.dataset,),
                                   dataset_rows={case.dataset: len(data.y_train)}))
    if method.asynchronous is None:
        versions = case.rounds
    elif horizon is not None:
        versions = min(100_000, 50 * case.updates)
    else:
        versions = math.ceil(case.updates / method.buffer)
    job_id = engine.submit(job_yaml(case, name, seed, versions=versions, time_budget_s=horizon), who="bench")
    trace = Trace(versions=[{"version": 0, "t": 0.0, "updates": 0}])
    busy: dict[str, Pending] = {}
    due: list[tuple[float, str]] = []
    accepted = 0
    idle_for = 0.0
    while True:
        wait = _tick(engine)
        if method.asynchronous is not None and isinstance(engine.driver, SyncRounds):
            raise RuntimeError(f"{method.label}: the engine runs this asynchronous config with SyncRounds "
                               "(coordinator/drivers/async_.py is missing or not chosen by Engine._activate_next)")
        row = store.job(job_id)
        while row.current_round > trace.versions[-1]["version"]:   # a new version (round) exists
            trace.versions.append({"version": trace.versions[-1]["version"] + 1, "t": round(clock.now - T0, 9),
                                   "updates": accepted})
        if row.status in TERMINAL:
            break
        if horizon is not None and clock.now - T0 > 2 * horizon:
            raise RuntimeError(f"{method.label}: asynchronous.time_budget_s = {horizon:g} did not end training by "
                               f"virtual time {clock.now - T0:g} s")
        started = False
        for site in sorted(set(case.sites) - set(busy)):
            grant = engine.next_task(site, 0.0)
            if grant is None:
                continue
            started = True
            if grant.kind == TaskKind.TRAIN:
                busy[site] = _train(engine, case, site, grant, work, clock.now, trace)
                heapq.heappush(due, (clock.now + case.duration(site, busy[site].steps), site))
            elif grant.kind == TaskKind.EVALUATE:   # the final evaluation round: scored here, not by the sites
                engine.report(site, TaskResult(_binding(grant), TaskStatus.EVALUATED))
            else:
                raise RuntimeError(f"{method.label}: site {site} got a {grant.kind} task; this bench runs "
                                   "without secure aggregation")
        if started:
            continue
        if not due:   # nothing to train and no task given: the engine waits for its own reason
            idle_for += max(wait, 1e-3)
            if idle_for > 3600:
                raise RuntimeError(f"{method.label}: the job stalled at virtual time {clock.now - T0:.3f} s: "
                                   f"{store.job(job_id).message or 'no task for any site'}")
            clock.now += max(wait, 1e-3)
            continue
        idle_for = 0.0
        clock.now, site = heapq.heappop(due)
        accepted += _upload(engine, busy.pop(site), clock.now, trace)
    _check_updates(store, job_id, trace)
    return job_id, trace, store


def _check_updates(store: Store, job_id: str, trace: Trace) -> None:
    """Each version's cumulative update count as the store's round rows name its contributors (the driver's own
    account); the loop's count of accepted uploads at the moment the version appeared must agree."""
    made = {r.round: len(json.loads(r.contributors)) for r in store.rounds(job_id)
            if r.kind == TaskKind.TRAIN and r.status == "closed"}
    total = 0
    for v in trace.versions[1:]:
        total += made[v["version"]]
        if total != v["updates"]:
            raise RuntimeError(f"version {v['version']}: the store's rounds name {total} updates so far, but "
                               f"{v['updates']} were accepted when it appeared")


def _tick(engine: Engine) -> float:
    """Engine ticks until it wants to wait (a closed round opens the next at once); the wait it asks for."""
    for _ in range(100):
        wait = engine.tick()
        if wait > 0:
            return wait
    return 0.0


def _binding(grant: TaskGrant) -> Binding:
    return Binding(grant.task_id, grant.job_id, grant.round, grant.nonce)


def _train(engine: Engine, case: Case, site: str, grant: TaskGrant, work: Path, now: float, trace: Trace) -> Pending:
    """What SiteAgent.handle does for a training task, the call path without gRPC: fetch, train, encode."""
    job = parse_round_config(grant.config_yaml, source=f"job {grant.job_id}")
    model = build_job_model(job)
    expected = served_layout(job, model)
    served_model, _, _ = engine.model_for(site, grant.task_id)
    expected.require_same(served_model.layout, what="the coordinator's model")
    served = decode(expected, assemble(expected, (Chunk(o, d) for o, d in served_model.chunks(CHUNK_BYTES))))
    names = set(model.state_dict())
    load_numpy_state(model, {k: v for k, v in served.items() if k in names})
    t = time.perf_counter()
    local = local_update(job, model, served, case.sites[site], site=site, job_id=grant.job_id, seed=grant.seed,
                         local_steps=grant.local_steps, state_dir=work / "sites" / site)
    trace.train_s += time.perf_counter() - t
    trace.steps += local.result.steps
    layout, blob = encode({**local.update, **state_views(model)})
    header = UpdateHeader(task=_binding(grant), num_samples=local.result.num_samples, layout=layout,
                          metrics=local.result.metrics)
    return Pending(site, grant, header, blob, now, local.result.steps, local.commit)


def _upload(engine: Engine, task: Pending, now: float, trace: Trace) -> int:
    """The site's upload as its virtual time comes; 1 if the engine accepted it."""
    version = trace.versions[-1]["version"]
    try:
        engine.submit_update(task.site, task.header, ((o, bytes(d)) for o, d in iter_chunks(task.blob, CHUNK_BYTES)))
        outcome, ok = "accepted", 1
        task.commit()
    except PlexusError as exc:   # refused (too stale, round closed): the site's work is lost
        outcome, ok = f"refused: {exc}", 0
    trace.tasks.append({"site": task.site, "start": round(task.start - T0, 9), "end": round(now - T0, 9),
                        "steps": task.steps, "from": task.grant.model_round,
                        "tau": version - task.grant.model_round, "outcome": outcome})
    return ok


def to_evaluate(case: Case, versions: list[dict], horizon: float) -> list[int]:
    """The versions to score: the next one at least eval_every updates after the last one scored (eval_every_after
    past U), the last with at most U updates and the first with U or more, the last at or before the horizon,
    and the last."""
    chosen, scored = {0}, 0
    for v in versions[1:]:
        stride = case.eval_every if v["updates"] <= case.updates else case.eval_every_after
        if v["updates"] - scored >= stride:
            chosen.add(v["version"])
            scored = v["updates"]
    chosen.add(versions[-1]["version"])
    for pick in (_last(versions, lambda v: v["updates"] <= case.updates),
                 _first(versions, lambda v: v["updates"] >= case.updates),
                 _last(versions, lambda v: v["t"] <= horizon)):
        if pick is not None:
            chosen.add(pick["version"])
    return sorted(chosen)


def _last(items, pred):
    return next((x for x in reversed(items) if pred(x)), None)


def _first(items, pred):
    return next((x for x in items if pred(x)), None)


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 1000) -> float:
    """Test accuracy by the site's own `evaluate`, over slices (one 10k batch is 2× slower on this CPU)."""
    right = sum(evaluate(model, x[i:i + batch], y[i:i + batch])["accuracy"] * len(y[i:i + batch])
                for i in range(0, len(y), batch))
    return right / len(y)


def run_one(case: Case, method_name: str, seed: int, root: Path, horizon: float | None = None) -> dict:
    """One (case, method, seed): simulate, then score the versions; a JSON-ready record."""
    work = root / f"{case.name}-{method_name}-{seed}"
    t0 = time.monotonic()
    job_id, trace, store = simulate(case, method_name, seed, work, horizon=horizon)
    simulated = time.monotonic() - t0
    try:
        finish = trace.versions[-1]["t"]
        picks = to_evaluate(case, trace.versions, finish if horizon is None else horizon)
        cfg: RoundConfig = parse_round_config(store.job(job_id).config_yaml)
        model = build_job_model(cfg)
        for v in trace.versions:
            if v["version"] in picks:
                load_numpy_state(model, store.load_checkpoint(job_id, v["version"]))
                v["accuracy"] = accuracy(model, case.x_test, case.y_test)
        row = store.job(job_id)
    finally:
        store.close()
    return {"case": case.name, "method": method_name, "seed": seed, "job_status": row.status,
            "job_message": row.message, "versions": trace.versions, "tasks": trace.tasks,
            "finish_t": finish, "horizon": horizon,
            "updates_accepted": sum(t["outcome"] == "accepted" for t in trace.tasks),
            # refused while training went on (too stale); tasks still running when it ended are not counted
            "refused": sum(t["outcome"] != "accepted" and t["end"] <= finish for t in trace.tasks),
            "sites": site_summary(case, trace.tasks), "staleness": staleness_histogram(trace.tasks),
            "real_s_per_step": trace.train_s / max(1, trace.steps), "steps": trace.steps,
            "simulate_s": simulated, "evaluate_s": time.monotonic() - t0 - simulated}


def site_summary(case: Case, tasks: list[dict]) -> dict:
    """Per site: tasks run, updates accepted, virtual seconds per task, and the staleness of its accepted updates."""
    out = {}
    for site in case.sites:
        mine = [t for t in tasks if t["site"] == site]
        taus = [t["tau"] for t in mine if t["outcome"] == "accepted"]
        out[site] = {"slowdown": case.slowdown[site], "tasks": len(mine), "accepted": len(taus),
                     "task_s": float(np.mean([t["end"] - t["start"] for t in mine])) if mine else None,
                     "mean_tau": float(np.mean(taus)) if taus else None, "max_tau": max(taus, default=None)}
    return out


def staleness_histogram(tasks: list[dict]) -> dict[int, int]:
    """τ -> accepted updates with that staleness."""
    counts: dict[int, int] = {}
    for t in tasks:
        if t["outcome"] == "accepted":
            counts[t["tau"]] = counts.get(t["tau"], 0) + 1
    return dict(sorted(counts.items()))


def for_json(run: dict) -> dict:
    """A run as the results file keeps it: the scored versions as [version, t, updates, accuracy] rows, and
    the per-site summary instead of every task."""
    kept = {k: v for k, v in run.items() if k not in ("versions", "tasks")}
    return {**kept, "versions_made": run["versions"][-1]["version"],
            "curve": [[v["version"], v["t"], v["updates"], v["accuracy"]] for v in evaluated(run)]}


def async_driver_present() -> bool:
    """Whether this tree has the asynchronous driver (coordinator/drivers/async_.py)."""
    return importlib.util.find_spec("coordinator.drivers.async_") is not None


def _work(case_name: str, quick: bool, method: str, seed: int, root: str, horizon: float | None) -> dict:
    torch.set_num_threads(1)
    return run_one(case_for(case_name, quick), method, seed, Path(root), horizon)


# Summaries ---------------------------------------------------------------------------------------------
def evaluated(run: dict) -> list[dict]:
    return [v for v in run["versions"] if "accuracy" in v]


def time_to(run: dict, target: float) -> float | None:
    hit = _first(evaluated(run), lambda v: v["accuracy"] >= target)
    return None if hit is None else hit["t"]


def accuracy_at_time(run: dict, t: float) -> float:
    return _last(evaluated(run), lambda v: v["t"] <= t + 1e-9)["accuracy"]


def accuracy_at_updates(run: dict, updates: int) -> float:
    return _last(evaluated(run), lambda v: v["updates"] <= updates)["accuracy"]


def stats(values: list[float | None]) -> dict:
    got = [v for v in values if v is not None]
    arr = np.asarray(got, dtype=np.float64)
    return {"mean": float(arr.mean()) if got else None, "std": float(arr.std(ddof=1)) if len(got) > 1 else 0.0,
            "reached": len(got), "of": len(values), "values": values}


def summarise(case: Case, runs: list[dict]) -> dict:
    """Per method, over seeds: time to target and its ratio to sync, accuracy at sync's finish, at U updates."""
    sync = {r["seed"]: r for r in runs if r["method"] == "sync"}
    out = {}
    for name in case.methods:
        mine = sorted((r for r in runs if r["method"] == name), key=lambda r: r["seed"])
        if not mine:
            continue
        times = [time_to(r, case.target) for r in mine]
        ratios = [_ratio(t, time_to(sync[r["seed"]], case.target)) for r, t in zip(mine, times)]
        best = [max(evaluated(r), key=lambda v: v["accuracy"]) for r in mine]
        taus = Counter()
        for r in mine:
            taus.update(r["staleness"])
        out[name] = {
            "label": METHODS[name].label,
            "time_to_target": stats(times), "ratio_to_sync": stats(ratios),
            "acc_at_sync_finish": stats([accuracy_at_time(r, sync[r["seed"]]["finish_t"]) for r in mine]),
            "acc_at_equal_updates": stats([accuracy_at_updates(r, case.updates) for r in mine]),
            "final_acc": stats([evaluated(r)[-1]["accuracy"] for r in mine]),
            "best_acc": stats([b["accuracy"] for b in best]), "time_to_best": stats([b["t"] for b in best]),
            "updates_by_sync_finish": stats([float(_last(r["versions"], lambda v, r=r: v["t"] <= sync[r["seed"]]
                                                         ["finish_t"] + 1e-9)["updates"]) for r in mine]),
            "mean_staleness": sum(t * n for t, n in taus.items()) / max(1, taus.total()),
            "max_staleness": max(taus, default=0),
            "refused": sum(r["refused"] for r in mine),
        }
    return out


def _ratio(t: float | None, sync_t: float | None) -> float | None:
    """t / sync's time; None when either never reached the target (or sync had it from the start)."""
    return None if t is None or not sync_t else t / sync_t


def fmt(s: dict, digits: int = 3) -> str:
    if s["mean"] is None:
        return f"not reached (0/{s['of']})"
    text = f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
    return text if s["reached"] == s["of"] else f"{text} ({s['reached']}/{s['of']} reached)"


def table(case: Case, summary: dict) -> str:
    t = case.target
    head = ["method", f"time to {t:.2f} (s)", "× sync", "acc at sync's finish", f"acc at {case.updates} updates",
            "final acc", "best acc", "mean τ"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    digits = 2 if case.step_s > 1e-3 else 4
    for s in summary.values():
        lines.append("| " + " | ".join([s["label"], fmt(s["time_to_target"], digits), fmt(s["ratio_to_sync"], 2),
                                        fmt(s["acc_at_sync_finish"]), fmt(s["acc_at_equal_updates"]),
                                        fmt(s["final_acc"]), fmt(s["best_acc"]), f"{s['mean_staleness']:.1f}"]) + " |")
    return "\n".join(lines)


def goal(case: Case, summary: dict) -> list[str]:
    """The issue's goal: FedBuff reaches the target in ≤ 0.5× sync's wall-clock and, at an equal number of
    updates, is within 1 point of sync's accuracy."""
    sync = summary.get("sync")
    out = []
    for name in ("fedbuff2", "fedbuff4"):
        s = summary.get(name)
        if s is None or sync is None:
            continue
        ratio = s["ratio_to_sync"]["mean"]
        gap = s["acc_at_equal_updates"]["mean"] - sync["acc_at_equal_updates"]["mean"]
        fast = ratio is not None and s["ratio_to_sync"]["reached"] == s["ratio_to_sync"]["of"] and ratio <= 0.5
        close = gap >= -0.01
        speed = "not measurable (not reached)" if ratio is None else f"{ratio:.2f}× sync's"
        out.append(f"{case.name} {s['label']}: time to {case.target:.2f} {speed} ({'≤' if fast else 'NOT ≤'} 0.5); "
                   f"accuracy at {case.updates} updates {gap * 100:+.1f} points vs sync "
                   f"({'within' if close else 'NOT within'} 1 point): goal {'MET' if fast and close else 'NOT met'}")
    return out


def chart(cases: list[Case], runs: list[dict], path: Path) -> None:
    """Test accuracy against virtual wall-clock, one panel per case: mean over seeds (a step curve on a common
    grid), the seeds' range shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(6.5 * len(cases), 4.6), squeeze=False)
    colors = {"sync": "black", "fedasync": "tab:orange", "fedbuff2": "tab:blue", "fedbuff4": "tab:green"}
    for ax, case in zip(axes[0], cases):
        mine = [r for r in runs if r["case"] == case.name]
        end = max(r["finish_t"] for r in mine if r["method"] == "sync")
        grid = np.linspace(0.0, end, 400)
        for name in case.methods:
            curves = []
            for r in (r for r in mine if r["method"] == name):
                pts = evaluated(r)
                ts, accs = np.array([p["t"] for p in pts]), np.array([p["accuracy"] for p in pts])
                curves.append(accs[np.searchsorted(ts, grid, side="right") - 1])
            if not curves:
                continue
            curves = np.array(curves)
            ax.step(grid, curves.mean(0), where="post", color=colors[name], label=METHODS[name].label)
            ax.fill_between(grid, curves.min(0), curves.max(0), step="post", color=colors[name], alpha=0.15)
        ax.axhline(case.target, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("virtual wall-clock (s)")
        ax.set_ylabel("test accuracy")
        ax.set_xlim(0, end)
        seeds = len({r["seed"] for r in mine})
        ax.set_title(f"{case.name}: mean of {seeds} seed(s), range shaded")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(cases: list[str], seeds: list[int], *, quick: bool, jobs: int, methods: list[str] | None,
            started: float) -> list[dict]:
    """Synchronous runs first (their finish time is the asynchronous runs' horizon), then the rest."""
    runs: list[dict] = []
    context = multiprocessing.get_context("fork")   # the parent never runs torch ops before forking
    with tempfile.TemporaryDirectory(prefix="plexus-bench-async-") as tmp, \
            ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        def run(cells):
            futures = [(cell, pool.submit(_work, cell[0], quick, cell[1], cell[2], tmp, cell[3])) for cell in cells]
            for (c, m, seed, _), future in futures:
                r = future.result()
                runs.append(r)
                print(f"[{time.monotonic() - started:7.1f}s] {c} {m} seed {seed}: {len(r['versions']) - 1} versions, "
                      f"{r['updates_accepted']} updates, finish {r['finish_t']:.4g} s virtual, final acc "
                      f"{evaluated(r)[-1]['accuracy']:.3f}; {r['simulate_s']:.0f}s + {r['evaluate_s']:.0f}s real, "
                      f"{r['real_s_per_step'] * 1e3:.2f} ms/step real", flush=True)
        wanted = {c: [m for m in case_for(c, quick).methods if methods is None or m in methods or m == "sync"]
                  for c in cases}
        if not async_driver_present():
            print("coordinator/drivers/async_.py is not in this tree: the asynchronous methods are skipped",
                  flush=True)
            wanted = {c: ["sync"] for c in cases}
        run([(c, "sync", seed, None) for c in cases for seed in seeds])
        finish = {(r["case"], r["seed"]): r["finish_t"] for r in runs}
        run([(c, m, seed, finish[(c, seed)]) for c in cases for m in wanted[c] if m != "sync" for seed in seeds])
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small, fast run (4k F-MNIST images, few steps; ~2 min)")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds 0..N-1 (default 3; 1 with --quick)")
    ap.add_argument("--cases", default="fmnist,heart", help="comma-separated subset of: fmnist, heart")
    ap.add_argument("--methods", default=None, help=f"comma-separated subset of {sorted(METHODS)} (sync always runs)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"),
                    help="folder for async_tradeoff.json and async_tradeoff.png (default bench/results)")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    methods = None if args.methods is None else [m for m in args.methods.split(",") if m]
    unknown = sorted(set(cases) - set(CASES)) + sorted(set(methods or ()) - set(METHODS))
    if unknown:
        ap.error(f"unknown case/method {unknown}; cases: {sorted(CASES)}, methods: {sorted(METHODS)}")
    seeds = list(range(args.seeds if args.seeds is not None else (1 if args.quick else 3)))
    if not seeds or args.jobs < 1:
        ap.error("--seeds and --jobs must be at least 1")

    started = time.monotonic()
    print(f"STEP_S {STEP_S} s per minibatch step (virtual), transfer {TRANSFER_S} s per F-MNIST task", flush=True)
    runs = run_all(cases, seeds, quick=args.quick, jobs=args.jobs, methods=methods, started=started)
    results: dict = {"seeds": seeds, "quick": args.quick, "jobs": args.jobs, "cpus": os.cpu_count(),
                     "python": platform.python_version(), "torch": torch.__version__, "step_s": STEP_S,
                     "transfer_s": TRANSFER_S, "wall_s": time.monotonic() - started, "cases": {}}
    for c in cases:
        case = case_for(c, args.quick)
        mine = [r for r in runs if r["case"] == c]
        summary = summarise(case, mine)
        results["cases"][c] = {
            "config": {"model": case.model, "train": case.train, "rounds": case.rounds, "updates": case.updates,
                       "target": case.target, "step_s": case.step_s, "transfer_s": case.transfer_s,
                       "slowdown": case.slowdown, "eval_every": case.eval_every,
                       "eval_every_after": case.eval_every_after,
                       "methods": {m: METHODS[m].asynchronous for m in case.methods}, **case.setup},
            "summary": summary, "runs": [for_json(r) for r in mine],
            "real_s_per_step": float(np.mean([r["real_s_per_step"] for r in mine])),
        }
        print(f"\n{c}: {case.model['name']} {case.model['args']}, train {case.train}, sync R={case.rounds} "
              f"(U={case.updates} updates), slowdown {case.slowdown}; virtual step {case.step_s} s "
              f"(measured now: {results['cases'][c]['real_s_per_step']:.2e} s), transfer {case.transfer_s} s")
        print(table(case, summary))
        for line in goal(case, summary):
            print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    # One line: ~10k curve points; indented, every number would take a line of its own.
    (args.out / "async_tradeoff.json").write_text(json.dumps(results) + "\n")
    chart([case_for(c, args.quick) for c in cases], runs, args.out / "async_tradeoff.png")
    print(f"\nwall time {results['wall_s']:.0f}s on {os.cpu_count()} CPU(s), {args.jobs} worker(s); results in "
          f"{args.out / 'async_tradeoff.json'} and {args.out / 'async_tradeoff.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
