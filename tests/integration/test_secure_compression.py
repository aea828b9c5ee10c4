"""Compressed secure aggregation over real gRPC + mTLS: int8 masks in a field of 8 bits, randk only its shared
indices; the coordinator still learns only the sum, and receives fewer bytes."""

from __future__ import annotations

import numpy as np
import pytest

from plexus.config import UplinkSpec, parse_round_config
from plexus.datasets import heart_disease
from plexus.models import build_model, state_to_numpy
from plexus.secagg import frac_bits, mask_plan
from plexus.wire import Layout

from integration.harness import HOSPITAL_OF, heart_job, scaled, wait_until
from integration.test_secure_aggregation import plain_fedavg, start_agent

SITES = ["a", "b", "c"]


def compressed_job(codec: str, clip: float, *, seed: int) -> str:
    return heart_job(rounds=1, min=3, seed=seed, deadline=scaled(5)) + (
        f"privacy: {{secure_aggregation: true, secagg: {{clip: {clip}, phase_timeout_s: {scaled(2)}}}}}\n"
        f"compression: {{uplink: {{codec: {codec}}}}}\n")


def run(federation, job_yaml: str) -> str:
    for name in SITES:
        start_agent(federation, name)
    federation.wait_online(*SITES)
    job_id = federation.admin().submit(job_yaml).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    wait_until(lambda: federation.store.job(job_id).current_round >= 1, 5, "round 1 recorded")
    return job_id


@pytest.mark.parametrize(("codec", "bits"), [("int8", 8), ("fp16", 16)])
def test_a_secure_round_in_a_small_field_sums_within_the_grid(federation, masked_blobs, codec, bits):
    clip = 0.125                                 # above every |Δ| of this job (asserted below): nothing clipped
    job_yaml = compressed_job(codec, clip, seed=11)
    job_id = run(federation, job_yaml)
    expected, deltas = plain_fedavg(job_yaml, SITES)
    assert max(float(np.abs(d).max()) for s in deltas.values() for d in s.values()) < clip
    got = federation.store.load_checkpoint(job_id, 1)
    levels = 2 ** (bits - 1) - 1 - len(SITES)    # L for 3 advertised sites
    bound = len(SITES) * clip / levels           # each site's stochastic rounding: under one grid step
    for name, value in expected.items():
        error = np.abs(got[name].astype(np.float64) - value)
        assert error.max() <= bound + np.abs(value).max() * 2.0 ** -23, (name, error.max(), bound)

    model = Layout.of(expected)
    assert len(masked_blobs) == 3
    for layout, blob in masked_blobs:            # int8: one byte per model element, not four; fp16: two
        assert {t.dtype for t in layout.tensors} == {f"U{bits}"}
        assert [t.shape for t in layout.tensors] == [t.shape for t in model.tensors]
        assert len(blob) == model.total_elements * bits // 8 == 28 * bits // 8


def test_a_randk_secure_round_sums_only_the_shared_indices(federation, masked_blobs):
    job_yaml = compressed_job("randk, k: 4", 4.0, seed=5)
    job_id = run(federation, job_yaml)
    cfg = parse_round_config(job_yaml)
    initial = state_to_numpy(build_model(cfg.model.name, cfg.model.args, seed=cfg.seed))
    _, deltas = plain_fedavg(job_yaml, SITES)
    plan = mask_plan(UplinkSpec(codec="randk", k=4), Layout.of(initial), seed=5, round_=1)
    got = federation.store.load_checkpoint(job_id, 1)
    bound = len(SITES) * 0.5 * 2.0 ** -frac_bits(4.0)
    rows = {s: heart_disease(HOSPITAL_OF[s]).x_train.shape[0] for s in SITES}   # each site's weight
    total = sum(rows.values())
    for t, idx in zip(plan.update.tensors, plan.indices):
        name = t.name
        mean_delta = sum(rows[s] * deltas[s][name].astype(np.float64) for s in SITES) / total
        flat_got, flat_init = got[name].reshape(-1), initial[name].reshape(-1)
        off = np.setdiff1d(np.arange(t.numel), idx)
        np.testing.assert_array_equal(flat_got[off], flat_init[off])     # untouched off the shared indices
        want = flat_init[idx].astype(np.float64) + mean_delta.reshape(-1)[idx]
        error = np.abs(flat_got[idx].astype(np.float64) - want)
        assert error.max() <= bound + np.abs(want).max() * 2.0 ** -23, (name, error.max(), bound)

    assert len(masked_blobs) == 3
    for layout, blob in masked_blobs:            # U32[k] per tensor: bias has 2 elements, weight 26 (k = 4)
        assert [(t.name, t.dtype, t.shape) for t in layout.tensors] == [
            ("linear.bias", "U32", (2,)), ("linear.weight", "U32", (4,))]
        assert len(blob) == 4 * 6

