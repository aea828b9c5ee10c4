"""Tests for site_agent.state: per-job files stay inside state_dir; the site's own round count and ledger."""

from __future__ import annotations

import pytest

from plexus.accounting import PrivacyLedger
from plexus.config import PolicySpec, parse_round_config
from plexus.errors import IntegrityError
from site_agent.policy import refusal
from site_agent.state import JobState, job_id_refusal, job_path


@pytest.mark.parametrize("bad", ["../x", "../../x", "/etc/passwd", "a/b", "a\\b", "..", ".", ".hidden", "",
                                 "x\n", "x\0", "-rf", "a" * 129, "job\u2215slash"])
def test_ids_that_could_name_paths_are_refused(tmp_path, bad):
    assert "is not a valid job id" in job_id_refusal(bad)
    with pytest.raises(IntegrityError, match="no path separators"):
        job_path(tmp_path, "dp_sgd", bad, ".json")


def test_coordinator_job_ids_map_inside_state_dir(tmp_path):
    assert job_id_refusal("heart-fedavg-0123abcd") is None
    path = job_path(tmp_path, "dp_sgd", "a..b-0123abcd", ".json")
    assert path == tmp_path.resolve() / "dp_sgd" / "a..b-0123abcd.json"


def test_a_planted_symlink_cannot_lead_outside(tmp_path):
    (tmp_path / "state" / "dp_sgd").mkdir(parents=True)
    (tmp_path / "state" / "dp_sgd" / "job-1.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(IntegrityError, match="outside this site's state_dir"):
        job_path(tmp_path / "state", "dp_sgd", "job-1", ".json")


def test_round_count_and_ledger_persist(tmp_path):
    state = JobState(tmp_path, "job-1")
    assert state.rounds_trained() == 0 and state.ledger().history == []
    state.count_round()
    state.count_round()
    ledger = PrivacyLedger()
    ledger.step(1.0, 0.1, steps=7)
    state.keep_ledger(ledger)
    again = JobState(tmp_path, "job-1")
    assert again.rounds_trained() == 2 and again.ledger().history == [(1.0, 0.1, 7)]
    assert JobState(tmp_path, "job-2").rounds_trained() == 0


def test_a_damaged_round_count_is_an_error_not_zero(tmp_path):
    JobState(tmp_path, "job-1").count_round()
    (tmp_path / "rounds" / "job-1.json").write_text('{"trained": -3}')
    with pytest.raises(IntegrityError, match="damaged"):
        JobState(tmp_path, "job-1").rounds_trained()


DP_SGD = """name: j
model: {name: mlp, args: {in_features: 13}}
data: {dataset: heart-disease}
rounds: 10
train: {epochs: 1, batch_size: 32}
privacy: {dp_sgd: {noise_multiplier: NOISE, max_grad_norm: 1.0}}
"""


def test_epsilon_at_a_round_is_the_ledger_plus_this_round_whatever_earlier_tasks_said(tmp_path):
    """A coordinator that sent low-noise tasks before cannot make the next one look cheap."""
    policy = PolicySpec(allowed_models=("mlp",), max_epsilon=8.0)
    job = parse_round_config(DP_SGD.replace("NOISE", "2.0"))
    spent = PrivacyLedger()
    assert refusal(policy, job, {"mlp"}, train_size=300, round_=2, ledger=spent) is None
    spent.step(0.3, 0.1, steps=50)   # what the site really ran for an earlier, low-noise task of the job
    got = refusal(policy, job, {"mlp"}, train_size=300, round_=2, ledger=spent)
    assert got and "above this site's policy.max_epsilon 8.0" in got, got


def test_max_rounds_at_a_round_counts_the_sites_own_rounds():
    job = parse_round_config(DP_SGD.replace("NOISE", "1.0").replace("rounds: 10", "rounds: 3"))
    policy = PolicySpec(allowed_models=("mlp",), max_rounds=3)
    assert refusal(policy, job, {"mlp"}, train_size=300, round_=3) is None
    assert "policy.max_rounds allows at most 3" in refusal(policy, job, {"mlp"}, train_size=300, round_=4)
