"""Central DP noise cannot be removed by whoever reads the job's config (issue 21 item 1), over real gRPC + mTLS."""

from __future__ import annotations

import numpy as np

from plexus.cli import main as cli
from plexus.config import parse_round_config
from plexus.dp import add_noise, noise_key

from integration.harness import heart_job

Z, S = 1.1, 0.5


def central_job(*, z=Z, seed=7, extra="") -> str:
    return heart_job(rounds=1, min=2, seed=seed) + (
        f"privacy: {{dp: {{mode: central, noise_multiplier: {z}, clip_norm: {S}{extra}}}}}\n")


def _run(federation, job_yaml: str) -> tuple[str, dict]:
    job_id = federation.admin().submit(job_yaml).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    return job_id, federation.store.load_checkpoint(job_id, 1)


def _remove_noise_from_config(job_yaml: str, model: dict, contributors: int) -> dict:
    """The attack: regenerate the coordinator's noise from (seed, name, round) and subtract it."""
    cfg = parse_round_config(job_yaml)
    std = cfg.privacy.dp.noise_multiplier * cfg.privacy.dp.clip_norm / contributors
    zeros = {k: np.zeros_like(v, dtype=np.float64) for k, v in model.items()}
    noise = add_noise(zeros, std, noise_key(cfg.seed, cfg.name, 1, "coordinator"))
    return {k: model[k].astype(np.float64) - noise[k] for k in model}


def _max_error(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)


def test_noise_regenerated_from_the_config_recovers_nothing(federation):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    _, noiseless = _run(federation, central_job(z=0.0))        # the same training, no noise: the secret mean
    job_yaml = central_job()
    _, first = _run(federation, job_yaml)
    _, second = _run(federation, job_yaml)

    recovered = _remove_noise_from_config(job_yaml, first, contributors=2)
    floor = Z * S / 2 / 4   # a quarter of the noise std: 28 parameters all below it has odds ~1e-20
    assert _max_error(recovered, noiseless) > floor          # the guess is off by the noise itself (2e-8 before)
    assert _max_error(first, noiseless) > floor              # and the model does carry noise
    assert _max_error(first, second) > floor                 # identical configs, independent noise


def test_reproducible_noise_is_opt_in_and_says_it_is_not_private(federation, capsys):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    job_yaml = central_job(extra=", reproducible_noise: true")
    job_id, first = _run(federation, job_yaml)
    _, second = _run(federation, job_yaml)
    assert all(np.array_equal(first[k], second[k]) for k in first)   # bit-for-bit, as asked

    detail = federation.admin().job(job_id)
    flags = {(m.round, m.site, m.name): m.value for m in detail.metrics if m.kind == "privacy"}
    assert flags[(1, "", "noise_reproducible")] == 1.0
    events = [e for e in federation.store.events_after(job_id, 0) if e[2] == "dp_not_private"]
    assert events and "NOT differentially private" in events[0][5]
    viewer = ["--kit", str(federation.root / "admins" / "viewer"), "--coordinator", federation.address]
    assert cli(["job", "show", job_id, *viewer]) == 0
    assert "NOT differentially private" in capsys.readouterr().out
    assert cli(["job", "metrics", job_id, *viewer]) == 0
    out = capsys.readouterr()
    assert "noise_reproducible" in out.out and "NOT differentially private" in out.err
