"""A submit whose deadline passed may still create its job: retried under its request id, it never makes two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest

from plexus import pki
from plexus.admin_client import AdminClient

from integration.harness import install_plugin, scaled, wait_until

MODULE = "plexus_gated_plugin"
# A model plug-in that takes as long to build as the test wants: it marks that it started, then waits
# for the test to create the gate file. The coordinator builds models in its model worker process.
SOURCE = textwrap.dedent('''\
    """A model whose construction waits for a gate file."""
    import time
    from pathlib import Path

    from torch import nn


    class Gated(nn.Module):
        def __init__(self, gate: str, in_features: int = 13, num_classes: int = 2):
            super().__init__()
            Path(gate + ".building").write_text("")
            end = time.monotonic() + 600
            while not Path(gate).exists() and time.monotonic() < end:
                time.sleep(0.02)
            self.linear = nn.Linear(in_features, num_classes)

        def forward(self, x):
            return self.linear(x)
    ''')
JOB = """\
name: gated
model: {{name: gated, args: {{gate: "{gate}", in_features: 13, num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
"""


class Gated:
    """A coordinator process whose model builds wait until `open()`."""

    def __init__(self, root: Path, address: str, gate: Path):
        self.root, self.address, self.gate = root, address, gate

    @property
    def building(self) -> bool:
        return Path(f"{self.gate}.building").exists()

    def open(self) -> None:
        self.gate.write_text("")

    def job(self, rounds: int = 1) -> str:
        return JOB.format(gate=self.gate, rounds=rounds)

    def admin(self, name: str = "ops", **options) -> AdminClient:
        return AdminClient(self.address, self.root / "admins" / name, **options)


@pytest.fixture
def gated(tmp_path, procs):
    lib = install_plugin(tmp_path / "lib", MODULE, SOURCE, {"gated": "Gated"})
    root = tmp_path / "pki"
    pki.init_federation(root, "retry-test", hosts=["127.0.0.1"])
    for name in ("ops", "ops2"):
        pki.add_admin(root, name, role="operator")
    config = root / "coordinator" / "coordinator.yaml"
    config.write_text(config.read_text().replace('listen: "127.0.0.1:8443"', 'listen: "127.0.0.1:0"'))
    path = os.pathsep.join([str(lib), *filter(None, [os.environ.get("PYTHONPATH")])])
    procs.start("coordinator", "coordinator", "run", "--config", str(config), env=dict(os.environ, PYTHONPATH=path))
    addr = root / "coordinator" / "state" / "coordinator.addr"
    wait_until(addr.exists, 60, "the coordinator to listen")
    fed = Gated(root, addr.read_text().strip(), tmp_path / "gate")
    yield fed
    fed.open()   # a build still waiting would hold the coordinator's shutdown


def test_a_retry_after_deadline_exceeded_returns_the_job_the_first_attempt_created(gated, procs):
    job = gated.job()
    with gated.admin(timeout_s=scaled(1)) as impatient, gated.admin() as ops, gated.admin("ops2") as other:
        assert ops.jobs() == []   # the channel is up: the first attempt's deadline is all the submit's own
        with pytest.raises(grpc.RpcError) as first:
            impatient.submit(job, request_id="req-1", attempts=1)
        assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: gated.building, 30, "the coordinator to build the first attempt's model")
        assert ops.jobs() == []   # still building: no job yet, and none when the deadline passed

        got = {}
        retry = threading.Thread(target=lambda: got.update(job=ops.submit(job, request_id="req-1", attempts=1)))
        retry.start()
        wait_until(lambda: "repeated while the first is still building" in procs.log("coordinator"), 30,
                   "the retry to wait for the first attempt at the coordinator")
        gated.open()
        retry.join(scaled(60))
        assert not retry.is_alive()

        jobs = ops.jobs()
        assert [j.job_id for j in jobs] == [got["job"].job_id] and jobs[0].submitted_by == "ops"
        assert ops.submit(job, request_id="req-1").job_id == got["job"].job_id   # and again: still that job

        with pytest.raises(grpc.RpcError) as changed:
            ops.submit(gated.job(rounds=2), request_id="req-1")
        assert changed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"already submitted job {got['job'].job_id} with a different round config" in changed.value.details()

        theirs = other.submit(job, request_id="req-1")   # another admin's request ids are their own
        assert theirs.job_id != got["job"].job_id and theirs.submitted_by == "ops2"
        with pytest.raises(grpc.RpcError) as bad:
            ops.submit(job, request_id="../req 1")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id '../req 1'" in bad.value.details()
        assert sorted(j.submitted_by for j in ops.jobs()) == ["ops", "ops2"]


def test_job_submit_with_a_timeout_retries_until_it_gets_its_one_job(gated, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(gated.job())
    kit = gated.root / "admins" / "ops"
    cli = subprocess.Popen([sys.executable, "-m", "plexus", "job", "submit", str(job_file), "--json", "--timeout", "2",
                            "--kit", str(kit), "--coordinator", gated.address],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        retried = next((line for line in cli.stderr if "submit attempt 1 of 5: DEADLINE_EXCEEDED" in line), "")
        assert "(deadline 2 s)" in retried and "with the same request id" in retried, retried
        wait_until(lambda: gated.building, 30, "the coordinator to build the job's model")
        gated.open()
        out, err = cli.communicate(timeout=scaled(60))
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.communicate()
    assert cli.returncode == 0, err
    with gated.admin() as ops:
        assert [j.job_id for j in ops.jobs()] == [json.loads(out)["job_id"]]

    refused = subprocess.run([sys.executable, "-m", "plexus", "job", "list", "--timeout", "0", "--kit", str(kit)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--timeout: '0' is not a number of seconds above 0; write e.g. --timeout 60" in refused.stderr
