"""Asynchronous training over real gRPC + mTLS: staleness weights, stale refusal, real agents, SIGKILL mid-buffer."""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest

from plexus import pki
from plexus.admin_client import AdminClient
from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import RawSite, free_port, scaled, wait_until

ASYNC_JOB = """\
name: {name}
model: {{name: logistic, args: {{in_features: 13, num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: {versions}
sites: {{min: {min}, deadline_s: {deadline}}}
train: {{epochs: 1, batch_size: 32, optimizer: {{name: sgd, lr: 0.1}}}}
asynchronous: {asynchronous}
seed: 0
"""


def async_job(*, name="async", versions=2, min=1, asynchronous="{buffer: 2}", deadline=scaled(30)) -> str:
    return ASYNC_JOB.format(name=name, versions=versions, min=min, asynchronous=asynchronous, deadline=deadline)


def shifted(state: dict, by: float) -> dict:
    return {k: (v + by).astype(v.dtype) for k, v in state.items()}


def test_a_slow_sites_stale_update_counts_with_its_lower_weight(federation):
    sites = {name: federation.raw_site(name) for name in ("a", "b", "c", "d")}
    for site in sites.values():
        site.join()
    federation.wait_online(*sites)
    job_id = federation.admin().submit(async_job(
        versions=3, asynchronous="{buffer: 2, max_staleness: 1, staleness: {fn: polynomial, a: 1}}")).job_id
    tasks = {name: site.next_task() for name, site in sites.items()}
    assert {t.model_round for t in tasks.values()} == {0} and all(t.kind == fpb.TASK_TRAIN for t in tasks.values())
    _, v0 = sites["a"].fetch(tasks["a"])

    sites["a"].submit(tasks["a"], shifted(v0, 1.0), num_samples=10)
    sites["b"].submit(tasks["b"], shifted(v0, 1.0), num_samples=10)           # v1 = v0 + 1
    wait_until(lambda: federation.store.job(job_id).current_round == 1, scaled(10), "version 1")

    a2 = sites["a"].next_task()
    assert a2.model_round == 1
    _, v1 = sites["a"].fetch(a2)
    reply = sites["c"].submit(tasks["c"], shifted(v0, 4.0), num_samples=10)   # the slow site, from v0: τ = 1
    assert reply.accepted and "staleness 1, weight 5" in reply.message         # s(1) = 1/2 of its 10 samples
    sites["a"].submit(a2, shifted(v1, 2.0), num_samples=10)
    wait_until(lambda: federation.store.job(job_id).current_round == 2, scaled(10), "version 2")
    v2 = federation.store.load_checkpoint(job_id, 2)
    for name, x in v0.items():   # v1 + (10·2 + 5·4) / 20
        np.testing.assert_allclose(v2[name], x.astype(np.float64) + 1 + 2, rtol=0, atol=1e-5)

    # d trained from v0 all along: 2 versions old now, beyond max_staleness; refused, and given version 2
    with pytest.raises(grpc.RpcError) as stale:
        sites["d"].submit(tasks["d"], shifted(v0, 4.0), num_samples=10)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "2 versions old; asynchronous.max_staleness is 1" in stale.value.details()
    assert sites["d"].next_task().model_round == 2
    assert federation.store.task(tasks["d"].task_id).status == "rejected"


def test_real_site_agents_run_an_asynchronous_job_to_its_end(federation):
    for name in ("a", "b", "c"):
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    job = async_job(versions=4, min=3, asynchronous="{buffer: 2, max_staleness: 8}")
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id, scaled(60)) == "completed", federation.store.job(job_id).message
    job = federation.store.job(job_id)
    assert job.current_round == 4 and "final model (version 4) evaluated by 3 site(s)" in job.message
    contributions = {}
    for m in federation.store.metrics(job_id):
        if m.kind == "async" and m.name == "contributions":
            contributions[m.site] = contributions.get(m.site, 0) + m.value
    assert sum(contributions.values()) == 8 and set(contributions) <= {"a", "b", "c"}
    evaluated = {m.site for m in federation.store.metrics(job_id) if m.kind == "eval" and m.round == 4}
    assert evaluated == {"a", "b", "c"}


def test_sigkill_with_an_unflushed_buffer_discards_it_and_never_counts_it_twice(tmp_path, procs):
    root = tmp_path / "pki"
    port = free_port()
    pki.init_federation(root, "async-resume", hosts=["127.0.0.1"], port=port)
    admin_kit = pki.add_admin(root, "ops", role="operator")
    coord_cfg = root / "coordinator" / "coordinator.yaml"
    coord_cfg.write_text(coord_cfg.read_text() + "poll_timeout_s: 1\n")
    for name in ("a", "b"):
        pki.add_site(root, name)
    state = root / "coordinator" / "state"
    addr = state / "coordinator.addr"
    address = f"127.0.0.1:{port}"
    coordinator = procs.start("coordinator", "coordinator", "run", "--config", str(coord_cfg))
    wait_until(addr.exists, 60, "the coordinator to listen")

    sites = {name: RawSite(root / "sites" / name, address) for name in ("a", "b")}
    try:
        for site in sites.values():
            site.join()
        with AdminClient(address, admin_kit) as client:
            wait_until(lambda: {s.site for s in client.sites() if s.online} == {"a", "b"}, 60, "both sites online")
            job_id = client.submit(async_job(name="kill", versions=1, min=2)).job_id
        first = sites["a"].next_task()
        _, v0 = sites["a"].fetch(first)
        reply = sites["a"].submit(first, shifted(v0, 100.0), num_samples=10)
        assert "1 of 2" in reply.message                                   # in the buffer, in no model
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(timeout=10)
        addr.unlink()
        procs.start("coordinator-2", "coordinator", "run", "--config", str(coord_cfg))
        wait_until(addr.exists, 60, "the restarted coordinator to listen")

        for name, site in sites.items():   # the sites reconnect and train again from version 0
            wait_until(lambda s=site: _join(s), 30, f"{name} to rejoin")
        tasks = {name: site.next_task() for name, site in sites.items()}
        assert all(t.model_round == 0 for t in tasks.values()) and tasks["a"].task_id != first.task_id
        for name, site in sites.items():
            site.submit(tasks[name], shifted(v0, 1.0), num_samples=10)
        with AdminClient(address, admin_kit) as client:
            wait_until(lambda: client.job(job_id).summary.current_round == 1, 30, "version 1")
            _, v1 = client.download(job_id, 1)
            for name, x in v0.items():                                     # the discarded +100 is in no model
                np.testing.assert_allclose(v1[name], x + 1.0, rtol=0, atol=1e-5)
            for site in sites.values():   # the final evaluation, then the job ends and its watch with it
                evaluation = site.next_task()
                assert evaluation.kind == fpb.TASK_EVALUATE and evaluation.model_round == 1
                site.report(evaluation, fpb.RESULT_EVALUATED)
            wait_until(lambda: client.job(job_id).summary.status == "completed", 30, "the job to end")
            events = list(client.watch(job_id))
            discarded = [e for e in events if e.kind == "site_discarded"]
            assert [e.site for e in discarded] == ["a"] and "unflushed buffer of version 1" in discarded[0].message
            assert any(e.kind == "job_resumed" and "1 buffered update(s) discarded" in e.message for e in events)
            audit = client.audit(verify=True)
            assert any(entry.action == "site_discarded" for entry in audit.entries)
    finally:
        for site in sites.values():
            site.close()


def _join(site) -> bool:
    try:
        site.join()
        return True
    except grpc.RpcError:
        return False


def test_a_site_failing_every_task_at_once_waits_longer_each_time_and_does_not_keep_the_job_alive(federation):
    """A site that answers each training task FAILED at once, in a loop, was given the next at once: 532 tasks a
    second in a probe (5 MB/s into plexus.db), and its answers kept asynchronous.idle_timeout_s from firing."""
    site = federation.raw_site("d")
    site.join()
    job_id = federation.admin().submit(async_job(asynchronous="{buffer: 2, idle_timeout_s: 4}")).job_id
    started = time.monotonic()
    while time.monotonic() - started < 3:
        task = site.stub.NextTask(fpb.NextTaskRequest(wait_s=0.2), timeout=scaled(10))
        if task.kind == fpb.TASK_TRAIN:
            site.report(task, fpb.RESULT_FAILED, "fails at once")
    assert 2 <= federation.store.task_counts(job_id)["d"] <= 3   # at 0 s and after 2 s (the next after 4 more)
    assert federation.wait_job(job_id, scaled(30)) == "failed"
    assert "no site has answered" in federation.store.job(job_id).message
