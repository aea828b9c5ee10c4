"""Kill the coordinator with SIGKILL mid-job, start it again: the job resumes and ends as if nothing happened."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from plexus.admin_client import AdminClient
from plexus.cli import main as cli

from integration.harness import Processes, cli_kits, heart_job, wait_until

# The strategy's own state (FedAdam's moments, CWT's shuffled schedule) must survive the kill too.
STRATEGIES = {"fedavg": ("", 2), "fedadam": ("strategy: {name: fedadam, args: {eta: 0.05}}\n", 2),
              "cwt": ("strategy: {name: cwt, args: {shuffle: true}}\n", 1)}


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """One federation's kits and its two site processes, for every strategy's test: each test starts (and kills,
    and starts again) a coordinator of its own on a fresh state folder; the sites rejoin each one as they rejoin
    a restarted coordinator. (Starting two site processes anew for each test cost about 5 s of its 8.)"""
    root = tmp_path_factory.mktemp("resume") / "pki"
    port, admin_kit, coord_cfg = cli_kits(root, "resume-test", ("a", "b"), allowed_models=("logistic",))
    procs = Processes(root.parent)
    try:
        for name in ("a", "b"):
            procs.start(f"site-{name}", "site", "run", "--config", str(root / "sites" / name / "site.yaml"),
                        "--threads", "1")
        yield SimpleNamespace(root=root, port=port, admin_kit=admin_kit, coord_cfg=coord_cfg)
    finally:
        procs.stop_all()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sigkill_mid_job_resumes_from_last_closed_round(tmp_path, procs, sites, strategy):
    extra, min_sites = STRATEGIES[strategy]
    port, admin_kit, coord_cfg = sites.port, sites.admin_kit, sites.coord_cfg
    state = sites.root / "coordinator" / "state"
    addr = state / "coordinator.addr"
    shutil.rmtree(state, ignore_errors=True)   # an earlier test's coordinator (stopped with its test) left it

    coordinator = procs.start("coordinator", "coordinator", "run", "--config", str(coord_cfg))
    wait_until(addr.exists, 60, "the coordinator to listen")
    address = f"127.0.0.1:{port}"
    rounds = 12
    with AdminClient(address, admin_kit) as client:
        wait_until(lambda: {s.site for s in client.sites() if s.online} == {"a", "b"}, 60, "both sites online")
        job_id = client.submit(heart_job(name="resume", rounds=rounds, min=min_sites, seed=3) + extra).job_id
        wait_until(lambda: client.job(job_id).summary.current_round >= 3, 60, "round 3 to close")

    coordinator.send_signal(signal.SIGKILL)
    coordinator.wait(timeout=10)
    killed_at = max(r.round for r in _rounds_in_db(state, job_id))
    assert killed_at < rounds, "the job finished before the kill; the test did not test resuming"
    addr.unlink()

    procs.start("coordinator-2", "coordinator", "run", "--config", str(coord_cfg))
    wait_until(addr.exists, 60, "the restarted coordinator to listen")
    with AdminClient(address, admin_kit) as client:
        wait_until(lambda: client.job(job_id).summary.status in ("completed", "failed"), 120, "the job to end")
        detail = client.job(job_id)
        assert detail.summary.status == "completed", detail.summary.message
        closed = sorted(r.round for r in detail.rounds if r.status.startswith("closed"))
        assert closed == list(range(1, rounds + 2))  # every training round plus the final evaluation
        kinds = [e.kind for e in client.watch(job_id)]
        assert "job_resumed" in kinds

        # The same job run without interruption gives the same model, bit for bit.
        again = client.submit(heart_job(name="resume", rounds=rounds, min=min_sites, seed=3) + extra).job_id
        wait_until(lambda: client.job(again).summary.status == "completed", 120, "the reference job")
        resumed_model, reference_model = tmp_path / "resumed.safetensors", tmp_path / "reference.safetensors"
        for job, path in ((job_id, resumed_model), (again, reference_model)):
            assert cli(["job", "download", job, "-o", str(path), "--kit", str(admin_kit),
                        "--coordinator", address]) == 0
    assert _tensor_bytes(resumed_model) == _tensor_bytes(reference_model)


def _rounds_in_db(state: Path, job_id: str):
    import sqlite3

    with sqlite3.connect(state / "plexus.db") as db:
        return [type("R", (), {"round": r})() for (r,) in db.execute(
            "SELECT round FROM rounds WHERE job_id = ? AND status = 'closed'", (job_id,))]


def _tensor_bytes(path: Path) -> dict:
    from safetensors.numpy import load_file

    return {k: v.tobytes() for k, v in load_file(str(path)).items()}
