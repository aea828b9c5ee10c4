"""SyncRounds on its own: a real Store in tmp_path, an injected clock, no gRPC and no engine thread."""

from __future__ import annotations

import numpy as np
import pytest
from driver_rig import DriverRig, rigs

from coordinator.drivers.rounds import Action, RoundView, decide
from coordinator.drivers.sync import SyncRounds
from coordinator.tasks import Binding, TaskGrant, TaskResult
from plexus.errors import FailedPrecondition, IntegrityError, RoundClosed
from plexus.vocab import TaskKind, TaskStatus

JOB = """\
name: job
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
sites: {sites}
strategy: {{name: fedavg}}
seed: 0
"""


class Rig(DriverRig):
    """SyncRounds over a real store, with a clock that moves only when told."""

    driver_class = SyncRounds

    def __init__(self, path, *, sites: str, rounds: int = 1):
        super().__init__(path, JOB.format(rounds=rounds, sites=sites))

    def tick(self) -> float:
        return self.driver.tick(self.now)

    def open_round(self, *sites: str) -> dict[str, TaskGrant]:
        """The sites join, a tick opens the round, and each takes its task."""
        self.join(*sites)
        self.tick()
        return {s: self.driver.grant(s) for s in sites}

    def model(self, round_: int) -> list[float]:
        return self.store.load_checkpoint(self.job_id, round_)["w"].tolist()

    def outcome(self, site: str, round_: int = 1) -> tuple[str, str]:
        return next((status, reason) for s, status, r, reason in self.store.site_events(self.job_id)
                    if s == site and r == round_)


@pytest.fixture
def rig(tmp_path):
    yield from rigs(tmp_path, Rig)


def test_a_round_closes_on_quorum_with_the_exact_weighted_mean(rig):
    r = rig(sites="{min: 2, deadline_s: 60}")
    r.join("a", "b")
    r.tick()
    assert r.driver.round.participants == ["a", "b"]
    grants = {s: r.driver.grant(s) for s in ("a", "b")}
    assert all(g.kind == TaskKind.TRAIN and g.round == 1 for g in grants.values())
    assert r.driver.grant("a") is grants["a"]   # asked again, the same task
    assert "accepted" in r.send("a", grants["a"], [1, 2, 3, 4], num_samples=100)
    assert r.tick() <= 1.0 and r.driver.round is not None   # b's answer is still due
    r.send("b", grants["b"], [3, 2, 1, 0], num_samples=300)
    assert r.tick() == 0.0
    assert r.driver.round is None and r.store.job(r.job_id).current_round == 1
    assert r.model(1) == [2.5, 2.0, 1.5, 1.0]   # (100·a + 300·b) / 400


def test_trained_answers_only_an_asynchronous_secure_jobs_training_task(rig):
    r = rig(sites="{min: 1, deadline_s: 60}")
    grant = r.open_round("a")["a"]
    with pytest.raises(FailedPrecondition, match="runs in synchronous rounds"):
        r.driver.answered("a", grant, TaskResult(Binding(grant.task_id, grant.job_id, grant.round, grant.nonce),
                                                 TaskStatus.TRAINED))


def test_the_deadline_closes_a_round_with_the_sites_that_answered_and_the_rest_late(rig):
    r = rig(sites="{min: 1, deadline_s: 60}")
    grants = r.open_round("a", "b")
    r.send("a", grants["a"], [4, 4, 4, 4])
    r.now += 59.5
    assert 0 < r.tick() <= 0.5 and r.driver.round is not None   # waits out the deadline, no longer
    r.now += 1.0
    r.tick()
    assert r.store.job(r.job_id).current_round == 1 and r.model(1) == [4.0] * 4
    assert r.outcome("b") == ("late", "no update by the round deadline (60 s)")
    with pytest.raises(RoundClosed):   # b's task is no longer current
        r.driver.current("b", grants["b"].task_id, 1, "issued")


def test_an_update_refused_part_way_is_withdrawn_from_the_sum(rig):
    r = rig(sites="{min: 1, deadline_s: 60}")
    grants = r.open_round("a", "b")

    def broken(blob, cuts):   # half of b's update is folded, then a non-finite value arrives
        yield 0, blob[:8]
        yield 8, np.array([np.nan, 0], np.float32).tobytes()
    with pytest.raises(IntegrityError):
        r.send("b", grants["b"], [100, 100, 100, 100], chunks=broken)
    assert r.outcome("b")[0] == "rejected"
    r.send("a", grants["a"], [1, 1, 1, 1])
    r.tick()
    assert r.model(1) == [1.0] * 4   # nothing of b's first half is left in the mean


def test_an_update_still_arriving_at_the_deadline_is_cut_and_taken_out(rig):
    r = rig(sites="{min: 1, deadline_s: 60}")
    grants = r.open_round("a", "b")
    r.send("a", grants["a"], [2, 2, 2, 2])

    def slow(blob, cuts):   # b's first half is in when the deadline passes and the round closes under it
        yield 0, blob[:8]
        r.now += 61
        r.tick()
        assert len(cuts) == 1 and isinstance(cuts[0], RoundClosed)
        raise cuts[0]   # as the service's stream reader does once cut
    with pytest.raises(RoundClosed):
        r.send("b", grants["b"], [50, 50, 50, 50], chunks=slow)
    assert r.model(1) == [2.0] * 4
    assert r.outcome("b") == ("late", "no update by the round deadline (60 s)")


def test_a_failed_job_resumes_from_its_last_closed_round(rig):
    r = rig(sites="{min: 2, deadline_s: 60}", rounds=2)
    grants = r.open_round("a", "b")
    for site, grant in grants.items():
        r.send(site, grant, [1, 1, 1, 1])
    r.tick()   # round 1 closed
    r.tick()   # round 2 opens; only a answers
    r.send("a", r.driver.grant("a"), [5, 5, 5, 5])
    r.now += 61
    r.tick()
    assert r.driver.ended and r.store.job(r.job_id).status == "failed"
    assert "round 2 failed: 1 update(s), below sites.min=2" in r.store.job(r.job_id).message

    r.store.set_job(r.job_id, status="running", message="resumed")   # what Engine.resume records
    r.driver = r.take_up()
    assert r.driver.job.model_round == 1
    grants = r.open_round("a", "b")   # the sites, gone past the online window, are back
    assert {g.round for g in grants.values()} == {2} and {g.model_round for g in grants.values()} == {1}
    for site, grant in grants.items():
        r.send(site, grant, [3, 3, 3, 3])
    r.tick()
    assert r.store.job(r.job_id).current_round == 2 and r.model(2) == [3.0] * 4


@pytest.mark.parametrize("view, now, action, late", [
    (RoundView("train", ["a", "b"], {"a": "submitted"}, deadline=10, contributors=1), 5, Action.WAIT, False),
    (RoundView("train", ["a", "b"], {"a": "submitted"}, deadline=10, contributors=1), 10, Action.CLOSE, True),
    (RoundView("train", ["a"], {"a": "submitted"}, receiving=True, deadline=10, contributors=1), 5, Action.WAIT,
     False),
    (RoundView("train", ["a", "b"], {"a": "submitted", "b": "failed"}, deadline=10, contributors=1, needed=2), 5,
     Action.MISSED, False),
    (RoundView("train", ["a"], {"a": "submitted"}, evaluators=["e"], deadline=10, contributors=1), 5, Action.WAIT,
     False),
    (RoundView("train", ["a"], {"a": "submitted"}, evaluators=["e"], deadline=10, secure=True), 5, Action.ADVANCE,
     False),
    (RoundView("evaluate", ["a"], {"a": "evaluated"}, deadline=10), 5, Action.FINISH, False),
])
def test_the_decision_core(view, now, action, late):
    decision = decide(view, now)
    assert (decision.action, decision.by_deadline) == (action, late)
    if action == Action.WAIT:
        assert decision.wait_s == min(view.deadline - now, 1.0)


def test_an_int8_secure_round_over_more_sites_than_its_field_sums_is_never_opened(rig):
    r = rig(sites="{min: 3, deadline_s: 60}\nprivacy: {secure_aggregation: true}\n"
                  "compression: {uplink: {codec: int8}}")
    r.join(*(f"s{i:03d}" for i in range(112)))
    r.tick()
    job = r.store.job(r.job_id)
    assert r.driver.ended and r.driver.round is None and job.status == "failed"
    assert "112 sites would train" in job.message and "at most 111 sites per round" in job.message
    assert "set sites.count to 111 or fewer" in job.message
    capped = rig(sites="{min: 3, count: 111, deadline_s: 60}\nprivacy: {secure_aggregation: true}\n"
                       "compression: {uplink: {codec: int8}}")
    capped.join(*(f"s{i:03d}" for i in range(112)))
    capped.tick()
    secure = capped.driver.round.secure
    assert len(capped.driver.round.participants) == 111 and secure.masked_layout.tensors[0].dtype == "U8"
