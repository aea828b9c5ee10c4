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
from plexus.config import dump_round_config, parse_round_config

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
