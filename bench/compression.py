"""Update compression (issue #15): bytes on the wire, accuracy after equal rounds, and time to target over a WAN.

    python -m bench.compression bytes    [--datasets heart,fmnist] [--codecs ...] [--secure-codecs none,int8,randk]
                                         [--sites N] [--rounds 3]
    python -m bench.compression accuracy [--datasets heart,fmnist] [--codecs ...] [--seeds 3] [--rounds R] [--jobs 2]
    python -m bench.compression wan      [--model mlp|vector] [--codecs ...] [--rate 20mbit] [--rtt 40ms]
                                         [--target 0.78] [--max-rounds 30] [--size 10M] [--rounds 5]

A case is a codec label: `UPLINK[/DOWNLINK]`, e.g. `none`, `int8`, `topk`, `int8/delta8`, `int4/delta4`; `sa:LABEL`
adds secure aggregation. `none` is today's federation: the round config has no `compression:` block at all.
topk and randk send `--fraction` (default 0.01) of each tensor; int8 and int4 (and delta8, delta4) use blocks of
256; adacomp its default bins (50 for conv tensors, 500 for the rest). int4 and delta4 are not in the default
case lists (the tables in bench/README.md were measured without them): ask for them with `--codecs`.

bytes: a real federation per case (the coordinator and one `plexus site run` process per site over mutual
TLS, the job submitted with AdminClient), in a private network namespace (bench.run's run_child), each site
dialling its own bench.wan relay (unshaped here) that counts the bytes each way: uplink (site -> coordinator)
and downlink per round. The namespace's lo counters are recorded as well; every site byte crosses lo twice
there (site -> relay -> coordinator), plus the admin client's.

accuracy: in process, like bench.strategies, with the product's own halves: the job's round config, the
coordinator's strategy objects, the site's training (`site_agent.local.local_update`) on the model it decoded
from its download, then the site's coding (`site_agent.uplink`: model_delta, encode_update with its residual and
rounding_rng) and the coordinator's (`plexus.compression.job_uplink`, the codec's check_layout, a
`CodedFold` into the exact `WeightedSum` fed the wire blob in chunks, `base_plus_mean`, the strategy's step).
Accuracy after R rounds on bench.strategies' test sets. `--compare BYTES_JSON` checks each final model against
the real federation's of the same case: equal, bit for bit, for every uplink codec.

wan: a real federation as in `bytes`, each site's relay shaped to `--rate` each way with `--rtt` (RTT/2 per
direction), a model of >= 10M parameters. `--model mlp` (default): a wide MLP on the four heart-disease
hospitals with real training; the figure is the wall-clock from round 1's opening to the close of the first
round whose model reaches `--target` accuracy (the sites' evaluations, weighted by their test rows).
`--model vector`: bench.plexus_site's trivial training on the `vector` model; nothing is learnt, so the
target is a fixed number of rounds (`--rounds`) and the figure the wall-clock they take.
See bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import Fleet, lo_counters, payload, wait_until
from bench.run import netns_available, parse_size, run_child
from bench.wan import Shape, Wan, parse_duration, parse_rate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MiB = 1 << 20

FRACTION = 0.01
UPLINK = {   # codec -> the round config's compression.uplink block (topk/randk get `fraction` added)
    "none": {"codec": "none"},
    "fp16": {"codec": "fp16"},
    "int8": {"codec": "int8"},                 # blocks of 256 (its default; refused under secure aggregation)
    "int4": {"codec": "int4"},                 # blocks of 256; never under secure aggregation (no 4-bit field)
    "randk": {"codec": "randk"},
    "topk": {"codec": "topk"},
    "adacomp": {"codec": "adacomp"},
    # AdaComp with wider bins than the paper's 50/500 (one entry per bin rises above a wider bin's peak less often).
    "adacomp-75": {"codec": "adacomp", "bin_conv": 75, "bin_dense": 750},
    "adacomp-100": {"codec": "adacomp", "bin_conv": 100, "bin_dense": 1000},
}
DOWNLINK = {"none": {"codec": "none"}, "fp16": {"codec": "fp16"}, "delta8": {"codec": "delta8"},   # delta8/4: 256
            "delta4": {"codec": "delta4"}}
CODECS = ("none", "fp16", "int8", "randk", "topk", "adacomp")
SECURE_CODECS = ("none", "int8", "randk")     # topk/adacomp cannot be summed under masks (the spec refuses them)
WAN_CODECS = CODECS + ("int8/delta8",)
SECURE = {"secure_aggregation": True, "secagg": {"phase_timeout_s": 600}}
DEADLINE_S = 900


# --- cases ------------------------------------------------------------------------------------------
def compression_block(case: str, fraction: float = FRACTION) -> dict | None:
    """The round config's `compression:` block for a case label (without its `sa:`); None for `none`."""
    up, _, down = case.removeprefix("sa:").partition("/")
    if up not in UPLINK or (down and down not in DOWNLINK):
        raise ValueError(f"case {case!r}: write UPLINK[/DOWNLINK] with UPLINK one of {sorted(UPLINK)} and "
                         f"DOWNLINK one of {sorted(DOWNLINK)}, optionally prefixed 'sa:' (secure aggregation)")
    if up == "none" and down in ("", "none"):
        return None   # today's federation: no block at all
    uplink = dict(UPLINK[up])
    if up in ("topk", "randk"):
        uplink["fraction"] = fraction
    block = {"uplink": uplink}
    if down:
        block["downlink"] = dict(DOWNLINK[down])
    return block


def compression_available() -> str | None:
    """None when this tree has update compression (plexus.compression and RoundConfig.compression); else why not."""
    from plexus.config import RoundConfig

    missing = []
    if importlib.util.find_spec("plexus.compression") is None:
        missing.append("plexus/compression.py")
    if "compression" not in {f.name for f in dataclasses.fields(RoundConfig)}:
        missing.append("RoundConfig.compression")
    return None if not missing else f"this tree has no {' or '.join(missing)} (issue #15 not merged yet)"


def runnable(cases: list[str], say) -> list[str]:
    why = compression_available()
    if why is None:
        return cases
    skipped = [c for c in cases if compression_block(c) is not None]
    if skipped:
        say(f"note: {why}: skipping {', '.join(skipped)}")
    return [c for c in cases if compression_block(c) is None]


# --- datasets, as bench.strategies defines them (so the `none` rows compare with its fedavg rows) -----------
HEART_MLP = {"name": "mlp", "args": {"in_features": 13, "hidden": [16], "num_classes": 2}}


def heart_sites(n: int) -> dict[str, dict]:
    from plexus.datasets import HOSPITALS

    if not 1 <= n <= len(HOSPITALS):
        raise ValueError(f"heart-disease has {len(HOSPITALS)} hospitals; --sites must be 1..{len(HOSPITALS)}")
    return {h: {"kind": "heart-disease", "hospital": h} for h in HOSPITALS[:n]}


def fmnist_sites(n: int, limit: int = 16000) -> dict[str, dict]:
    return {f"site-{i}": {"kind": "fashion-mnist", "sites": n, "index": i, "alpha": 0.3, "split_seed": 0,
                          "limit": limit} for i in range(n)}


@dataclasses.dataclass(frozen=True)
class Federation:
    """What a real-federation case runs: the sites' datasets, the model, the local training and the job's name
    for the dataset (the config's data.dataset, the key of each site.yaml's `datasets:`)."""

    name: str
    dataset: str
    sites: dict[str, dict | None]      # site name -> its site.yaml dataset entry (None: bench.plexus_site)
    model: dict
    train: dict | None

    @property
    def bench_sites(self) -> bool:
        return self.model["name"] == "vector"


def federation(name: str, sites: int | None = None, **model_args) -> Federation:
    if name == "heart":
        return Federation("heart", "heart-disease", heart_sites(sites or 4), HEART_MLP,
                          {"epochs": 1, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.05}})
    if name == "heart-wide":   # wan: the heart hospitals, an MLP of >= 10M parameters
        hidden = model_args.get("hidden", [3200, 3200])
        return Federation("heart-wide", "heart-disease", heart_sites(sites or 4),
                          {"name": "mlp", "args": {"in_features": 13, "hidden": hidden, "num_classes": 2}},
                          {"epochs": 1, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.05}})
    if name == "fmnist":
        return Federation("fmnist", "fashion-mnist", fmnist_sites(sites or 8), {"name": "cnn", "args": {"width": 16}},
                          {"epochs": 1, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05}})
    if name == "vector":
        size = model_args.get("size", 10_000_000)
        return Federation("vector", "bench", {f"site-{i:02d}": None for i in range(sites or 4)},
                          {"name": "vector", "args": {"size": size, "chunks": 4}}, None)
    raise ValueError(f"unknown dataset {name!r}; use heart, fmnist, heart-wide or vector")


def job_yaml(fed: Federation, case: str, *, rounds: int, seed: int = 0, fraction: float = FRACTION) -> str:
    """The round config a real job is submitted with (JSON is YAML flow syntax)."""
    lines = [f"name: bench-compression-{fed.name}-{case.replace(':', '-').replace('/', '-')}",
             f"model: {json.dumps(fed.model)}", f"data: {{dataset: {fed.dataset}}}", "strategy: {name: fedavg}",
             f"rounds: {rounds}", f"sites: {{min: {len(fed.sites)}, deadline_s: {DEADLINE_S}}}", f"seed: {seed}"]
    if fed.train is not None:
        lines.append(f"train: {json.dumps(fed.train)}")
    block = compression_block(case, fraction)
    if block is not None:
        lines.append(f"compression: {json.dumps(block)}")
    if case.startswith("sa:"):
        lines.append(f"privacy: {json.dumps(SECURE)}")
    return "\n".join(lines) + "\n"


def model_bytes(model: dict) -> int:
    """The model's float32 bytes (built on torch's meta device: shapes, no memory)."""
    import torch

    from plexus.models import build_model

    with torch.device("meta"):
        state = build_model(model["name"], model["args"], seed=0).state_dict()
    return sum(t.numel() * t.element_size() for t in state.values())


def model_digest(state: dict) -> str:
    """SHA-256 of a model's wire blob: the same model, bit for bit, has the same digest."""
    import hashlib

    from plexus.wire import encode

    return hashlib.sha256(encode(state)[1]).hexdigest()


# --- one real federation (runs inside the case's network namespace, see bench.run.child) -------------------
def run_case(spec: dict) -> dict:
    """Coordinator + one site process per site, each behind its own bench.wan relay; per-round bytes each way.

    spec: workdir, dataset, sites, case, rounds, seed, fraction, model_args, rate_bps (None: unshaped),
    rtt_s, target (None: run all rounds), timeout_s."""
    from bench.plexus_side import make_pki
    from plexus.admin_client import AdminClient, mean_eval

    workdir = Path(spec["workdir"])
    fed = federation(spec["dataset"], spec.get("sites"), **spec.get("model_args", {}))
    rounds, target, case = spec["rounds"], spec.get("target"), spec["case"]
    root = workdir / "pki"
    coord_yaml, admin_kit, kits = make_pki(root, 0)
    from plexus import pki

    kits = {name: pki.add_site(root, name) for name in fed.sites}
    fleet = Fleet(workdir / "logs")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PLEXUS_LOG=os.environ.get("PLEXUS_LOG", "WARNING"))
    shape = Shape.wan(spec.get("rate_bps"), spec.get("rtt_s", 0.0))
    result: dict = {"dataset": fed.name, "case": case, "seed": spec.get("seed", 0), "sites": len(fed.sites),
                    "rounds": rounds,
                    "model": fed.model, "train": fed.train, "model_bytes": model_bytes(fed.model),
                    "rate_bps": spec.get("rate_bps"), "rtt_s": spec.get("rtt_s", 0.0), "target": target}
    try:
        fleet.spawn("coordinator", "coordinator",
                    [sys.executable, "-m", "plexus", "coordinator", "run", "--config", str(coord_yaml)],
                    env=env, cwd=REPO)
        addr_file = root / "coordinator" / "state" / "coordinator.addr"
        address = wait_until(lambda: addr_file.exists() and addr_file.read_text().strip(), 120,
                             "the coordinator to listen", fleet)
        host, _, port = address.rpartition(":")
        with Wan() as wan, AdminClient(address, admin_kit, timeout_s=60) as client:
            for name, kit in kits.items():
                relay = wan.link(name, (host, int(port)), up=shape, down=shape)
                data = {fed.dataset: fed.sites[name] or {"kind": "npz", "path": "unused.npz"}}
                (kit / "site.yaml").write_text(
                    f'site: "{name}"\ncoordinator: "127.0.0.1:{relay}"\nkit: "."\nstate_dir: "./state"\n'
                    f"datasets: {json.dumps(data)}\n"
                    "policy: {allowed_models: [cnn, mlp, vector], require_secure_aggregation: false}\n")
                argv = ([sys.executable, "-m", "bench.plexus_site", "--config", str(kit / "site.yaml")]
                        if fed.bench_sites else
                        [sys.executable, "-m", "plexus", "site", "run", "--config", str(kit / "site.yaml"),
                         "--threads", "1"])
                fleet.spawn(name, "site", argv, env=env, cwd=REPO)
            wait_until(lambda: sum(s.online for s in client.sites()) >= len(kits), 300,
                       f"{len(kits)} sites to join", fleet, every_s=0.25)
            marks = [(time.time(), wan.totals(), lo_counters())]   # at submit, then at each round's close
            job_id = client.submit(job_yaml(fed, case, rounds=rounds, seed=spec.get("seed", 0),
                                            fraction=spec.get("fraction", FRACTION))).job_id
            reached = None
            deadline = time.monotonic() + spec.get("timeout_s", 3600)
            for event in client.watch(job_id, timeout_s=spec.get("timeout_s", 3600)):
                if event.kind == "round_closed" and event.round <= rounds:
                    marks.append((time.time(), wan.totals(), lo_counters()))
                    if target is not None:
                        reached = _reached(mean_eval(client.job(job_id)), target)
                        if reached is not None:   # the round after it: its evaluations are in; stop here
                            client.abort(job_id)
                            break
                if event.summary.status in ("completed", "failed", "aborted") or time.monotonic() > deadline:
                    break
            fleet.check_alive()
            end = (time.time(), wan.totals(), lo_counters())
            detail = wait_until(lambda: (d := client.job(job_id)).summary.status in ("completed", "failed", "aborted")
                                and d, 60, "the job to end", fleet)
            per_site = wan.counters()
            version, state = client.download(job_id)   # the latest model: compare with accuracy mode's
            result["final_model"] = {"version": version, "sha256": model_digest(state)}
        result.update(status=detail.summary.status, message=detail.summary.message)
        if detail.summary.status != "completed" and reached is None:
            raise RuntimeError(f"job ended {detail.summary.status}: {detail.summary.message}")
        train = sorted((r for r in detail.rounds if r.status == "closed"), key=lambda r: r.round)
        per_round = []
        for (_, w0, l0), (_, w1, l1) in zip(marks, marks[1:]):
            per_round.append({"up": w1["up"] - w0["up"], "down": w1["down"] - w0["down"],
                              "lo_payload": payload(l1[0] - l0[0], l1[1] - l0[1])})
        result["per_round"] = per_round
        result["round_open_to_close_s"] = [r.closed_unix_s - r.opened_unix_s for r in train]
        result["round_closed_s"] = [r.closed_unix_s - train[0].opened_unix_s for r in train] if train else []
        result["after_last_round"] = {"up": end[1]["up"] - marks[-1][1]["up"],
                                      "down": end[1]["down"] - marks[-1][1]["down"]}   # the final evaluation
        result["per_site_total"] = per_site
        for d in ("up", "down"):
            result[f"{d}_per_round"] = statistics.mean(r[d] for r in per_round) if per_round else None
        evals = mean_eval(detail)
        result["eval"] = {int(v): m for v, m in sorted(evals.items())}
        last = max(evals) if evals else None
        result["final_version"] = last
        result["final_accuracy"] = evals[last].get("accuracy") if last is not None else None
        if target is not None:
            result["reached"] = reached
            result["time_to_target_s"] = None if reached is None else \
                next(r.closed_unix_s for r in train if r.round == reached) - train[0].opened_unix_s
        return result
    finally:
        fleet.stop()


def _reached(evals: dict[int, dict[str, float]], target: float) -> int | None:
    """The first model version whose sites' mean test accuracy is at or above target (version 0: the initial)."""
    hits = [v for v, m in evals.items() if m.get("accuracy", -1.0) >= target]
    return min(hits) if hits else None


def federate(specs: list[dict], *, workroot: Path, timeout_s: float, say) -> list[dict]:
    """Each case in a child process in its own network namespace (bench.run.run_child)."""
    netns = netns_available()
    if not netns:
        say("note: no network namespaces here: lo counters are machine-wide (the relays still count each site)")
    out = []
    for i, spec in enumerate(specs, 1):
        name = f"{i:02d}-{spec['dataset']}-{spec['case'].replace(':', '-').replace('/', '-')}"
        spec = dict(spec, kind="compression", workdir=str(workroot / name))
        Path(spec["workdir"]).mkdir(parents=True)
        say(f"[{i}/{len(specs)}] {spec['dataset']} {spec['case']} ...")
        t0 = time.monotonic()
        res = run_child(spec, netns=netns, timeout_s=timeout_s)
        res.update(wall_s=time.monotonic() - t0, workdir=spec["workdir"], netns=netns)
        res.setdefault("dataset", spec["dataset"])
        res.setdefault("case", spec["case"])
        res.setdefault("seed", spec.get("seed", 0))
        if "error" in res:
            say(f"  FAILED: {res['error']}\n{res.get('stderr', '')[-2000:]}")
        else:
            say(f"  {res['status']}: up {fmt_bytes(res['up_per_round'])}/round, down "
                f"{fmt_bytes(res['down_per_round'])}/round, final accuracy {fmt_acc(res['final_accuracy'])}"
                + ("" if res.get("target") is None else f", target {res['target']} not reached"
                   if res["reached"] is None else f", target {res['target']} reached by version {res['reached']} "
                   f"after {fmt_s(res['time_to_target_s'])}") + f" ({res['wall_s']:.0f}s wall)")
        out.append(res)
    return out


# --- in-process accuracy (bench.strategies' loop, with the codecs) ----------------------------------------
CHUNK_BYTES = 64 << 10


@functools.cache
def task_for(name: str, quick: bool):
    """bench.strategies' Task for the dataset, the heart one with the MLP the issue names."""
    from bench import strategies

    task = strategies.task_for("fmnist" if name == "fmnist" else "heart", quick)
    return dataclasses.replace(task, model=HEART_MLP) if name == "heart" else task


def downlink(spec, current: dict, base: dict | None) -> tuple[dict, int]:
    """What a site trains from this round and the payload bytes of its download. `base`: the model this site
    decoded last round (a delta codec's reference), None before its first; a site that holds no model yet gets the
    chain's start, the delta from zeros, as coordinator.downlink serves it (fp16 ignores any base)."""
    if spec is None or spec.codec == "none":
        return {k: v.copy() for k, v in current.items()}, sum(v.nbytes for v in current.values())
    from plexus.compression import downlink_decode, downlink_encode, zero_base
    from plexus.wire import Layout

    layout = Layout.of(current)
    base = zero_base(layout) if base is None else base
    wire = downlink_encode(spec, current, base)
    return downlink_decode(spec, layout, wire, base), sum(a.nbytes for a in wire.values())


def simulate(task, job, job_id: str, state_root: Path) -> tuple[dict, list[dict]]:
    """R rounds of the job, every site in every round: the final model and per-round payload bytes each way.

    The site's half is site_agent's: local_update, then for a coded uplink model_delta and encode_update (its
    residual; rounding drawn by rounding_rng from the task seed), the residual kept once accepted (always, here).
    The coordinator's half is SyncRounds': the codec's check_layout, a CodedFold per update fed the wire blob in
    64 KiB chunks, base_plus_mean, the strategy's step; without a codec, the exact fold of the whole model."""
    from coordinator.aggregate import CodedFold, WeightedSum
    from coordinator.drivers import sync as rules
    from coordinator.strategies import make_strategy
    from coordinator.tasks import site_seed
    from plexus.models import build_job_model, load_numpy_state, state_to_numpy, state_views
    from plexus.wire import Layout, encode, iter_chunks
    from site_agent.local import local_update

    names = sorted(task.sites)
    strategy = make_strategy(job)
    if rules.holds_updates(strategy):
        raise ValueError(f"{job.strategy.name} holds whole updates; compression runs only on mean rules")
    current = state_to_numpy(build_job_model(job))
    model_layout = Layout.of(current)
    spec = getattr(job, "compression", None)
    coded = spec is not None and spec.uplink.codec != "none"
    if coded:
        from plexus.compression import job_uplink
        from site_agent.uplink import encode_update, model_delta, rounding_rng

        site_codec, coordinator_codec = job_uplink(job), job_uplink(job)   # one for each side, as in a federation
    down_spec = None if spec is None else spec.downlink
    sizes = {s: len(task.sites[s].y_train) for s in names}
    held: dict[str, dict] = {}                # site -> the model it decoded last round
    residuals: dict[str, dict | None] = {}    # site -> its residual (kept once the update was accepted: always)
    stats = []
    for round_ in range(1, job.rounds + 1):
        participants = rules.choose(strategy, round_, names, names)
        rules.opened(strategy, round_, participants, names)
        total = WeightedSum(model_layout)
        up_bytes = down_bytes = 0
        for site in participants:
            start, nbytes = downlink(down_spec, current, held.get(site))
            held[site] = start
            down_bytes += nbytes
            model = build_job_model(job)
            load_numpy_state(model, start)
            seed = site_seed(job.seed, round_, site)
            local = local_update(job, model, {**start, **rules.served_extras(strategy, start)}, task.sites[site],
                                 site=site, job_id=job_id, seed=seed,
                                 local_steps=rules.local_steps(strategy, site, sizes), state_dir=state_root / site)
            weight = 1 if rules.uniform_weights(strategy, None) else local.result.num_samples
            if not coded:   # today: the trained model travels whole
                _, blob = encode(local.update)
                max_abs = max((float(np.abs(a).max()) for a in local.update.values() if a.size), default=0.0)
                total.fold([blob], weight, max_abs, nbytes=len(blob))
            else:
                trained = state_views(model)
                upload = encode_update(site_codec, Layout.of(trained), model_delta(trained, start),
                                       residuals.get(site) if site_codec.feedback else None, round_=round_,
                                       rng=rounding_rng(seed))
                wire_layout, blob = encode(upload.wire)
                coordinator_codec.check_layout(model_layout, wire_layout, round_=round_)
                fold = CodedFold(total, weight, lambda w=wire_layout, r=round_:
                                 coordinator_codec.decoder(model_layout, w, round_=r))
                for _, chunk in iter_chunks(blob, CHUNK_BYTES):
                    fold.add(chunk)
                fold.finish()
                residuals[site] = upload.residual
            up_bytes += len(blob)
            local.commit()
        mean = rules.base_plus_mean(current, total) if coded else total.mean()
        current = rules.aggregate_mean(strategy, round_, current if rules.reads_current(strategy) else None, mean,
                                       sorted(participants))
        current = {k: np.array(v) for k, v in current.items()}
        stats.append({"up": up_bytes, "down": down_bytes})
    return current, stats


def accuracy_cell(dataset: str, case: str, seed: int, rounds: int | None, quick: bool, fraction: float,
                  state_root: str) -> dict:
    """One (dataset, codec, seed): the job, R rounds in process, the final model's scores; in a worker process."""
    import torch

    from bench import strategies
    from plexus.config import parse_round_config
    from plexus.models import build_job_model, load_numpy_state

    torch.set_num_threads(1)
    task = task_for(dataset, quick)
    rounds = rounds or task.rounds
    train = {"epochs": task.epochs, "batch_size": task.batch_size, "optimizer": task.optimizer}
    text = strategies.JOB.format(strategy="fedavg", model=json.dumps(task.model), dataset=task.name, rounds=rounds,
                                 args="{}", train=json.dumps(train), seed=seed)
    block = compression_block(case, fraction)
    if block is not None:
        text += f"compression: {json.dumps(block)}\n"
    job = parse_round_config(text)
    t0 = time.monotonic()
    final, stats = simulate(task, job, f"compression-{dataset}-{case}-{seed}",
                            Path(state_root) / dataset / case.replace("/", "-") / f"seed{seed}")
    model = build_job_model(job)
    load_numpy_state(model, final)
    return {"dataset": dataset, "case": case, "seed": seed, "rounds": rounds, "scores": strategies.scores(model, task),
            "per_round": stats, "final_model_sha256": model_digest(final), "seconds": time.monotonic() - t0}


# --- modes --------------------------------------------------------------------------------------------------
def mode_bytes(args, say) -> dict:
    cases = runnable(list(args.codecs), say)
    secure = runnable([f"sa:{c}" for c in args.secure_codecs], say)
    specs = []
    for d in args.datasets:
        fed = federation(d, args.sites, size=args.size)
        for case in cases + (secure if len(fed.sites) >= 3 else []):
            specs.append({"dataset": d, "sites": args.sites, "case": case, "rounds": args.rounds, "seed": 0,
                          "model_args": {"size": args.size} if d == "vector" else {},
                          "fraction": args.fraction, "rate_bps": None, "rtt_s": 0.0, "timeout_s": args.case_timeout})
        if secure and len(fed.sites) < 3:
            say(f"note: {d} with {len(fed.sites)} sites: secure aggregation needs 3 or more; its cases are skipped")
    runs = federate(specs, workroot=args.workroot, timeout_s=args.case_timeout + 120, say=say)
    say("\n" + bytes_table(runs))
    return {"runs": runs}


def bytes_table(runs: list[dict]) -> str:
    head = ["dataset", "case", "sites", "model", "up/round", "down/round", "up × none", "down × none",
            "lo payload/round", "final acc (sites)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    base = {(r["dataset"], r["case"].startswith("sa:")): r for r in runs
            if r["case"].removeprefix("sa:") == "none" and "error" not in r}
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['dataset']} | {r['case']} | FAILED: {r['error']} |" + " |" * (len(head) - 3))
            continue
        b = base.get((r["dataset"], r["case"].startswith("sa:"))) or base.get((r["dataset"], False))
        lo = statistics.mean(x["lo_payload"] for x in r["per_round"]) if r["per_round"] else None
        lines.append("| " + " | ".join([
            r["dataset"], r["case"], str(r["sites"]), fmt_bytes(r["model_bytes"]), fmt_bytes(r["up_per_round"]),
            fmt_bytes(r["down_per_round"]), ratio(r["up_per_round"], b and b["up_per_round"]),
            ratio(r["down_per_round"], b and b["down_per_round"]), fmt_bytes(lo), fmt_acc(r["final_accuracy"])]) + " |")
    return "\n".join(lines)


def mode_accuracy(args, say) -> dict:
    cases = runnable(list(args.codecs), say)
    cells = [(d, c, s) for d in args.datasets for c in cases for s in range(args.seeds)]
    context = multiprocessing.get_context("fork")   # the parent has not run torch: no thread pool to copy
    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="plexus-bench-compression-") as tmp, \
            ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = [(cell, pool.submit(accuracy_cell, *cell, args.rounds, args.quick, args.fraction, tmp))
                   for cell in cells]
        for (d, c, s), future in futures:
            try:
                r = future.result()
            except Exception as exc:   # one codec failing (e.g. not built yet) must not lose the others
                r = {"dataset": d, "case": c, "seed": s, "error": f"{type(exc).__name__}: {exc}"}
                say(f"[{time.monotonic() - started:7.1f}s] {d} {c} seed {s}: FAILED {r['error']}")
            else:
                say(f"[{time.monotonic() - started:7.1f}s] {d} {c} seed {s}: {r['rounds']} rounds, acc "
                    f"{r['scores']['accuracy']:.3f}, up {fmt_bytes(statistics.mean(x['up'] for x in r['per_round']))}"
                    f"/round ({r['seconds']:.0f}s)")
            results.append(r)
    summary = summarise_accuracy(results)
    say("\n" + accuracy_table(summary))
    fidelity = compare(results, args.compare, args.quick, say) if args.compare else None
    return {"fidelity": fidelity, "seeds": list(range(args.seeds)), "quick": args.quick, "runs": results,
            "summary": summary, "recipes": {d: recipe(d, args.quick, args.rounds) for d in args.datasets}}


def compare(results: list[dict], path: Path, quick: bool, say) -> dict:
    """Each in-process final model against the real federation's of the same case in a `bytes` results file
    (seed 0, every site, the same rounds): equal digests mean the loop here is the federation, bit for bit."""
    runs = json.loads(path.read_text())["runs"]
    full = {"heart": 4, "fmnist": 8}
    out = {}
    for r in results:
        if "error" in r or r["seed"] != 0 or quick:
            continue
        fed = next((f for f in runs if f.get("dataset") == r["dataset"] and f.get("case") == r["case"]
                    and f.get("rounds") == r["rounds"] and f.get("sites") == full[r["dataset"]]
                    and f.get("final_model", {}).get("version") == r["rounds"]), None)
        if fed is None:
            continue
        same = fed["final_model"]["sha256"] == r["final_model_sha256"]
        out[f"{r['dataset']} {r['case']}"] = same
        say(f"{r['dataset']} {r['case']}: in-process model {'==' if same else '!='} the real federation's "
            f"after {r['rounds']} rounds ({'bit for bit' if same else 'DIFFERENT'})")
    if not out:
        say(f"--compare: no run in {path} matches (seed 0, every site, {results[0].get('rounds')} rounds)")
    return out


def recipe(dataset: str, quick: bool, rounds: int | None) -> dict:
    task = task_for(dataset, quick)
    return {"model": task.model, "optimizer": task.optimizer, "batch_size": task.batch_size, "epochs": task.epochs,
            "rounds": rounds or task.rounds, "sites": sorted(task.sites), **task.setup}


def summarise_accuracy(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        if "error" in r:
            out.setdefault(r["dataset"], {}).setdefault(r["case"], {"errors": []}).setdefault("errors", []).append(
                r["error"])
            continue
        cell = out.setdefault(r["dataset"], {}).setdefault(r["case"], {})
        for metric, value in r["scores"].items():
            cell.setdefault(metric, []).append(value)
        cell.setdefault("up_per_round", []).append(statistics.mean(x["up"] for x in r["per_round"]))
        cell.setdefault("down_per_round", []).append(statistics.mean(x["down"] for x in r["per_round"]))
    for cases in out.values():
        for cell in cases.values():
            for k, v in list(cell.items()):
                if k != "errors":
                    arr = np.asarray(v, dtype=np.float64)
                    cell[k] = {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
                               "values": v}
    return out


def accuracy_table(summary: dict) -> str:
    lines = []
    for d, cases in summary.items():
        head = ["codec", "test accuracy", "AUC", "uplink payload/round", "× none", "downlink payload/round"]
        lines += [f"{d}:", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        none = cases.get("none", {}).get("up_per_round", {}).get("mean")
        for case, cell in cases.items():
            if "accuracy" not in cell:
                lines.append(f"| {case} | FAILED: {cell.get('errors', ['?'])[0]} |" + " |" * (len(head) - 2))
                continue
            auc = cell.get("auc")
            lines.append("| " + " | ".join([
                case, f"{cell['accuracy']['mean']:.3f} ± {cell['accuracy']['std']:.3f}",
                "–" if auc is None else f"{auc['mean']:.3f} ± {auc['std']:.3f}",
                fmt_bytes(cell["up_per_round"]["mean"]), ratio(cell["up_per_round"]["mean"], none),
                fmt_bytes(cell["down_per_round"]["mean"])]) + " |")
        lines.append("")
    return "\n".join(lines)


def mode_wan(args, say) -> dict:
    cases = runnable(list(args.codecs), say)
    vector = args.model == "vector"
    dataset = "vector" if vector else "heart-wide"
    model_args = {"size": args.size} if vector else {"hidden": args.hidden}
    params = model_bytes(federation(dataset, args.sites, **model_args).model) // 4
    if params < 10_000_000:
        say(f"note: the model has {params:,} parameters, under the issue's 10M (a trial run?)")
    specs = [{"dataset": dataset, "sites": args.sites, "case": c, "model_args": model_args, "seed": seed,
              "rounds": args.rounds if vector else args.max_rounds, "target": None if vector else args.target,
              "fraction": args.fraction, "rate_bps": args.rate, "rtt_s": args.rtt, "timeout_s": args.case_timeout}
             for seed in range(args.seeds) for c in cases]
    runs = federate(specs, workroot=args.workroot, timeout_s=args.case_timeout + 120, say=say)
    say("\n" + wan_table(runs, vector=vector))
    return {"model": args.model, "parameters": params, "rate_bps": args.rate, "rtt_s": args.rtt,
            "target": None if vector else args.target, "rounds": args.rounds if vector else args.max_rounds,
            "seeds": list(range(args.seeds)), "runs": runs}


def wan_table(runs: list[dict], *, vector: bool) -> str:
    head = ["codec", "seed", "rounds" if vector else "version reaching target", "time (s)", "× none", "mean round (s)",
            "up/round", "down/round", "final acc (sites)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def figure(r):
        return r["round_closed_s"][-1] if vector else r.get("time_to_target_s")

    none = {r["seed"]: figure(r) for r in runs if r["case"] == "none" and "error" not in r}
    for r in sorted(runs, key=lambda r: r["seed"]):
        if "error" in r:
            lines.append(f"| {r['case']} | {r['seed']} | FAILED: {r['error']} |" + " |" * (len(head) - 3))
            continue
        t = figure(r)
        rounds = len(r["round_closed_s"]) if vector else ("not reached" if r.get("reached") is None
                                                            else str(r["reached"]))
        lines.append("| " + " | ".join([
            r["case"], str(r["seed"]), str(rounds), "–" if t is None else f"{t:.1f}", ratio(t, none.get(r["seed"])),
            f"{statistics.mean(r['round_open_to_close_s']):.1f}" if r["round_open_to_close_s"] else "–",
            fmt_bytes(r["up_per_round"]), fmt_bytes(r["down_per_round"]), fmt_acc(r["final_accuracy"])]) + " |")
    return "\n".join(lines)


# --- formatting -------------------------------------------------------------------------------------------
def fmt_bytes(v) -> str:
    if v is None:
        return "–"
    return f"{v / MiB:.2f} MiB" if v >= MiB / 10 else f"{v / 1024:.1f} KiB"


def fmt_acc(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def fmt_s(v) -> str:
    return "–" if v is None else f"{v:.1f} s"


def ratio(a, b) -> str:
    return "–" if a is None or not b else f"{a / b:.3f}"


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--fraction", type=float, default=FRACTION, help="topk/randk: the fraction of each tensor sent")
    common.add_argument("--out", type=Path, default=HERE / "results", help="folder for compression_MODE.json")
    common.add_argument("--case-timeout", type=float, default=3600, help="seconds per real-federation case")
    b = sub.add_parser("bytes", parents=[common], help="bytes on the wire per round, real federations")
    b.add_argument("--datasets", type=_list, default=["heart", "fmnist"], help="heart, fmnist or vector")
    b.add_argument("--codecs", type=_list, default=list(CODECS))
    b.add_argument("--secure-codecs", type=_list, default=list(SECURE_CODECS),
                   help="cases also run with secure aggregation (3 or more sites); '' for none")
    b.add_argument("--sites", type=int, help="sites (default: heart 4 hospitals, fmnist 8)")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--size", type=parse_size, default=1_000_000, help="vector: parameters (default 1M)")
    a = sub.add_parser("accuracy", parents=[common], help="test accuracy after equal rounds, in process")
    a.add_argument("--datasets", type=_list, default=["heart", "fmnist"])
    a.add_argument("--codecs", type=_list, default=list(CODECS))
    a.add_argument("--seeds", type=int, default=3)
    a.add_argument("--rounds", type=int, help="rounds (default: heart 50, fmnist 12, as bench.strategies)")
    a.add_argument("--quick", action="store_true", help="bench.strategies' --quick data (2k F-MNIST images)")
    a.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    a.add_argument("--compare", type=Path, metavar="BYTES_JSON",
                   help="check each final model against the real federation's in a `bytes` results file")
    w = sub.add_parser("wan", parents=[common], help="time to target over emulated WAN links, real federations")
    w.add_argument("--model", choices=["mlp", "vector"], default="mlp")
    w.add_argument("--codecs", type=_list, default=list(WAN_CODECS))
    w.add_argument("--rate", type=parse_rate, default=parse_rate("20mbit"), help="each site's link, each way")
    w.add_argument("--rtt", type=parse_duration, default=parse_duration("40ms"))
    w.add_argument("--sites", type=int, default=4)
    w.add_argument("--seeds", type=int, default=1, help="job seeds 0..N-1 (model init and training order)")
    w.add_argument("--hidden", type=lambda t: [int(x) for x in t.split(",")], default=[3200, 3200],
                   help="mlp: hidden widths (default 3200,3200: 10.3M parameters)")
    w.add_argument("--target", type=float, default=0.78, help="mlp: the test accuracy to reach")
    w.add_argument("--max-rounds", type=int, default=30, help="mlp: give up after this many rounds")
    w.add_argument("--size", type=parse_size, default=10_000_000, help="vector: parameters (default 10M)")
    w.add_argument("--rounds", type=int, default=5, help="vector: the fixed number of rounds timed")
    args = ap.parse_args(argv)
    for c in args.codecs + [f"sa:{c}" for c in getattr(args, "secure_codecs", [])]:
        try:
            compression_block(c, args.fraction)
        except ValueError as exc:
            ap.error(str(exc))
    if args.mode == "wan" and args.model == "vector" and args.size < 10 ** 6:
        ap.error("--size: at least 1M")

    def say(*a):
        print(*a, flush=True)

    started = time.monotonic()
    args.workroot = None if args.mode == "accuracy" else Path(tempfile.mkdtemp(prefix="plexus-bench-compression-"))
    say(f"bench.compression {args.mode}: {os.cpu_count()} CPUs"
        + ("" if args.workroot is None else f"; each case's PKI, configs and logs in {args.workroot}"))
    report = {"mode": args.mode, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
              "python": platform.python_version(), "fraction": args.fraction,
              "compression": compression_available() or "available"}
    report.update({"bytes": mode_bytes, "accuracy": mode_accuracy, "wan": mode_wan}[args.mode](args, say))
    report["wall_s"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compression_{args.mode}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    say(f"\nwall time {report['wall_s']:.0f}s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
