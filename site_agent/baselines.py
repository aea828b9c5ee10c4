"""The baselines a federated model is judged against, trained with the site's own training code at equal local
compute: one model on every site's rows pooled (the ceiling) and one per site on its rows alone.

Used by `plexus demo` (as a process: `python -m site_agent.baselines`, so the kernel imports no site code)
and by the strategy and DP benchmarks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from plexus.datasets import Split
from plexus.models import build_job_model, load_numpy_state
from site_agent.training import evaluate, train_local


def pooled(splits: Iterable[Split]) -> Split:
    """One split of every site's train rows and every site's test rows, in the order given."""
    splits = list(splits)
    if not splits:
        raise ValueError("pooled() needs at least one site's split")
    first = splits[0]
    return Split(np.concatenate([s.x_train for s in splits]), np.concatenate([s.y_train for s in splits]),
                 np.concatenate([s.x_test for s in splits]), np.concatenate([s.y_test for s in splits]),
                 first.num_classes, first.feature_names)


def train_centrally(job, x: np.ndarray, y: np.ndarray, *, seeds: Iterable[int]) -> torch.nn.Module:
    """The job's initial model trained on (x, y): one call of the site's `train_local` (job.train) per seed."""
    model = build_job_model(job)
    for seed in seeds:
        train_local(model, x, y, job.train, seed=seed)
    return model


def compare(job, federated_state: Mapping[str, np.ndarray], splits: Mapping[str, Split], *,
            seeds: Iterable[int]) -> dict[str, dict[str, float]]:
    """Accuracy of the federated model, the pooled baseline and each site alone on each site's test rows and on
    all of them pooled ("pooled", with "pooled_auc"), keyed "federated", "pooled" and then by site."""
    seeds = list(seeds)
    together = pooled(splits.values())
    federated = build_job_model(job)
    load_numpy_state(federated, federated_state)
    models = {"federated": federated, "pooled": train_centrally(job, together.x_train, together.y_train, seeds=seeds)}
    for name, s in splits.items():
        models[name] = train_centrally(job, s.x_train, s.y_train, seeds=seeds)
    out = {}
    with torch.no_grad():
        for label, model in models.items():
            scores = {site: evaluate(model, s.x_test, s.y_test)["accuracy"] for site, s in splits.items()}
            overall = evaluate(model, together.x_test, together.y_test)
            out[label] = {**scores, "pooled": overall["accuracy"], "pooled_auc": overall.get("auc", float("nan"))}
    return out


def main(argv: list[str] | None = None) -> int:
    """The demo's comparison as a process: the scores of `compare` as one JSON object on stdout."""
    from safetensors.numpy import load_file

    from plexus.config import parse_round_config
    from plexus.datasets import heart_disease

    ap = argparse.ArgumentParser(prog="python -m site_agent.baselines", description=main.__doc__)
    ap.add_argument("--job", type=Path, required=True, help="the round config the federation ran")
    ap.add_argument("--model", type=Path, required=True, help="the federated model (safetensors)")
    ap.add_argument("--hospitals", required=True, help="comma-separated heart-disease hospitals")
    ap.add_argument("--rounds", type=int, required=True, help="the federation's rounds: one epoch of each")
    args = ap.parse_args(argv)
    job = parse_round_config(args.job.read_text())
    splits = {h: heart_disease(h) for h in args.hospitals.split(",")}
    # The same local epochs as the federation ran: one train_local per round, seeded by the round.
    scores = compare(job, load_file(str(args.model)), splits, seeds=range(args.rounds))
    json.dump(scores, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
