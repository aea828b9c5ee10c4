"""Model builds at submit, over real gRPC + mTLS: a slow build holds up no one else, a build past its time
limit is stopped, and a model too large for the worker's memory cap is refused; the coordinator goes on."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading

import grpc
import pytest

from coordinator.model_worker import ModelWorker
from plexus.errors import ConfigError
from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import Federation, heart_job, install_plugin, scaled, wait_until

MODULE = "plexus_gated_plugin"
# A coordinator-side model plug-in whose construction blocks until the test opens its gate (a FIFO):
# a build exactly as slow as the test needs, with no clock involved.
SOURCE = textwrap.dedent('''\
    from pathlib import Path

    from torch import nn

    HERE = Path(__file__).parent


    class Gated(nn.Module):
        def __init__(self, in_features: int = 13, num_classes: int = 2):
            super().__init__()
            (HERE / "building").write_text("the build has started\\n")
            with open(HERE / "gate") as gate:   # blocks until the test opens the gate's other end
                gate.read()
            self.linear = nn.Linear(in_features, num_classes)
    ''')
GATED_JOB = """\
name: gated
model: {name: gated, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 1
"""
DP_JOB = heart_job(name="private", min=1, rounds=2) + \
    "privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0, target_epsilon: 1000.0}}\n"


@pytest.fixture
def gated(tmp_path, monkeypatch):
    """A model worker of this test's own, with the gated plug-in installed where it (only) looks."""
    lib = install_plugin(tmp_path / "lib", MODULE, SOURCE, {"gated": "Gated"})
    os.mkfifo(lib / "gate")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(lib), *sys.path]))   # the worker starts with it
    worker = ModelWorker()
    worker.lib = lib
    yield worker
    worker.close()


def _open_gate(lib) -> None:
    with open(lib / "gate", "w") as gate:   # the plug-in is waiting at the other end: this does not block long
        gate.write("go")


def test_sites_and_admins_are_served_while_a_slow_model_builds(pki_root, tmp_path, gated):
    """Reported: building a slow model at submit blocked sites' NextTask for 34 s. The build runs outside the
    engine lock, and a running DP job's ε is computed in-process as each round opens, not in the worker:
    while the worker is busy, the job's round closes, its next round opens and is handed to its site, and
    the admin's calls are answered."""
    fed = Federation(pki_root, tmp_path / "state", models=gated)
    submitted, released = {}, False
    try:
        site = fed.raw_site("c")
        site.join()
        admin = fed.admin()
        private = admin.submit(DP_JOB).job_id
        task = site.next_task()   # round 1 is open: its ε is known (a round opens only once it is)
        _, state = site.fetch(task)

        def submit_slow():
            try:
                submitted["job"] = fed.admin().submit(GATED_JOB)
            except grpc.RpcError as exc:
                submitted["error"] = exc
        slow = threading.Thread(target=submit_slow, daemon=True)
        slow.start()
        wait_until(lambda: (gated.lib / "building").exists(), 60, "the slow build to start")

        site.submit(task, state, num_samples=100, timeout=10)       # unchanged model: within clip_norm
        wait_until(lambda: fed.store.job(private).current_round == 1, 20, "round 1 to close during the build")
        following = site.stub.NextTask(fpb.NextTaskRequest(wait_s=scaled(5)), timeout=scaled(10))
        assert (following.kind, following.round) == (fpb.TASK_TRAIN, 2)   # round 2 does not wait for the worker
        assert {j.job_id: j.current_round for j in admin.jobs()}[private] == 1
        assert slow.is_alive() and not submitted   # the build is still in progress all along

        _open_gate(gated.lib)
        released = True
        slow.join(scaled(60))
        assert submitted["job"].name == "gated" and submitted["job"].status == "queued"
    finally:
        if not released and (gated.lib / "building").exists():
            _open_gate(gated.lib)
        fed.close()


def test_a_build_past_model_build_timeout_s_is_stopped_and_the_job_refused(pki_root, tmp_path, gated):
    # The worker is started (torch imported) first, so that the time limit, which the gated build always runs
    # out, is spent in the build itself, not in the worker's start: a short one then suffices.
    gated.build("logistic", {"in_features": 3}, seed=0, out=tmp_path / "before.safetensors")
    limit = scaled(0.5)
    fed = Federation(pki_root, tmp_path / "state", models=gated, model_build_timeout_s=limit)
    try:
        admin = fed.admin()
        with pytest.raises(grpc.RpcError) as err:
            admin.submit(GATED_JOB)   # its gate never opens
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            f"model: building model 'gated' took longer than {limit:g} s (model_build_timeout_s), so the model "
            "worker was stopped; use a smaller model, or raise model_build_timeout_s in the coordinator's config")
        assert (gated.lib / "building").exists()   # stopped in the build, at its gate
        assert admin.jobs() == []
    finally:
        fed.close()
    state = gated.build("logistic", {"in_features": 3}, seed=0, out=tmp_path / "after.safetensors")
    assert state["linear.weight"].shape == (2, 3)   # a new worker took the stopped one's place


def test_a_model_too_large_for_the_worker_memory_cap_is_refused_and_the_coordinator_keeps_serving(federation):
    """A 16 GiB model (one 65536 × 65536 float32 layer) against the default cap of 8 GiB: refused at submit,
    at once, without the memory ever being touched."""
    admin = federation.admin()
    huge = heart_job(model="mlp").replace("{in_features: 13, num_classes: 2}",
                                          "{in_features: 65536, hidden: [65536], num_classes: 2}")
    with pytest.raises(grpc.RpcError) as err:
        admin.submit(huge)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith("model: building model 'mlp' needs more memory than the model worker may use: "
                              "model_build_memory_bytes is 8589934592 bytes, 8 GiB, of which torch itself takes "
                              "about 1 GiB; use a smaller model, or raise model_build_memory_bytes in the "
                              "coordinator's config"), details
    assert "you tried to allocate 17179869184 bytes" in details   # what torch's allocator said, kept

    job = admin.submit(heart_job(model="mlp"))   # the same worker builds the next model
    assert job.status == "queued" and [j.job_id for j in admin.jobs()] == [job.job_id]


def test_a_worker_killed_while_it_builds_is_reported_as_out_of_memory_and_replaced(tmp_path, gated):
    """What the kernel's out-of-memory killer does to a build beyond the machine's memory (SIGKILL), done
    here by the test: that build is refused with the reason, and is not sent to a new worker again."""
    outcome = {}

    def build():
        try:
            gated.build("gated", {}, seed=0, out=tmp_path / "gated.safetensors")
        except ConfigError as exc:
            outcome["error"] = str(exc)
    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    wait_until(lambda: (gated.lib / "building").exists(), 60, "the build to start")
    (gated.lib / "building").unlink()
    os.kill(gated.pid, signal.SIGKILL)
    thread.join(scaled(10))

    assert outcome["error"] == (
        "building model 'gated': the model worker process was killed (SIGKILL), most likely for want of memory: "
        "the model needs more than the machine has or model_build_memory_bytes (8589934592 bytes, 8 GiB) allows; "
        "use a smaller model, or raise model_build_memory_bytes in the coordinator's config")
    assert not (gated.lib / "building").exists()   # the request was not replayed to the next worker
    assert gated.build("logistic", {"in_features": 3}, seed=0, out=tmp_path / "next")["linear.weight"].shape == (2, 3)
