"""A site that trains with several worker processes (site.yaml `training`) in a real federation over mTLS: the
same models as with one worker, DP-SGD declined with the reason, and a worker killed mid-task recorded as the
site's failure while the round goes on."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from plexus.config import TrainingSpec

from integration.harness import Federation, wait_until

JOB = """\
name: workers-{name}
model: {{name: mlp, args: {{in_features: 13, hidden: [16]}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
strategy: {{name: {strategy}{args}}}
sites: {{min: {min}, deadline_s: 120}}
train: {{epochs: {epochs}, batch_size: 16, optimizer: {{name: sgd, lr: 0.05}}}}
seed: 7
{extra}"""
STRATEGIES = {"fedavg": "", "fedprox": ", args: {mu: 0.1}", "scaffold": ""}
TOLERANCE = 1e-5


def own_client(port: int):
    """A connection of the test's own to a team's rendezvous store."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))


def job(name: str, strategy: str = "fedavg", *, rounds: int = 2, min: int = 2, epochs: int = 2, extra: str = "") -> str:
    return JOB.format(name=name, strategy=strategy, args=STRATEGIES.get(strategy, ""), rounds=rounds, min=min,
                      epochs=epochs, extra=extra)


def final_models(fed: Federation, training: TrainingSpec | None) -> dict[str, dict[str, np.ndarray]]:
    fed.start_site("a", training=training)
    fed.start_site("b")
    fed.wait_online("a", "b")
    admin = fed.admin()
    models = {}
    for strategy in STRATEGIES:
        job_id = admin.submit(job(strategy, strategy)).job_id
        assert fed.wait_job(job_id, timeout=120) == "completed", admin.job(job_id).summary.message
        models[strategy] = admin.download(job_id)[1]
    return models


def stop_sites(fed: Federation) -> None:
    for agent, thread in fed.agents:
        agent.shutdown()
        thread.join(timeout=30)


def test_a_site_with_two_workers_ends_with_the_models_of_one_worker(federation, pki_root, tmp_path):
    spread = final_models(federation, TrainingSpec(workers=2))
    team = federation.agents[0][0].team
    assert team is not None and len(team.helpers) == 1 and team.store.add("sessions", 0) == 2 * len(STRATEGIES)
    stop_sites(federation)
    assert not team.helpers   # the agent ended its helper when it stopped
    alone_fed = Federation(pki_root, tmp_path / "alone")
    try:
        alone = final_models(alone_fed, None)
    finally:
        alone_fed.close()
    for strategy in STRATEGIES:
        a, b = spread[strategy], alone[strategy]
        assert sorted(a) == sorted(b)
        worst = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)
        assert worst < TOLERANCE, (strategy, worst)


def test_dp_sgd_is_declined_with_the_reason_by_a_site_with_workers(federation):
    federation.start_site("a", training=TrainingSpec(workers=2))
    federation.start_site("b")
    federation.wait_online("a", "b")
    admin = federation.admin()
    text = job("dpsgd", rounds=1, min=1, extra="privacy: {dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0}}\n")
    job_id = admin.submit(text).job_id
    assert federation.wait_job(job_id, timeout=120) == "completed"
    declined = {e.site: e.reason for e in admin.job(job_id).site_events if e.status == "declined"}
    assert set(declined) == {"a"} and "trains with 2 workers" in declined["a"]
    assert "training.workers is 1" in declined["a"]


def test_a_worker_killed_mid_task_is_the_sites_failure_and_the_round_goes_on(federation):
    agent = federation.start_site("a", training=TrainingSpec(workers=2, timeout_s=60))
    federation.start_site("b")
    federation.wait_online("a", "b")
    admin = federation.admin()
    killed: list[int] = []

    def kill_in_first_session():
        wait_until(lambda: agent.team.store is not None and agent.team.helpers, 60, "the training team")
        store = own_client(agent.team.store.port)   # the agent's store client is its thread's alone
        # set as the formed team's steps begin (team._run_ranks' `started`): the kill lands in the training loop,
        # within tens of ms of its start, while 50 epochs on two workers take about 1.5 s
        wait_until(lambda: store.check(["training/1"]), 60, "the first training session's steps to begin")
        killed.append(agent.team.helpers[0].pid)
        os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_in_first_session)
    killer.start()
    job_id = admin.submit(job("killed", rounds=2, min=1, epochs=50)).job_id
    killer.join()
    assert federation.wait_job(job_id, timeout=180) == "completed"
    events = admin.job(job_id).site_events
    failed = [(e.round, e.reason) for e in events if e.site == "a" and e.status == "failed"]
    assert len(failed) == 1 and failed[0][0] == 1 and "the training team failed" in failed[0][1]
    trained = {(e.site, e.round) for e in events if e.status == "submitted"}
    assert {("b", 1), ("b", 2), ("a", 2)} <= trained   # round 1 went on without a; a's new helper trained round 2
    assert agent.team.helpers[0].pid != killed[0]
    stop_sites(federation)
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)
    assert not agent.team.helpers


def test_a_site_with_workers_trains_in_secure_aggregation_and_dp_fedavg_rounds(federation):
    agent = federation.start_site("a", training=TrainingSpec(workers=2))
    for name in "bc":
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    admin = federation.admin()
    jobs = {"secure": "privacy: {secure_aggregation: true, secagg: {clip: 4.0}}\n",
            "dpfedavg": "privacy: {dp: {mode: central, noise_multiplier: 0.5, clip_norm: 1.0}}\n"}
    for name, privacy in jobs.items():
        job_id = admin.submit(job(name, rounds=1, min=3, extra=privacy)).job_id
        assert federation.wait_job(job_id, timeout=120) == "completed", (name, admin.job(job_id).summary.message)
        (round1,) = [r for r in admin.job(job_id).rounds if r.round == 1]
        assert list(round1.contributors) == ["a", "b", "c"], name
    assert agent.team.store.add("sessions", 0) == len(jobs)   # a trained both as a team
