"""Under privacy.dp no per-site metric reaches the coordinator's store (issue 22 item 2), over real gRPC + mTLS."""

from __future__ import annotations

import threading

from plexus.config import DatasetSpec, PolicySpec, SiteConfig
from site_agent.agent import SiteAgent

from integration.harness import HOSPITAL_OF, heart_job

DP = "dp: {{mode: {mode}, noise_multiplier: 1.1, clip_norm: 0.5}}"


class SendsItsMetricsAnyway(SiteAgent):
    """A site built to report its losses, metrics and row count under DP: the coordinator must not keep them."""

    @staticmethod
    def to_report(job, eval_metrics, result=None):
        return eval_metrics, result


def _start_leaky(federation, name: str) -> None:
    config = SiteConfig(site=name, coordinator=federation.address, kit=federation.root / "sites" / name,
                        state_dir=federation.root / "sites" / name / "state",
                        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[name])},
                        policy=PolicySpec(allowed_models=("logistic",)))
    agent = SendsItsMetricsAnyway(config, backoff_cap_s=0.5)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    federation.agents.append((agent, thread))


def _per_site(federation, job_id: str) -> list[tuple]:
    return [row for row in federation.store.metrics(job_id) if row[1] != ""]


def test_central_dp_stores_no_per_site_metrics(federation):
    for name in "ab":
        federation.start_site(name)
    _start_leaky(federation, "c")
    federation.wait_online("a", "b", "c")
    job = heart_job(rounds=2, min=3) + f"privacy: {{{DP.format(mode='central')}}}\n"
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    assert _per_site(federation, job_id) == []        # before: train_loss, num_samples and eval metrics per site
    assert {row[3] for row in federation.store.metrics(job_id)} == {"epsilon", "delta"}
    detail = federation.admin().job(job_id)
    assert [r.total_samples for r in detail.rounds if r.round <= 2] == [3, 3]   # one per update, not row counts
    assert {e.status for e in detail.site_events if e.round == 3} == {"evaluated"}   # the final model was evaluated


def test_distributed_dp_under_secure_aggregation_stores_no_per_site_metrics(federation):
    for name in "abc":
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    job = heart_job(rounds=1, min=3) + (f"privacy: {{secure_aggregation: true, {DP.format(mode='distributed')}, "
                                        "secagg: {phase_timeout_s: 20}}\n")
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    assert _per_site(federation, job_id) == []
    assert next(r for r in federation.admin().job(job_id).rounds if r.round == 1).total_samples == 3
