"""A site revealing an altered share is rejected and the secure round still finishes (issue 22 item 1)."""

from __future__ import annotations

import numpy as np

from plexus import secagg
from plexus.datasets import heart_disease
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from site_agent.agent import SiteAgent

from integration.harness import HOSPITAL_OF
from integration.test_secure_aggregation import CLIP, plain_fedavg, secure_job, start_agent

VICTIM = "a"   # the site whose self-mask seed the liars' altered shares would rebuild wrongly


class RevealsAnAlteredShare(SiteAgent):
    """An agent that adds 1 to the share of VICTIM's secret it reveals at unmasking."""

    def handle(self, stub, task):
        return super().handle(_AltersTheReveal(stub) if task.kind == fpb.TASK_SECAGG_UNMASK else stub, task)


class _AltersTheReveal:
    """The agent's stub, except that the share of VICTIM's secret in a reveal goes out as y + 1 (mod PRIME)."""

    def __init__(self, stub):
        self.stub = stub

    def __getattr__(self, name):
        return getattr(self.stub, name)

    def SecAgg(self, message: fpb.SecAggMessage, **kwargs):
        for reveal in message.reveal.reveals:
            if reveal.peer == VICTIM:
                y = int.from_bytes(reveal.y, "big")
                reveal.y = ((y + 1) % secagg.PRIME).to_bytes(len(reveal.y), "big")
        return self.stub.SecAgg(message, **kwargs)


def _run(federation, liars: str) -> tuple[str, str]:
    for name in "abcde":
        start_agent(federation, name, RevealsAnAlteredShare if name in liars else SiteAgent)
    federation.wait_online(*"abcde")
    job_yaml = secure_job(rounds=1, min=3, seed=5, phase_timeout=20)   # t = 3 of 5
    job_id = federation.admin().submit(job_yaml).job_id
    return job_id, job_yaml


def test_one_lying_share_is_rejected_and_the_round_finishes_exactly(federation):
    job_id, job_yaml = _run(federation, liars="e")
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message   # before: failed

    detail = federation.admin().job(job_id)
    assert list(next(r for r in detail.rounds if r.round == 1).contributors) == list("abcde")  # e's input is in
    rejected = [(e.site, e.reason) for e in detail.site_events if e.round == 1 and e.status == "rejected"]
    assert len(rejected) == 1 and rejected[0][0] == "e", rejected
    assert "self-mask seed of 'a'" in rejected[0][1]
    expected, _ = plain_fedavg(job_yaml, list("abcde"))
    got = federation.store.load_checkpoint(job_id, 1)
    bound = 5 * 0.5 * 2.0 ** -secagg.frac_bits(CLIP)   # each site's rounding, as in the honest round
    for name, value in expected.items():
        assert np.abs(got[name].astype(np.float64) - value).max() <= bound + np.abs(value).max() * 2.0 ** -23
    assert sum(heart_disease(HOSPITAL_OF[s]).x_train.shape[0] for s in "abcde") == \
        next(r for r in detail.rounds if r.round == 1).total_samples


def test_fewer_than_t_honest_shares_fail_the_round(federation):
    job_id, _ = _run(federation, liars="cde")      # a and b alone are 2 honest shares of a's seed, t = 3
    assert federation.wait_job(job_id) == "failed"
    message = federation.store.job(job_id).message
    assert "self-mask seed of 'a'" in message and "fewer than t = 3" in message, message
    assert "the global model is unchanged at round 0" in message
    assert not federation.store.checkpoint_path(job_id, 1).exists()
