"""A malicious coordinator cannot make a site write outside its state_dir or spend past its policy."""

from __future__ import annotations

import errno
import os
import resource
import time

import pytest

from plexus import identity, transport
from plexus.accounting import PrivacyLedger, dp_sgd_epsilon
from plexus.config import DatasetSpec, PolicySpec
from plexus.datasets import load_dataset
from plexus.errors import IntegrityError
from plexus.memory import machine_memory
from plexus.proto.plexus.v1 import federation_pb2 as fpb, federation_pb2_grpc
from site_agent import split as site_split

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


def test_a_lost_dp_sgd_ledger_is_refused_instead_of_starting_the_budget_over(rogue, site, tmp_path):
    """Before: deleting dp_sgd/JOB.json (or a restore from an old backup without it) gave the job a fresh privacy
    budget. Each round's spend is recorded before it trains, so after trained rounds an empty ledger was lost."""
    state = tmp_path / "site" / "state"
    site(PolicySpec(allowed_models=("logistic",), max_epsilon=50.0))
    assert [rogue.ask("lost-0123abcd", DP_SGD_JOB, round_=r).what for r in (1, 2)] == ["update", "update"]
    ledger = state / "dp_sgd" / "lost-0123abcd.json"
    kept = ledger.read_bytes()
    rows = _train_rows()
    assert PrivacyLedger.from_json(kept.decode()).epsilon(1e-5) == pytest.approx(
        dp_sgd_epsilon(2, train_size=rows, batch_size=32, epochs=1, noise_multiplier=1.0, delta=1e-5), rel=1e-9)
    for lost in (None, b"[]"):
        ledger.unlink() if lost is None else ledger.write_bytes(lost)
        got = rogue.ask("lost-0123abcd", DP_SGD_JOB, round_=3)
        assert got.what == "RESULT_DECLINED", got
        assert ("has trained 2 round(s) of job 'lost-0123abcd' with DP-SGD and its privacy ledger "
                "(dp_sgd/lost-0123abcd.json in its state_dir) is missing or empty") in got.reason, got.reason
    ledger.write_bytes(kept)   # restored from the backup
    assert rogue.ask("lost-0123abcd", DP_SGD_JOB, round_=3).what == "update"


def test_a_full_state_dir_is_reported_as_such_without_the_local_path(rogue, site, tmp_path, monkeypatch):
    """Before: the coordinator was told "OSError: [Errno 28] No space left on device: '/srv/.../rounds/x.json'"."""
    import site_agent.state

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    site(PolicySpec(allowed_models=("logistic",)))
    monkeypatch.setattr(site_agent.state, "write_atomically", full)
    got = rogue.ask("full-0123abcd", heart_job(name="full"))
    assert got.what == "RESULT_FAILED", got
    assert got.reason == ("this site cannot write its state_dir (No space left on device); its tasks fail until its "
                          "operator frees space there (its log names the file)"), got.reason
    monkeypatch.undo()
    assert rogue.ask("full-0123abcd", heart_job(name="full")).what == "update"


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


SECURE_JOB = heart_job(name="masked", rounds=3, min=3) + "privacy: {secure_aggregation: true}\n"
SPLIT_JOB = """\
name: cut
model: {name: mlp, args: {in_features: 13, hidden: [16], num_classes: 2}}
data: {dataset: heart-disease}
mode: split
rounds: 1
split: {variant: vanilla, cuts: [hidden1], schedule: synchronous, batch_timeout_s: 1}
"""


@pytest.mark.parametrize("job, kind, says", [
    (SECURE_JOB, fpb.TASK_TRAIN, "a plain TASK_TRAIN would send this site's update in the clear"),
    (heart_job(name="plain"), 77, "task kind 77 is not one this site agent runs"),
    (heart_job(name="plain"), fpb.TASK_SPLIT_TRAIN, "a TASK_SPLIT_TRAIN task does not belong to a federated job"),
    (heart_job(name="plain"), fpb.TASK_SECAGG_UNMASK, "does not belong to a job without secure aggregation"),
    (SPLIT_JOB, fpb.TASK_TRAIN, "a TASK_TRAIN task does not belong to a split job"),
])
def test_a_task_kind_the_job_does_not_have_is_declined_before_anything_runs(rogue, site, tmp_path, job, kind, says):
    """The coordinator picks the kind: a plain training task in a secure job would have sent the update unmasked,
    and a kind the agent does not know trained without counting towards max_rounds or the DP ledger."""
    site(PolicySpec(allowed_models=("logistic", "mlp"), max_rounds=5))
    got = rogue.ask("kinds-0123abcd", job, kind=kind)
    assert got.what == "RESULT_DECLINED" and says in got.reason, got
    assert not (tmp_path / "site" / "state" / "rounds").exists()   # no round counted: nothing trained
    assert rogue.ask("kinds-0123abcd", heart_job(name="plain")).what == "update"   # and the site goes on


def test_absurd_local_steps_and_an_empty_model_stream_fail_the_task_and_the_site_goes_on(rogue, site):
    site(PolicySpec(allowed_models=("logistic",)))
    got = rogue.ask("steps-0123abcd", heart_job(name="steps"), local_steps=2**32 - 1, timeout=30)
    assert got.what == "RESULT_FAILED" and "4294967295 local steps were asked for" in got.reason, got
    rogue.empty_models = True
    got = rogue.ask("empty-0123abcd", heart_job(name="empty"), timeout=30)
    assert got.what == "RESULT_FAILED" and "the model stream ended before its header" in got.reason, got
    rogue.empty_models = False
    assert rogue.ask("steps-0123abcd", heart_job(name="steps")).what == "update"


def test_a_model_larger_than_the_machine_is_declined_before_it_is_built(rogue, site):
    """Twice this machine's memory in float32 parameters: building it would have failed at best, and taken the
    machine's memory at worst (a few layers each smaller than it)."""
    site(PolicySpec(allowed_models=("logistic", "vector")))
    words = machine_memory() // 2
    huge = heart_job(name="huge").replace("model: {name: logistic, args: {in_features: 13, num_classes: 2}}",
                                          f"model: {{name: vector, args: {{size: {words}, chunks: 4}}}}")
    assert "name: vector" in huge
    got = rogue.ask("huge-0123abcd", huge, timeout=30)
    assert got.what == "RESULT_DECLINED" and f"holds {4 * words:,} bytes" in got.reason, got
    assert "a quarter of this machine's memory" in got.reason
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 << 20   # KiB: the test process stayed under 4 GiB
    assert rogue.ask("steps-0123abcd", heart_job(name="steps")).what == "update"


def test_a_split_session_the_coordinator_stops_answering_ends_at_the_reply_timeout(rogue):
    """The connection stays up (keepalives are answered), so only the site's own clock can end the wait."""
    channel = transport.channel(identity.load_kit(rogue.root / "sites" / "a"), rogue.address)
    try:
        stream = site_split.Stream(federation_pb2_grpc.FederationStub(channel), reply_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(IntegrityError, match="the coordinator did not answer within 1 s"):
            stream.ask(fpb.SplitMessage(open=fpb.SplitOpen(task_id="t", batches=1)))
        assert rogue.split_opened.is_set() and time.monotonic() - started < 10
        stream.close()
    finally:
        channel.close()
