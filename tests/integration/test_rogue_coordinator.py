"""A malicious coordinator cannot make a site write outside its state_dir or spend past its policy."""

from __future__ import annotations

import pytest

from plexus.accounting import PrivacyLedger, dp_sgd_epsilon
from plexus.config import DatasetSpec, PolicySpec
from plexus.datasets import load_dataset

from integration.harness import heart_job
from integration.rogue import DP_SGD_JOB, rogue_federation, site_agents, stop_site


@pytest.fixture
def rogue(tmp_path):
    with rogue_federation(tmp_path, "rogue-test") as coordinator:
        yield coordinator


@pytest.fixture
def site(rogue, tmp_path):
    """Start (and, at the end, stop) site agents on one state_dir."""
    with site_agents(rogue, tmp_path / "site" / "state") as start:
        yield start


def _files(root):
    return {p for p in root.rglob("*") if p.is_file()}


def test_job_ids_that_name_paths_are_declined_and_nothing_lands_outside_state_dir(rogue, site, tmp_path):
    state_dir = tmp_path / "site" / "state"
    site(PolicySpec(allowed_models=("logistic",)))
    outside = tmp_path / "outside"
    outside.mkdir()
    before = _files(tmp_path) - _files(state_dir)
    for job_id in ("../../escape", str(outside / "abs"), "ok/../../../escape2", "..", ".hidden", "x\ny", "", "a" * 200):
        got = rogue.ask(job_id, DP_SGD_JOB)
        assert got.what == "RESULT_DECLINED", (job_id, got)
        assert "job id" in got.reason and "letters, digits" in got.reason, got.reason
    # The site kept serving: an ordinary id trains, and its ledger is where it belongs.
    assert rogue.ask("replayed-0123abcd", DP_SGD_JOB).what == "update"
    assert (state_dir / "dp_sgd" / "replayed-0123abcd.json").is_file()
    assert _files(tmp_path) - _files(state_dir) == before, "the site wrote a file outside its state_dir"


def _train_rows() -> int:
    return len(load_dataset(DatasetSpec(kind="heart-disease", hospital="cleveland")).y_train)


def test_replayed_round_one_cannot_spend_past_max_epsilon(rogue, site, tmp_path):
    rows = _train_rows()
    cap = dp_sgd_epsilon(3, train_size=rows, batch_size=32, epochs=1, noise_multiplier=1.0, delta=1e-5)
    site(PolicySpec(allowed_models=("logistic",), max_epsilon=cap))
    answers = [rogue.ask("replayed-0123abcd", DP_SGD_JOB, round_=1).what for _ in range(5)]
    assert answers == ["update"] * 3 + ["RESULT_DECLINED"] * 2, answers
    ledger = PrivacyLedger.from_json((tmp_path / "site" / "state" / "dp_sgd" / "replayed-0123abcd.json").read_text())
    assert ledger.epsilon(1e-5) <= cap


def test_max_rounds_counts_the_rounds_the_site_ran_across_restarts(rogue, site):
    job = heart_job(name="replayed", rounds=2)
    agent, thread = site(PolicySpec(allowed_models=("logistic",), max_rounds=2))
    assert [rogue.ask("replayed-0123abcd", job, round_=1).what for _ in range(2)] == ["update", "update"]
    got = rogue.ask("replayed-0123abcd", job, round_=1)
    assert got.what == "RESULT_DECLINED" and "policy.max_rounds allows at most 2" in got.reason, got
    stop_site(agent, thread)
    site(PolicySpec(allowed_models=("logistic",), max_rounds=2))   # a restarted agent remembers
    assert rogue.ask("replayed-0123abcd", job, round_=2).what == "RESULT_DECLINED"
    assert rogue.ask("another-0123abcd", job, round_=1).what == "update"   # counted per job
