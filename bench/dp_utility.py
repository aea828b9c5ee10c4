"""Accuracy against ε on the heart-disease federation (4 hospitals), over real gRPC + mTLS.

    python -m bench.dp_utility [--rounds 20] [--seeds 0,1,2] [--noise 0.6,1.0,2.0] [--out dp.json]

Rows: the non-private FedAvg run, central DP-FedAvg at each noise multiplier z (sites clip Δ to
S, the coordinator adds N(0, (zS)²) to the sum; ε from Opacus's RDP accountant, q = 1, δ = 1e-5),
and one DP-SGD run (Opacus at every site; ε is the largest site's). Metric: accuracy and AUC of
the final global model on all four hospitals' held-out rows pooled; mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from coordinator.server import Coordinator
from plexus import pki
from plexus.admin_client import AdminClient
from plexus.config import CoordinatorConfig, DatasetSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.datasets import HOSPITALS, heart_disease
from plexus.models import build_model, load_numpy_state
from site_agent.agent import SiteAgent
from site_agent.training import evaluate

JOB = """\
name: dp-utility
model: {{name: logistic, args: {{in_features: 13, num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
sites: {{min: 4, deadline_s: 120}}
train: {{epochs: 1, batch_size: 16, optimizer: {{name: sgd, lr: 0.1, momentum: 0.9}}}}
seed: {seed}
{privacy}"""
CLIP = 1.0
DELTA = 1e-5


def run_federation(root: Path, job_yaml: str) -> tuple[dict, dict]:
    coordinator = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", kit=root / "coordinator",
                                                state_dir=root / f"state-{time.monotonic_ns()}", poll_timeout_s=1.0))
    coordinator.start()
    address = f"127.0.0.1:{coordinator.port}"
    agents = []
    try:
        for h in HOSPITALS:
            config = SiteConfig(site=h, coordinator=address, kit=root / "sites" / h,
                                state_dir=root / "sites" / h / f"state-{time.monotonic_ns()}",
                                datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=h)},
                                policy=PolicySpec(allowed_models=("logistic",)))
            agent = SiteAgent(config, backoff_cap_s=0.5)
            thread = threading.Thread(target=agent.run, daemon=True)
            thread.start()
            agents.append((agent, thread))
        deadline = time.monotonic() + 60
        while set(HOSPITALS) - coordinator.engine.online_sites():
            if time.monotonic() > deadline:
                raise RuntimeError("sites did not come online")
            time.sleep(0.05)
        with AdminClient(address, root / "admins" / "ops") as client:
            job_id = client.submit(job_yaml).job_id
            for event in client.watch(job_id):
                if event.summary.status in ("completed", "budget_reached", "failed", "aborted"):
                    break
            detail = client.job(job_id)
            if detail.summary.status not in ("completed", "budget_reached"):
                raise RuntimeError(f"job {detail.summary.status}: {detail.summary.message}")
            _, state = client.download(job_id)
        return state, {"metrics": [(m.round, m.site, m.kind, m.name, m.value) for m in detail.metrics]}
    finally:
        for agent, _ in agents:
            agent.stop.set()
        coordinator.stop(grace=0.5)
        for _, thread in agents:
            thread.join(timeout=10)


def pooled_test_metrics(state: dict, job_yaml: str) -> dict:
    job = parse_round_config(job_yaml)
    model = build_model(job.model.name, job.model.args, seed=job.seed)
    load_numpy_state(model, state)
    splits = [heart_disease(h) for h in HOSPITALS]
    return evaluate(model, np.concatenate([s.x_test for s in splits]), np.concatenate([s.y_test for s in splits]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--noise", default="0.6,1.0,2.0")
    ap.add_argument("--dp-sgd-noise", type=float, default=1.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = [("non-private", "")]
    for z in (float(v) for v in args.noise.split(",")):
        settings.append((f"central DP z={z}", f"privacy: {{dp: {{mode: central, noise_multiplier: {z}, "
                                                  f"clip_norm: {CLIP}, delta: {DELTA}}}}}\n"))
    settings.append((f"DP-SGD z={args.dp_sgd_noise}", f"privacy: {{dp_sgd: {{noise_multiplier: {args.dp_sgd_noise}, "
                                                       f"max_grad_norm: 1.0, delta: {DELTA}}}}}\n"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="plexus-dp-bench-") as tmp:
        root = Path(tmp) / "pki"
        pki.init_federation(root, "dp-bench", hosts=["127.0.0.1"])
        pki.add_admin(root, "ops", role="operator")
        for h in HOSPITALS:
            pki.add_site(root, h)
        for label, privacy in settings:
            accs, aucs, epss = [], [], []
            for seed in seeds:
                job_yaml = JOB.format(rounds=args.rounds, seed=seed, privacy=privacy)
                state, info = run_federation(root, job_yaml)
                result = pooled_test_metrics(state, job_yaml)
                accs.append(result["accuracy"])
                aucs.append(result["auc"])
                central = [v for r, s, k, n, v in info["metrics"] if k == "privacy" and n == "epsilon"]
                site_level = [v for r, s, k, n, v in info["metrics"] if k == "train" and n == "epsilon"]
                epss.append(max(central) if central else max(site_level) if site_level else float("inf"))
            row = {"setting": label, "accuracy": accs, "auc": aucs, "epsilon": epss[0]}
            rows.append(row)
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            print(f"{label:<22} ε={epss[0]:>8.2f}  accuracy {statistics.mean(accs):.3f} ± {sd:.3f}  "
                  f"AUC {statistics.mean(aucs):.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
