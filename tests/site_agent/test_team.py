"""Training spread over worker processes (site.yaml `training`, site_agent/team.py): real helper processes, real
gloo collectives on loopback, the site's real heart-disease rows."""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from plexus.config import DatasetSpec, NodesSpec, SiteConfig, TrainingSpec, _parse, dump_site_config, parse_round_config
from plexus.datasets import load_for_job
from plexus.errors import ConfigError
from plexus.models import build_job_model, state_to_numpy
from site_agent.local import gradient_correction, proximal_term
from site_agent.team import Team, TeamError
from site_agent.training import train_local

from integration.harness import free_port, wait_until

JOB = """\
name: team
model: {name: mlp, args: {in_features: 13, hidden: [16]}}
data: {dataset: heart-disease}
rounds: 1
strategy: {name: fedavg}
train: {epochs: 2, batch_size: 16, optimizer: {name: sgd, lr: 0.05, momentum: 0.5}}
seed: 3
"""
TOLERANCE = 1e-6


def site(hospital: str = "cleveland", **training) -> SiteConfig:
    return SiteConfig(site="a", coordinator="unused.invalid:1", kit=Path("unused"),
                      datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=hospital)},
                      training=TrainingSpec(**training) if training else None)


@pytest.fixture
def job():
    return parse_round_config(JOB)


@pytest.fixture
def rows(job):
    split = load_for_job(site().datasets["heart-disease"], job.data)
    return split.x_train, split.y_train


def one_process(job, rows):
    model = build_job_model(job)
    return model, train_local(model, *rows, job.train, seed=5)


def as_team(team, job, rows, make_kwargs=lambda model: {}):
    model = build_job_model(job)
    with team.session(JOB, "job-1", model):
        result = train_local(model, *rows, job.train, seed=5, **make_kwargs(model))
    return model, result


def assert_close(a, b):
    a, b = state_to_numpy(a), state_to_numpy(b)
    assert sorted(a) == sorted(b)
    worst = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)
    assert worst < TOLERANCE, worst


@pytest.fixture
def team():
    made = []

    def make(config):
        made.append(Team(config))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.mark.parametrize("workers", [2, 3])
def test_n_workers_give_the_update_of_one_worker_with_the_whole_batch(job, rows, team, workers):
    # 199 rows in batches of 16: the last batch of each pass (7 rows) splits unevenly over the workers too.
    alone, alone_result = one_process(job, rows)
    crew = team(site(workers=workers))
    spread, spread_result = as_team(crew, job, rows)
    again, _ = as_team(crew, job, rows)   # a second session, with the first one's keys dropped
    assert_close(spread, again)
    assert not crew.store.check(["work/1"]) and crew.store.check(["work/2"])
    assert_close(alone, spread)
    assert spread_result.steps == alone_result.steps and spread_result.num_samples == alone_result.num_samples == 199
    assert spread_result.metrics["train_loss"] == pytest.approx(alone_result.metrics["train_loss"], rel=1e-6)
    # and the weights did move: training happened
    start = state_to_numpy(build_job_model(job))["layers.0.weight"]
    assert not np.array_equal(state_to_numpy(spread)["layers.0.weight"], start)


def test_fedprox_and_scaffold_site_halves_train_the_same_spread_over_workers(job, rows, team):
    anchor = {k: v + 0.1 for k, v in state_to_numpy(build_job_model(job)).items()}
    rng = np.random.default_rng(0)
    correction = {k: rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in anchor.items()}

    def halves(model):
        return {"loss_term": proximal_term(model, anchor, 0.5), "grad_hook": gradient_correction(model, correction)}

    alone = build_job_model(job)
    train_local(alone, *rows, job.train, seed=5, **halves(alone))
    spread, _ = as_team(team(site(workers=2)), job, rows, halves)
    assert_close(alone, spread)
    plain, _ = one_process(job, rows)
    assert not np.allclose(state_to_numpy(plain)["layers.0.weight"], state_to_numpy(spread)["layers.0.weight"])


def test_a_loss_term_the_workers_cannot_rebuild_is_refused(job, rows, team):
    with pytest.raises(ConfigError, match="cannot be rebuilt at the other workers"):
        as_team(team(site(workers=2)), job, rows, lambda model: {"loss_term": lambda: torch.zeros(())})


def test_a_worker_killed_mid_task_fails_the_task_and_the_next_task_runs(job, rows, team):
    crew = team(site(workers=2, timeout_s=60))
    as_team(crew, job, rows)   # the helper is up and has the data
    helper = crew.helpers[0]
    many = parse_round_config(JOB.replace("epochs: 2", "epochs: 400"))
    model = build_job_model(many)
    killer = _kill_when_training(crew, helper)
    started = time.monotonic()
    with pytest.raises(TeamError, match="the training team failed"):
        with crew.session(JOB.replace("epochs: 2", "epochs: 400"), "job-1", model):
            train_local(model, *rows, many.train, seed=5)
    assert time.monotonic() - started < 30   # the peer's death is seen at once, not at timeout_s
    killer.join()
    assert helper.poll() == -signal.SIGKILL
    again, _ = as_team(crew, job, rows)   # a new helper, the same result
    assert crew.helpers[0].pid != helper.pid
    alone, _ = one_process(job, rows)
    assert_close(alone, again)
    crew.close()
    assert all(p.poll() is not None for p in crew.helpers) and not crew.helpers


def _kill_when_training(crew, helper):
    import threading

    store = dist.TCPStore("127.0.0.1", crew.store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    session = store.add("sessions", 0) + 1   # a connection of its own: the team's is the training thread's

    def kill():
        while not store.check([f"training/{session}"]):   # set as the formed team's steps begin (_run_ranks)
            time.sleep(0.01)
        os.kill(helper.pid, signal.SIGKILL)   # in the training loop: 400 epochs take far longer than this poll

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def _node(tmp_path, config: SiteConfig) -> subprocess.Popen:
    path = tmp_path / "node.yaml"
    path.write_text(dump_site_config(config))
    return subprocess.Popen([sys.executable, "-m", "plexus", "site", "node", "--config", str(path)],
                            stdout=open(tmp_path / "node.log", "ab"), stderr=subprocess.STDOUT)


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def test_two_nodes_on_loopback_train_as_one_worker_does(job, rows, team, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    nodes = dict(workers=1, interface="lo", timeout_s=60)
    crew = team(site(**nodes, nodes=NodesSpec(count=2, rank=0, address=address)))
    crew._start()   # node 0 listens before node 1 dials
    node = _node(tmp_path, site(**nodes, nodes=NodesSpec(count=2, rank=1, address=address)))
    try:
        spread, _ = as_team(crew, job, rows)
        alone, _ = one_process(job, rows)
        assert_close(alone, spread)
        assert len(_running(f"--store {address}")) == 1   # node 1's one worker
    finally:
        _stop(node)
    assert node.returncode == 0, (tmp_path / "node.log").read_text()
    assert _running(f"--store {address}") == []   # it ended its workers


def test_a_node_whose_data_differs_fails_the_task_with_the_reason(job, rows, team, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    nodes = dict(workers=1, interface="lo", timeout_s=60)
    crew = team(site(**nodes, nodes=NodesSpec(count=2, rank=0, address=address)))
    crew._start()
    node = _node(tmp_path, site("va", **nodes, nodes=NodesSpec(count=2, rank=1, address=address)))
    try:
        with pytest.raises(TeamError, match="rank 1: dataset 'heart-disease' here holds .* give every node the same"):
            as_team(crew, job, rows)
    finally:
        _stop(node)


def test_site_node_refuses_node_zero_and_the_agent_refuses_other_nodes(tmp_path):
    address = "127.0.0.1:1"
    with pytest.raises(ConfigError, match="the site agent runs on node 0"):
        Team(site(workers=1, nodes=NodesSpec(count=2, rank=1, address=address)))
    path = tmp_path / "zero.yaml"
    path.write_text(dump_site_config(site(workers=2)))
    done = subprocess.run([sys.executable, "-m", "plexus", "site", "node", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "training.nodes with rank 1 or more" in done.stderr


@pytest.mark.parametrize("text, message", [
    ("training: {backend: nccl}", "nccl runs on GPUs only"),
    ("training: {workers: 0}", "training.workers"),
    ("training: {nodes: {count: 2, rank: 2, address: 'h:1'}}", "rank 2 is not below count 2"),
    ("training: {device: tpu}", "training.device"),
])
def test_bad_training_sections_are_refused_with_the_key(text, message):
    with pytest.raises(ConfigError, match=message):
        _parse(f"site: a\ncoordinator: h:1\nkit: k\n{text}\n", SiteConfig, "site.yaml")


def test_an_ensemble_members_training_is_spread_over_workers(rows, team):
    text = JOB.replace("strategy: {name: fedavg}", "strategy: {name: ensemble, args: {members: [h1, a]}}")
    job = parse_round_config(text)
    alone = build_job_model(job)
    train_local(alone.members[1], *rows, job.train, seed=5)
    spread = build_job_model(job)
    crew = team(site(workers=2))
    with crew.session(text, "job-1", spread):
        train_local(spread.members[1], *rows, job.train, seed=5)
    assert_close(alone, spread)
    untouched = state_to_numpy(build_job_model(job).members[0])
    assert all(np.array_equal(v, state_to_numpy(spread.members[0])[k]) for k, v in untouched.items())


def test_the_rendezvous_listens_on_loopback_only(job, rows, team):
    crew = team(site(workers=2))
    crew._start()
    port = crew.store.port
    assert crew._listener.getsockname()[:2] == ("127.0.0.1", port)
    assert _listening(port) == ["0100007F"]   # 127.0.0.1, and no socket on every interface (0.0.0.0 or ::)


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net shows them) with a socket listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(address)
    return found


def test_a_worker_that_never_gets_ready_fails_the_task_at_its_timeout_or_death(job, rows, team):
    crew = team(site(workers=2, timeout_s=2))
    as_team(crew, job, rows)
    helper = crew.helpers[0]
    os.kill(helper.pid, signal.SIGSTOP)   # alive, but it will not answer
    try:
        started = time.monotonic()
        with pytest.raises(TeamError, match="no answer on the team's rendezvous for ready/2/1 within"):
            as_team(crew, job, rows)
        assert 2 <= time.monotonic() - started < 20
        # Killed once the next task waits on the rendezvous (its work is posted): a kill before that task's start
        # would only have the team start a new helper.
        session = crew.store.add("sessions", 0) + 1
        watcher = dist.TCPStore("127.0.0.1", crew.store.port, is_master=False,
                                timeout=datetime.timedelta(seconds=30))

        def kill_once_waiting():
            wait_until(lambda: watcher.check([f"work/{session}"]), 60, f"session {session}'s work to be posted")
            os.kill(helper.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_waiting, daemon=True)
        killer.start()
        crew.spec = dataclasses.replace(crew.spec, timeout_s=120)   # now its death, not the clock, ends the wait
        started = time.monotonic()
        with pytest.raises(TeamError, match=rf"worker rank 1 \(PID {helper.pid}\) ended with status -9 before"):
            as_team(crew, job, rows)
        assert time.monotonic() - started < 20
        killer.join(timeout=10)
    finally:
        if helper.poll() is None:
            helper.kill()


def _running(needle: str) -> list[int]:
    """PIDs of live (not zombie) processes whose command line contains `needle`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_helpers_end_when_their_agent_is_killed(tmp_path):
    config = tmp_path / "site.yaml"
    config.write_text(dump_site_config(site(workers=3)))
    script = ("import sys, time\nfrom plexus.config import load_site_config\nfrom site_agent.team import Team\n"
              f"team = Team(load_site_config({str(config)!r}))\nteam._start()\n"
              "print(team.store.port, *[p.pid for p in team.helpers], flush=True)\ntime.sleep(600)\n")
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        port, *helpers = map(int, agent.stdout.readline().split())
        assert len(helpers) == 2 and sorted(_running(f"--store 127.0.0.1:{port}")) == sorted(helpers)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 30
        while _running(f"--store 127.0.0.1:{port}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(f"--store 127.0.0.1:{port}") == []
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_a_rendezvous_address_that_cannot_be_listened_on_is_a_clear_error(job, rows, team):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        crew = team(site(workers=1, nodes=NodesSpec(count=2, rank=0, address=address)))
        with pytest.raises(ConfigError, match=rf"cannot listen on {address} \(training.nodes.address\): .*free port"):
            as_team(crew, job, rows)
