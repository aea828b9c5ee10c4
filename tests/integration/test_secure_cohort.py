"""Secure aggregation never sums fewer sites than the minimum cohort (issue 21 item 2), over real gRPC + mTLS."""

from __future__ import annotations

import dataclasses
import threading

import grpc
import pytest

from coordinator.drivers import sync
from plexus.config import DatasetSpec, PolicySpec, SiteConfig
from site_agent.agent import SiteAgent

from integration.harness import HOSPITAL_OF, heart_job

SECURE = "privacy: {secure_aggregation: true, secagg: {phase_timeout_s: 5}}\n"


def _start(federation, name: str) -> SiteAgent:
    config = SiteConfig(site=name, coordinator=federation.address, kit=federation.root / "sites" / name,
                        state_dir=federation.root / "sites" / name / "state",
                        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[name])},
                        policy=PolicySpec(allowed_models=("logistic",), require_secure_aggregation=True))
    agent = SiteAgent(config, backoff_cap_s=0.5)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    federation.agents.append((agent, thread))
    return agent


def test_a_secure_job_over_fewer_than_three_sites_is_refused_at_submit(federation):
    for sites in ("{min: 1, count: 1}", "{min: 2}"):
        job = heart_job(rounds=1).replace("sites: {min: 2, deadline_s: 30}", f"sites: {sites}") + SECURE
        with pytest.raises(grpc.RpcError) as err:
            federation.admin().submit(job)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "submitted round config:5: sites: min is" in err.value.details()
        assert "secure_aggregation needs at least 3 sites" in err.value.details()
    assert federation.store.jobs() == []


def test_a_site_will_not_be_unmasked_alone_by_a_coordinator_that_ignores_sites_min(federation, monkeypatch):
    """The job says sites.min 3 (so the site's policy accepts it); the coordinator runs it with one site."""
    honest_parse = sync.parse_round_config

    def lying_parse(text, *, source):
        cfg = honest_parse(text, source=source)
        if not source.startswith("job "):   # the stored config, which sites are sent, stays honest
            return cfg
        return dataclasses.replace(cfg, sites=dataclasses.replace(cfg.sites, min=1))

    monkeypatch.setattr(sync, "parse_round_config", lying_parse)
    _start(federation, "a")
    federation.wait_online("a")
    job_id = federation.admin().submit(heart_job(rounds=1, min=3, deadline=30) + SECURE).job_id
    status = federation.wait_job(job_id)
    # Before: the round "completed" over U1 = {a} with t = 1, and checkpoint 1 was a's own trained model.
    assert status == "failed"
    assert not federation.store.checkpoint_path(job_id, 1).exists()
    failed = [e for e in federation.admin().job(job_id).site_events if e.site == "a" and e.status == "failed"]
    assert failed and "minimum secure cohort of 3" in failed[0].reason and "share its secrets" in failed[0].reason
