"""The round engine's wake-ups, presence and rejoin wait, on a real Store (no gRPC, no model worker:
jobs are put in the store with their round-0 checkpoint, as submit would)."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from coordinator.engine import Engine
from coordinator.store import Store
from integration.harness import wait_until
from plexus.config import dump_round_config, load_coordinator_config, parse_round_config
from plexus.errors import ConfigError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import encode, iter_chunks

JOB = """\
name: {name}
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
sites: {sites}
seed: 0
"""


def add_job(store: Store, *, sites: str, rounds: int = 1, name: str = "job") -> str:
    """A queued job, as Engine.submit leaves it (without building a model in the worker)."""
    cfg = parse_round_config(JOB.format(name=name, rounds=rounds, sites=sites), source="test job")
    job_id = f"{name}-{uuid.uuid4().hex[:8]}"
    store.save_checkpoint(job_id, 0, {"w": np.zeros(4, np.float32)})
    store.add_job(job_id, cfg.name, dump_round_config(cfg), cfg.strategy.name, cfg.rounds, "test")
    return job_id


def join(engine: Engine, site: str, rows: int = 100) -> None:
    engine.join(site, agent_version="test", models=["vector"], datasets=["heart-disease"], policy_digest="",
                dataset_rows={"heart-disease": rows})


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
        wait_until(lambda: len(engine._polls) == len(self.threads), 30, "every site to long-poll")
        with engine._cv:   # each poller registered its condition under the lock and released it only to wait
            pass

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
        with engine._cv:
            assert engine.poll_wakeups == 0
        add_job(store, sites="{min: 1, count: 1, evaluate: participants}")
        chosen = wait_until(lambda: [s for s, task in polls.got.items() if task is not None], 30,
                            "the sampled site to get its task long before its poll times out")
        assert len(chosen) == 1
        with engine._cv:
            assert engine.poll_wakeups == 1                     # that site's poll only
            assert len(polls.got) == 1                          # the others still wait, undisturbed
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
    chunks = (fpb.UpdateMessage(chunk={"offset": o, "data": bytes(d)}).chunk for o, d in iter_chunks(blob, 64))
    return engine.submit_update(site, header, chunks)


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
        round2 = wait_until(lambda: engine._active and engine._active.round, 30, "round 2 to open")
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
        assert engine._active.round is None
        join(engine, "c")
        round2 = wait_until(lambda: engine._active.round, 30, "round 2 to open once c is back")
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
