"""emulation.slowdown: after a training task the agent waits (slowdown − 1) × the task's training time, which
its injected clock measures; `stop` cuts the wait, and evaluation tasks never wait.

The coordinator here is a recording stand-in for the stub (these tests are about the agent's own timing);
the real gRPC path runs in tests/integration."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from plexus.config import DatasetSpec, EmulationSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from site_agent.agent import SiteAgent

from fake_coordinator import FakeCoordinator
from timing import scaled

TRAIN_S = 0.25   # what each training task takes by the agent's (fake) clock

JOB = """\
name: emu
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 5
sites: {min: 3}
privacy: {secure_aggregation: SECURE}
"""


class Waits(threading.Event):
    """The agent's stop event, recording each wait it is asked for (and waiting it, for real)."""

    def __init__(self):
        super().__init__()
        self.asked: list[float] = []
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.asked.append(timeout)
        self.waiting.set()
        return super().wait(timeout)


class SlowTrainer(SiteAgent):
    """Trains for real, while its clock says each training took TRAIN_S."""

    def __init__(self, *args, **kwargs):
        self.now = 1000.0
        super().__init__(*args, clock=lambda: self.now, stop=Waits(), **kwargs)

    def local_update(self, *args, **kwargs):
        result = super().local_update(*args, **kwargs)
        self.now += TRAIN_S
        return result


Coordinator = FakeCoordinator


def _agent(kit, tmp_path, slowdown: float | None) -> SlowTrainer:
    return SlowTrainer(SiteConfig(
        site="a", coordinator="127.0.0.1:1", kit=kit, state_dir=tmp_path / "state",
        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital="cleveland")},
        policy=PolicySpec(allowed_models=("logistic",)),
        emulation=None if slowdown is None else EmulationSpec(slowdown=slowdown)))


def _task(kind, *, secure=False, round_=1):
    text = JOB.replace("SECURE", "true" if secure else "false")
    return parse_round_config(text), fpb.Task(
        kind=kind, task_id=f"t{round_}", job_id="emu", round=round_, config_yaml=text, nonce=b"n" * 16,
        deadline_unix_s=time.time() + 600, seed=7)


def test_a_training_task_waits_slowdown_minus_one_times_its_training_time_before_sending(kit, tmp_path):
    agent = _agent(kit, tmp_path, slowdown=3.0)
    job, task = _task(fpb.TASK_TRAIN)
    stub = Coordinator(job)
    started = time.monotonic()
    agent.handle(stub, task)
    assert agent.stop.asked == [pytest.approx(2 * TRAIN_S)]
    assert time.monotonic() - started >= 2 * TRAIN_S   # a real wait: an Event never returns early
    assert len(stub.updates) == 1 and stub.updates[0][0].header.num_samples > 0 and stub.results == []


def test_secure_aggregations_advertise_task_trains_so_it_waits_too(kit, tmp_path):
    agent = _agent(kit, tmp_path, slowdown=2.0)
    job, task = _task(fpb.TASK_SECAGG_ADVERTISE, secure=True)
    stub = Coordinator(job)
    agent.handle(stub, task)
    assert agent.stop.asked == [pytest.approx(TRAIN_S)]
    assert [m.WhichOneof("body") for m in stub.secagg] == ["advert"] and stub.results == []


def test_an_evaluation_task_never_waits(kit, tmp_path):
    agent = _agent(kit, tmp_path, slowdown=5.0)
    job, task = _task(fpb.TASK_EVALUATE)
    stub = Coordinator(job)
    agent.handle(stub, task)
    assert agent.stop.asked == []
    assert [r.status for r in stub.results] == [fpb.RESULT_EVALUATED]


def test_without_emulation_no_task_waits(kit, tmp_path):
    agent = _agent(kit, tmp_path, slowdown=None)
    job, task = _task(fpb.TASK_TRAIN)
    stub = Coordinator(job)
    agent.handle(stub, task)
    assert agent.stop.asked == [] and len(stub.updates) == 1


def test_stop_cuts_the_wait_short_and_the_update_is_not_sent(kit, tmp_path):
    agent = _agent(kit, tmp_path, slowdown=1000.0)   # a wait of 999 × 0.25 s, unless stop cuts it
    job, task = _task(fpb.TASK_TRAIN)
    stub = Coordinator(job)
    worker = threading.Thread(target=agent.handle, args=(stub, task), name="emulated-site")
    worker.start()
    assert agent.stop.waiting.wait(scaled(30)), "the agent never began its emulated wait"
    agent.shutdown()
    worker.join(scaled(10))
    assert not worker.is_alive(), "stop did not cut the emulated wait"
    assert agent.stop.asked == [pytest.approx(999 * TRAIN_S)]
    assert stub.updates == [] and stub.results == []


def test_the_agent_warns_once_at_startup_that_emulation_is_on(kit, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="plexus.site"):
        agent = _agent(kit, tmp_path, slowdown=1.0)   # on, though a factor of 1 waits 0 s
        job, task = _task(fpb.TASK_TRAIN)
        agent.handle(Coordinator(job), task)
        agent.handle(Coordinator(job), _task(fpb.TASK_TRAIN, round_=2)[1])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("EMULATION ONLY: site 'a' emulates a slower site "
                                                         "(emulation.slowdown: 1)"), warnings
    assert agent.stop.asked == [0.0, 0.0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plexus.site"):
        _agent(kit, tmp_path, slowdown=None)
    assert not caplog.records
