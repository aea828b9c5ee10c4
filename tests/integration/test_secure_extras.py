"""A rule's update extras under secure aggregation, over real gRPC + mTLS: the unmasked sum of an extra tensor is
the sites' plain sum within the fixed-point resolution, with sites dropping out before and after masking."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import strategies
from coordinator.strategies import MeanRule
from plexus import config
from plexus.datasets import heart_disease
from plexus.models import state_views
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg import frac_bits
from site_agent import local
from site_agent.training import TrainResult

from integration.harness import HOSPITAL_OF, heart_job, scaled, wait_until
from integration.test_secure_aggregation import DROPOUT_PHASE_S, DropsOut, start_agent

PROBE = "probe/sums"
CLIP = 256.0   # at least every site's largest |value|: column sums and rows of at most 199 rows in [0, 1]


class Probe(MeanRule):
    """Test only: a summing rule that keeps the model and records the pooled sum of one F64 extra."""

    name = "probe"
    weighting = "uniform"
    reads_current = True

    def __init__(self) -> None:
        self.pooled: dict[str, np.ndarray] = {}

    def update_extras(self, model):
        return [(PROBE, "F64", (14,))]

    def step(self, round_, current, mean, contributors, *, population):
        self.pooled = {PROBE: np.asarray(mean[PROBE], np.float64) * len(contributors)}   # mean × K: the sum
        return dict(current)

    def state_arrays(self):
        return dict(self.pooled)


class ProbeSite(local.Plain):
    """Test only: no training; the update is the served model plus each column's sum and the row count."""

    def train(self, run):
        return local.LocalResult(TrainResult(num_samples=len(run.data.y_train), steps=0, metrics={}),
                                 {**state_views(run.model), PROBE: site_sums(run.data.x_train)}, lambda: None)


def site_sums(x: np.ndarray) -> np.ndarray:
    return np.concatenate([x.sum(axis=0, dtype=np.float64), [float(len(x))]])


@pytest.fixture
def probe(monkeypatch):
    """Register the test-only strategy at both halves, as a summing strategy (weight 1 per site)."""
    monkeypatch.setitem(config.STRATEGY_ARGS, "probe", config.NoArgs)
    monkeypatch.setitem(strategies.REGISTRY, "probe", Probe)
    monkeypatch.setitem(local.LOCAL, "probe", ProbeSite())
    monkeypatch.setattr(config, "SUMMING_STRATEGIES", config.SUMMING_STRATEGIES | {"probe"})


def probe_job(seed: int, phase_timeout: float = scaled(2)) -> str:
    return (heart_job(rounds=1, min=3, seed=seed, deadline=scaled(10)).replace("rounds: 1", "rounds: 1\nstrategy: "
            "{name: probe}") + f"privacy: {{secure_aggregation: true, secagg: {{clip: {CLIP}, "
            f"phase_timeout_s: {phase_timeout}}}}}\n")


def plain_sum(sites) -> np.ndarray:
    return sum(site_sums(heart_disease(HOSPITAL_OF[s]).x_train) for s in sites)


def check_pooled(federation, job_id: str, survivors: list[str], advertised: int) -> None:
    detail = federation.admin().job(job_id)
    assert list(next(r for r in detail.rounds if r.round == 1).contributors) == survivors
    arrays, _ = federation.store.load_strategy_state(job_id, 1)
    pooled, want = arrays[PROBE], plain_sum(survivors)
    # Each of the |U1| advertised sites rounds w·x (w = 1/|U1|) to 2**-f; the mean is rescaled by |U1|/|U3| and
    # the rule multiplies it by |U3|: |error| <= |U1|·|U3|·2**-(f+1) (docs/privacy.md).
    bound = advertised * len(survivors) * 2.0 ** -(frac_bits(CLIP) + 1)
    assert np.abs(pooled - want).max() <= bound, (np.abs(pooled - want).max(), bound)
    assert round(float(pooled[-1])) == sum(len(heart_disease(HOSPITAL_OF[s]).y_train) for s in survivors)
    assert federation.store.load_checkpoint(job_id, 1).keys() == federation.store.load_checkpoint(job_id, 0).keys()


def test_an_update_extra_is_summed_under_secure_aggregation(federation, masked_blobs, probe):
    for name in "abc":
        start_agent(federation, name)
    federation.wait_online(*"abc")
    job_id = federation.admin().submit(probe_job(seed=4)).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    check_pooled(federation, job_id, ["a", "b", "c"], advertised=3)
    layouts = {tuple(t.name for t in layout.tensors) for layout, _ in masked_blobs}
    assert layouts == {("linear.bias", "linear.weight", PROBE)}   # the extra travelled masked, beside the model
    sums = {s: site_sums(heart_disease(HOSPITAL_OF[s]).x_train) for s in "abc"}
    for _, blob in masked_blobs:   # no site's plain values in any masked input
        vector = np.frombuffer(blob, "<u4")[-14:]
        for s in "abc":
            fixed = np.rint(sums[s] / 3 * 2.0 ** frac_bits(CLIP)).astype(np.int64).astype(np.uint32)
            assert not np.array_equal(vector, fixed)


def test_an_update_extra_survives_dropouts_before_and_after_masking(federation, probe):
    for name in "abc":
        start_agent(federation, name)
    start_agent(federation, "d", DropsOut, vanish_at=fpb.TASK_SECAGG_MASKED_INPUT)  # shared its keys, never masks
    start_agent(federation, "e", DropsOut, vanish_at=fpb.TASK_SECAGG_UNMASK)        # masked, then gone
    federation.wait_online(*"abcde")
    job_id = federation.admin().submit(probe_job(seed=9, phase_timeout=DROPOUT_PHASE_S)).job_id
    wait_until(lambda: federation.store.job(job_id).current_round == 1, 60, "round 1 to close without d and e")
    for name in "de":   # back for the final evaluation, which would otherwise wait out its deadline
        start_agent(federation, name)
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    check_pooled(federation, job_id, ["a", "b", "c", "e"], advertised=5)
