"""Asynchronous secure aggregation over real gRPC + mTLS with real site agents: buffers as secure cohorts."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.tasks import site_seed
from plexus import pki, staleness
from plexus.accounting import client_epsilon
from plexus.config import PolicySpec, StalenessSpec, parse_round_config
from plexus.datasets import heart_disease
from plexus.identity import load_kit
from plexus.models import build_model, load_numpy_state, state_to_numpy
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg import SiteSession, advert_from_proto, advert_to_proto, frac_bits
from site_agent.training import train_local

from integration.harness import HOSPITAL_OF, scaled, wait_until
from integration.rogue import rogue_federation, site_agents
from integration.test_secure_aggregation import CLIP, DROPOUT_PHASE_S, DropsOut, start_agent, u32
from state_db import query

ASYNC_SECURE_JOB = """\
name: {name}
model: {{name: logistic, args: {{in_features: 13, num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: {versions}
sites: {{min: 3, deadline_s: {deadline}}}
train: {{epochs: 1, batch_size: 32, optimizer: {{name: sgd, lr: 0.1}}}}
asynchronous: {asynchronous}
privacy: {{secure_aggregation: true, secagg: {{clip: {clip}, phase_timeout_s: {phase}}}{dp}}}
seed: {seed}
"""


def async_secure_job(*, name="async-secure", versions=2, asynchronous="{buffer: 3, max_staleness: 4}", dp="",
                     seed=0, phase=scaled(2)) -> str:
    return ASYNC_SECURE_JOB.format(name=name, versions=versions, asynchronous=asynchronous, clip=CLIP,
                                   phase=phase, deadline=scaled(10), dp=f", dp: {dp}" if dp else "", seed=seed)


def first_updates(job_yaml: str, sites, tasks: dict[str, int] | None = None
                  ) -> tuple[dict, dict[str, dict], dict[str, int]]:
    """Each site's training task on version 0 in the clear, as its agent ran it: (version 0, Δ per site, n per
    site). `tasks`: site -> the task's place among the site's tasks (its seed; default the first)."""
    job = parse_round_config(job_yaml)
    initial = state_to_numpy(build_model(job.model.name, job.model.args, seed=job.seed))
    deltas, samples = {}, {}
    for site in sites:
        data = heart_disease(HOSPITAL_OF[site])
        model = build_model(job.model.name, job.model.args, seed=job.seed)
        load_numpy_state(model, initial)
        result = train_local(model, data.x_train, data.y_train, job.train,
                             seed=site_seed(job.seed, (tasks or {}).get(site, 0), site))
        trained = state_to_numpy(model)
        deltas[site] = {k: trained[k].astype(np.float64) - initial[k] for k in initial}
        samples[site] = result.num_samples
    return initial, deltas, samples


def test_an_asynchronous_secure_job_makes_its_versions_from_cohorts_of_three(federation, masked_blobs):
    for name in "abcd":
        start_agent(federation, name)
    federation.wait_online(*"abcd")
    job_id = federation.admin().submit(async_secure_job(versions=2)).job_id
    assert federation.wait_job(job_id, scaled(20)) == "completed", federation.store.job(job_id).message

    detail = federation.admin().job(job_id)
    versions = [r for r in detail.rounds if 1 <= r.round <= 2]
    assert [r.status for r in versions] == ["closed", "closed"]
    assert all(len(r.contributors) == 3 and set(r.contributors) <= set("abcd") for r in versions)
    assert all("secure cohort" in r.message for r in versions)
    metrics = {(m.round, m.site, m.name): m.value for m in detail.metrics if m.kind == "async"}
    assert metrics[(2, "", "cohort_round")] > metrics[(1, "", "cohort_round")] > 2    # one id per cohort
    # a site's update only ever reached the coordinator masked: uniform-looking bytes, one per contribution
    masked_inputs = u32(masked_blobs)
    assert len(masked_inputs) >= 6
    for vector in masked_inputs:
        counts = np.bincount(vector.view(np.uint8), minlength=256)
        expected = vector.nbytes / 256
        assert float(((counts - expected) ** 2 / expected).sum()) < 400
    statuses = {e.status for e in detail.site_events}
    assert "trained" not in statuses and "buffered" not in statuses   # every kept update flushed or discarded
    assert {e.site for e in detail.site_events if e.status == "evaluated" and e.round == 3} == set("abcd")


def test_a_member_that_drops_out_mid_cohort_is_recovered_and_the_version_still_made(federation):
    for name in "abc":
        start_agent(federation, name)
    start_agent(federation, "d", DropsOut, vanish_at=fpb.TASK_SECAGG_MASKED_INPUT)   # shares its keys, never masks
    federation.wait_online(*"abcd")
    job_yaml = async_secure_job(versions=1, asynchronous="{buffer: 4, max_staleness: 4}", seed=5,
                                phase=DROPOUT_PHASE_S)
    job_id = federation.admin().submit(job_yaml).job_id
    wait_until(lambda: federation.store.job(job_id).current_round == 1, scaled(15), "version 1")

    detail = federation.admin().job(job_id)
    version1 = next(r for r in detail.rounds if r.round == 1)
    assert sorted(version1.contributors) == ["a", "b", "c"] and "dropped: d" in version1.message
    # the training tasks version 1 took in (a member late in a slow phase may have trained again first)
    rows = query(federation.store.state_dir, "SELECT site, kind, status FROM tasks WHERE job_id = ? "
                 "ORDER BY issued, rowid", (job_id,))
    places = {}
    for site in "abc":
        mine = [(kind, status) for s, kind, status in rows if s == site]
        places[site] = next(i for i, (kind, status) in enumerate(mine) if kind == "train" and status == "submitted")
    initial, deltas, samples = first_updates(job_yaml, "abc", places)
    total = sum(samples.values())
    got = federation.store.load_checkpoint(job_id, 1)
    bound = 3 * 0.5 * 2.0 ** -frac_bits(CLIP) * 2   # each member's rounding, and the renormalisation
    for name, x in initial.items():                 # τ = 0 for all: s = 1, FedAvg's sample-weighted mean
        expected = x + sum(samples[s] * deltas[s][name] for s in "abc") / total
        np.testing.assert_allclose(got[name], expected, rtol=0, atol=bound + 1e-6,
                                   err_msg=f"version 1: {version1.message}; training tasks taken: {places}; {rows}")
    # (d may also have trained again, once out of the cohort: that update is discarded as training ended)
    discarded = [e.reason for e in detail.site_events if e.site == "d" and e.status == "discarded"]
    assert any("dropped out of cohort" in reason for reason in discarded), discarded
    federation.admin().abort(job_id)


def test_distributed_dp_under_cohorts_counts_each_flush_at_q_1(federation):
    for name in "abc":
        start_agent(federation, name)
    federation.wait_online(*"abc")
    job_id = federation.admin().submit(async_secure_job(
        versions=2, dp="{mode: distributed, noise_multiplier: 1.0, clip_norm: 1.0}")).job_id
    assert federation.wait_job(job_id, scaled(20)) == "completed", federation.store.job(job_id).message
    detail = federation.admin().job(job_id)
    assert all(sorted(r.contributors) == ["a", "b", "c"] for r in detail.rounds if 1 <= r.round <= 2)
    eps = {m.round: m.value for m in detail.metrics if m.kind == "privacy" and m.name == "epsilon"}
    assert eps[2] == client_epsilon(1.0, [1.0, 1.0], 1e-5) and eps[1] < eps[2]
    assert not [m for m in detail.metrics if m.kind in ("train", "eval") and m.site]   # no per-site metrics


COHORT_JOB = """\
name: cohort
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 10
sites: {min: 4}
train: {epochs: 1, batch_size: 32, optimizer: {name: sgd, lr: 0.1}}
asynchronous: {buffer: 4, max_staleness: 2}
privacy: {secure_aggregation: true, dp: {mode: distributed, noise_multiplier: 1.0, clip_norm: 1.0}}
"""


@pytest.fixture
def rogue(tmp_path):
    with rogue_federation(tmp_path, "rogue-cohort") as coordinator:
        yield coordinator


def test_against_a_lying_coordinator_a_site_weighs_itself_and_never_unmasks_below_its_noise_floor(rogue, tmp_path):
    """The site computes τ from the version it is told and refuses τ > max_staleness; it signs s(τ)·1 (DP); and
    having drawn its distributed-noise share for max(t, sites.min) = 4 survivors, it reveals nothing for 3."""
    job, cohort, clip = "cohort-0123abcd", 102, 4.0
    with site_agents(rogue, tmp_path / "site" / "state") as start:
        start(PolicySpec(allowed_models=("logistic",)))
        assert rogue.ask(job, COHORT_JOB, round_=1).what == "RESULT_TRAINED"        # from version 0: nothing sent
        stale = rogue.ask(job, COHORT_JOB, round_=100, kind=fpb.TASK_SECAGG_ADVERTISE, model_round=0,
                          secagg=fpb.SecAggPayload(version=3))
        assert stale.what == "RESULT_FAILED" and "would be 3 versions old" in stale.reason, stale
        missing = rogue.ask(job, COHORT_JOB, round_=101, kind=fpb.TASK_SECAGG_ADVERTISE, model_round=5,
                            secagg=fpb.SecAggPayload(version=6))
        assert missing.what == "RESULT_FAILED" and "no update trained from version 5" in missing.reason
        got = rogue.ask(job, COHORT_JOB, round_=cohort, kind=fpb.TASK_SECAGG_ADVERTISE, model_round=0,
                        secagg=fpb.SecAggPayload(version=2))
        weight = staleness.fixed_weight(StalenessSpec(), 2, 1)                   # s(2)·1: DP weighs sites equally
        assert got.what == "advert" and got.message.advert.num_samples == weight == 37837

        kits = {n: load_kit(pki.add_site(rogue.root, n)) for n in "bcd"}
        others = {n: SiteSession(job, cohort, n) for n in "bcd"}
        adverts = [advert_from_proto(got.message.advert)] + [
            others[n].advertise(weight, kits[n].key_pem, kits[n].cert_pem) for n in "bcd"]
        total = sum(a.num_samples for a in adverts)
        common = dict(threshold=3, total_weight=total, clip=clip, frac_bits=frac_bits(clip), version=2)
        shared = rogue.ask(job, COHORT_JOB, round_=cohort, kind=fpb.TASK_SECAGG_SHARE, model_round=0,
                           secagg=fpb.SecAggPayload(adverts=[advert_to_proto(a) for a in adverts], **common))
        assert shared.what == "shares"
        outbox = {n: others[n].share(adverts, threshold=3, total_weight=total, ca_pem=kits[n].ca_pem) for n in "bcd"}
        u2 = ["a", "b", "c", "d"]
        masked = rogue.ask(job, COHORT_JOB, round_=cohort, kind=fpb.TASK_SECAGG_MASKED_INPUT, model_round=0,
                           secagg=fpb.SecAggPayload(shares_for_you={n: outbox[n]["a"] for n in "bcd"}, u2=u2,
                                                    **common))
        assert masked.what == "update"
        refused = rogue.ask(job, COHORT_JOB, round_=cohort, kind=fpb.TASK_SECAGG_UNMASK, model_round=0,
                            secagg=fpb.SecAggPayload(u2=u2, u3=["a", "b", "c"], **common))
        assert refused.what == "RESULT_FAILED", refused
        assert "fewer than the 4 this site's share of the distributed DP noise was drawn for" in refused.reason
