"""The round engine's wake-ups, presence, rejoin wait, round retries and `job resume`, on a real Store (no
gRPC, no model worker: jobs are put in the store with their round-0 checkpoint, as submit would)."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from coordinator.engine import Engine
from coordinator.service import update_header
from coordinator.store import Store
from coordinator.tasks import JoinInfo
from plexus.config import dump_round_config, load_coordinator_config, parse_round_config
from plexus.errors import ConfigError, FailedPrecondition
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import encode, iter_chunks

from integration.harness import wait_until

JOB = """\
name: {name}
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
sites: {sites}
strategy: {{name: {strategy}}}
seed: 0
"""


def add_job(store: Store, *, sites: str, rounds: int = 1, name: str = "job", strategy: str = "fedavg") -> str:
    """A queued job, as Engine.submit leaves it (without building a model in the worker)."""
    cfg = parse_round_config(JOB.format(name=name, rounds=rounds, sites=sites, strategy=strategy), source="test job")
    job_id = f"{name}-{uuid.uuid4().hex[:8]}"
    store.save_checkpoint(job_id, 0, {"w": np.zeros(4, np.float32)})
    store.add_job(job_id, cfg.name, dump_round_config(cfg), cfg.strategy.name, cfg.rounds, "test")
    return job_id


def join(engine: Engine, site: str, rows: int = 100) -> None:
    engine.join(site, JoinInfo(agent_version="test", models=("vector",), datasets=("heart-disease",),
                               dataset_rows={"heart-disease": rows}))


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "state")
    yield store
    store.close()


class Polls:
    """Long-polling threads, one per site, each recording the task it got (None: timed out or stopped)."""

    def __init__(self, engine: Engine, sites, wait_s: float):
        self.engine, self.got = engine, {}
        self.threads = [threading.Thread(target=self._poll, args=(s, wait_s), daemon=True) for s in sites]
        for t in self.threads:
            t.start()
        # read under the engine lock: each poller registered its condition and released the lock only to wait
        wait_until(lambda: engine.polling_sites == len(self.threads), 30, "every site to long-poll")

    def _poll(self, site: str, wait_s: float) -> None:
        self.got[site] = self.engine.next_task(site, wait_s)

    def join(self) -> None:
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads)


def test_idle_long_polls_are_not_woken_and_a_round_wakes_only_its_participant(store):
    engine = Engine(store, poll_timeout_s=60.0)
    sites = [f"s{i}" for i in range(8)]
    for site in sites:
        join(engine, site)
    engine.start()
    try:
        polls = Polls(engine, sites, 60.0)
        join(engine, "s0")   # a (re)join wakes the round loop, not the sites' polls
        assert engine.poll_wakeups == 0
        add_job(store, sites="{min: 1, count: 1, evaluate: participants}")
        chosen = wait_until(lambda: [s for s, task in polls.got.items() if task is not None], 30,
                            "the sampled site to get its task long before its poll times out")
        assert len(chosen) == 1
        assert engine.poll_wakeups == 1                         # that site's poll only
        assert len(polls.got) == 1                              # the others still wait, undisturbed
    finally:
        engine.stop()
    polls.join()
    assert sorted(s for s, task in polls.got.items() if task is None) == sorted(set(sites) - set(chosen))


class Clock:
    """An injectable monotonic clock that moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def submit(engine: Engine, store: Store, site: str, task, num_samples: int = 100) -> str:
    """The site fetches the model, 'trains' (sends it back) and uploads it, as SubmitUpdate would hand it over."""
    engine.model_for(site, task.task_id)
    layout, blob = encode(store.load_checkpoint(task.job_id, task.model_round))
    header = fpb.UpdateHeader(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                              num_samples=num_samples, manifest=layout.to_proto())
    chunks = ((o, bytes(d)) for o, d in iter_chunks(blob, 64))
    return engine.submit_update(site, update_header(header), chunks)


def test_a_site_training_longer_than_the_online_window_is_in_the_next_round(store):
    """Before: only Join and NextTask counted as presence, so sites that trained (and uploaded) for longer
    than the online window were offline when round 1 closed, and round 2 waited for them."""
    clock = Clock()
    engine = Engine(store, poll_timeout_s=1.0, monotonic=clock)   # online window: 12 s
    for site in ("a", "b"):
        join(engine, site)
    job_id = add_job(store, sites="{min: 2}", rounds=2)
    engine.start()
    try:
        tasks = {site: engine.next_task(site, 1.0) for site in ("a", "b")}   # the clock stands: waits for them
        clock.now += 60   # both train for a minute
        assert engine.online_sites() == {"a", "b"}   # holding unanswered tasks: busy, not gone
        for site in ("a", "b"):
            submit(engine, store, site, tasks[site])
        wait_until(lambda: store.job(job_id).current_round == 1, 30, "round 1 to close")
        round2 = wait_until(lambda: engine.driver and engine.driver.round, 30, "round 2 to open")
        assert round2.round == 2 and round2.participants == ["a", "b"]
    finally:
        engine.stop()


def test_a_resumed_job_waits_for_its_sites_until_the_last_one_is_back(store):
    """After a restart the job's sites (a, b, c) are waited for, but not d, registered and never in the job:
    the round opens as soon as c is back, and not before."""
    job_id = add_job(store, sites="{min: 2}", rounds=3)
    store.set_job(job_id, status="running", current_round=1)
    store.save_checkpoint(job_id, 1, {"w": np.ones(4, np.float32)})
    store.save_strategy_state(job_id, 1, {}, {})
    for site in ("a", "b", "c"):
        store.add_task(uuid.uuid4().hex, job_id, 1, site, "train", b"n" * 16)
    store.site_seen("d")
    clock = Clock()
    engine = Engine(store, poll_timeout_s=1.0, rejoin_grace_s=12.0, monotonic=clock)
    engine.start()
    try:
        join(engine, "a")
        join(engine, "b")
        wait_until(lambda: "for the job's sites to connect: c" in store.job(job_id).message, 30, "the wait for c")
        clock.now += 11   # c's backoff: just inside the grace
        assert engine.driver.round is None
        join(engine, "c")
        round2 = wait_until(lambda: engine.driver.round, 30, "round 2 to open once c is back")
        assert round2.round == 2 and round2.participants == ["a", "b", "c"]
    finally:
        engine.stop()


@pytest.mark.parametrize("grace, ok", [(0, True), (10, False), (9.5, False), (10.5, True), (15, True)])
def test_the_rejoin_grace_must_outlast_a_sites_longest_backoff_wait(tmp_path, grace, ok):
    """A site waits up to 8 s × 1.25 between reconnection attempts; a grace no longer than that (the trial
    had 15 s against 8 s + jitter and a slow restart) could open the round just before the last site is back."""
    path = tmp_path / "coordinator.yaml"
    path.write_text(f'listen: "127.0.0.1:0"\nkit: kit\nrejoin_grace_s: {grace}\n')
    if ok:
        assert load_coordinator_config(path).rejoin_grace_s == grace
    else:
        with pytest.raises(ConfigError, match=r"coordinator.yaml:3: rejoin_grace_s: .* more than 10 s"):
            load_coordinator_config(path)


def _round_one(engine: Engine, clock: Clock, *, late: str) -> None:
    """Round 1 of a two-site job: a answers, `late` takes its task and lets the deadline pass."""
    for site in ("a", "b"):
        join(engine, site)
    tasks = {site: wait_until(lambda s=site: engine.next_task(s, 0.0), 30, f"{site}'s task") for site in ("a", "b")}
    submit(engine, engine.store, "a" if late == "b" else "b", tasks["a" if late == "b" else "b"])
    clock.now += 61


def test_a_round_that_misses_its_quorum_is_opened_again_while_retries_last(store):
    clock = Clock()
    engine = Engine(store, poll_timeout_s=1.0, monotonic=clock)
    job_id = add_job(store, sites="{min: 2, deadline_s: 60, retries: 1}")
    engine.start()
    try:
        _round_one(engine, clock, late="b")
        [retry] = wait_until(lambda: [e for e in store.events_after(job_id, 0) if e[2] == "round_retry"], 30,
                             "round 1 to be retried")
        assert retry[5] == ("round 1 missed its quorum: 1 update(s), below sites.min=2 (other sites — b: late); "
                            "opening it again (retry 1 of sites.retries=1)")
        assert (store.job(job_id).status, store.job(job_id).current_round) == ("running", 0)
        assert ("b", "late", 1, "no update by the round deadline (60 s)") in store.site_events(job_id)

        clock.now += 1   # the wait before a retry (RETRY_WAIT_S)
        _round_one(engine, clock, late="a")   # the second miss: no retry left
        assert wait_until(lambda: store.job(job_id).status == "failed" and store.job(job_id), 30).message \
            .startswith("round 1 failed: 1 update(s), below sites.min=2 (other sites — a: late)")
    finally:
        engine.stop()
    kinds = [e[2] for e in store.events_after(job_id, 0)]
    assert kinds.count("round_retry") == 1 and kinds.count("round_opened") == 2 and kinds[-1] == "job_failed"


def test_a_retried_round_goes_to_the_site_the_schedule_had_due_not_the_next(store):
    """cwt commits its next site when a round opens; the retry rolls that back, so a is asked again (and b,
    next in the cycle, is not skipped to)."""
    clock = Clock()
    engine = Engine(store, poll_timeout_s=1.0, monotonic=clock)
    job_id = add_job(store, sites="{min: 1, deadline_s: 60, retries: 1}", rounds=2, strategy="cwt")
    for site in ("a", "b"):
        join(engine, site)
    engine.start()
    try:
        assert wait_until(lambda: engine.next_task("a", 0.0), 30, "a's task").round == 1   # a takes it, never answers
        clock.now += 61
        wait_until(lambda: "round_retry" in [e[2] for e in store.events_after(job_id, 0)], 30, "the retry")
        clock.now += 1   # the wait before a retry (RETRY_WAIT_S)
        for site in ("a", "b"):
            join(engine, site)
        again = wait_until(lambda: engine.driver and engine.driver.round, 30, "round 1 to open again")
        assert (again.round, again.participants) == (1, ["a"])
    finally:
        engine.stop()


def test_resume_runs_a_failed_job_again_from_its_last_closed_round(store):
    clock = Clock()
    engine = Engine(store, poll_timeout_s=1.0, monotonic=clock)
    job_id = add_job(store, sites="{min: 2, deadline_s: 60}", rounds=2)
    engine.start()
    try:
        _round_one(engine, clock, late="b")
        wait_until(lambda: store.job(job_id).status == "failed", 30, "the job to fail on the missed quorum")
        resumed = engine.resume(job_id, "ann")   # read before the engine thread can take the job up again
        assert (resumed.status, resumed.message) == ("running", "resumed by ann after round 0")
        for site in ("a", "b"):
            join(engine, site)
        tasks = {s: wait_until(lambda s=s: engine.next_task(s, 0.0), 30, f"{s}'s task") for s in ("a", "b")}
        assert {t.round for t in tasks.values()} == {1}   # round 1 again, from the round-0 model
        for site, task in tasks.items():
            submit(engine, store, site, task)
        wait_until(lambda: store.job(job_id).current_round == 1, 30, "round 1 to close")
    finally:
        engine.stop()
    events = store.events_after(job_id, 0)
    asked = [e for e in events if e[2] == "job_resume_requested"]
    assert len(asked) == 1 and asked[0][5].startswith("resumed by ann after round 0 (it had failed: round 1 failed")
    assert [e[2] for e in events].index("job_resumed") > [e[2] for e in events].index("job_resume_requested")


@pytest.mark.parametrize("status, why", [
    ("queued", "it has not started yet"), ("running", "it is running"),
    ("completed", "it has ended; submit it again to train more"),
    ("budget_reached", "it spent its privacy budget"), ("aborted", "an aborted job stays aborted")])
def test_resume_refuses_a_job_that_has_not_failed(store, status, why):
    job_id = add_job(store, sites="{min: 1}")
    if status != "queued":
        store.set_job(job_id, status=status)
    with pytest.raises(FailedPrecondition, match=f"job {job_id} is {status}; only a failed job can be resumed "
                                                 rf"\({why}"):
        Engine(store).resume(job_id, "ann")
    assert store.job(job_id).status == status


def test_resume_refuses_a_failed_job_whose_checkpoint_is_damaged_until_it_is_restored(store):
    job_id = add_job(store, sites="{min: 1}")
    store.set_job(job_id, status="failed", message="round 1 failed: 0 update(s), below sites.min=1")
    path = store.checkpoint_path(job_id, 0)
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    engine = Engine(store)

    with pytest.raises(FailedPrecondition, match=rf"job {job_id} cannot be resumed: checkpoint .* is damaged: "
                                                 r"its SHA-256 is .*; restore the state directory from a backup"):
        engine.resume(job_id, "ann")
    assert store.job(job_id).status == "failed"

    path.write_bytes(good)
    engine.resume(job_id, "ann")
    assert store.job(job_id).status == "running"
