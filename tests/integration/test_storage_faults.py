"""A coordinator against its own storage: damaged checkpoints, a full disk, a dying engine thread, a second
coordinator on the same state dir or port, and checkpoint retention, over real gRPC with mTLS."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

from coordinator.server import Coordinator
from plexus import pki
from plexus.config import CheckpointsSpec, CoordinatorConfig
from plexus.errors import FailedPrecondition, IntegrityError
from plexus.health import check

from checkpoint_damage import DAMAGE as DAMAGE_OF
from integration.harness import Federation, heart_job, wait_until

DAMAGE = {name: DAMAGE_OF[name] for name in ("truncated", "garbage header", "nan", "bit flip")}


class EngineErrors(logging.Handler):
    """Counts the round engine's tracebacks."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record):
        self.count += record.exc_info is not None


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_fails_the_job_once_with_a_clear_message(pki_root, tmp_path, damage):
    state = tmp_path / "state"
    first = Federation(pki_root, state)
    try:   # no site is online: the job is taken up and waits in round 0, its checkpoint the one it has
        job_id = first.admin().submit(heart_job(name="damaged", rounds=2)).job_id
        wait_until(lambda: first.store.job(job_id).status == "running", 30, "the job to start")
    finally:
        first.close()
    path = state / "checkpoints" / job_id / "0.safetensors"
    DAMAGE[damage](path)

    errors = EngineErrors()
    logging.getLogger("plexus").addHandler(errors)
    second = Federation(pki_root, state)
    try:
        status = wait_until(lambda: (s := second.store.job(job_id).status) != "running" and s, 20,
                            "the job to stop running")
        row = second.store.job(job_id)
        assert status == "failed"
        assert str(path) in row.message and "damaged" in row.message and "docs/backup-restore.md" in row.message
        job_again = second.admin().submit(heart_job(name="next", rounds=1)).job_id   # the engine goes on
        wait_until(lambda: second.store.job(job_again).status == "running", 30, "the next job to start")
        assert second.store.job(job_id).status == "failed"
        assert errors.count == 0
    finally:
        logging.getLogger("plexus").removeHandler(errors)
        second.close()


def _final_model(store, job_id: str) -> dict[str, bytes]:
    row = store.job(job_id)
    return {k: v.tobytes() for k, v in store.load_checkpoint(job_id, row.current_round).items()}


# Plain FedAvg writes its mean straight into the checkpoint; FedAdam holds the model and optimizer state
# in memory, which the failed round has already moved on: both must rerun the round from the disk.
@pytest.mark.parametrize("strategy", ["", "strategy: {name: fedadam, args: {eta: 0.05}}\n"], ids=["fedavg", "fedadam"])
def test_a_full_disk_fails_only_the_round_and_the_job_resumes_when_space_is_back(federation, monkeypatch, strategy):
    import coordinator.store

    real = coordinator.store.write_atomically
    full, hit = threading.Event(), threading.Event()

    def write_atomically(path, *parts, **kwargs):
        if full.is_set() and path.name == "2.safetensors":   # round 2's checkpoint meets a full disk
            hit.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, *parts, **kwargs)

    monkeypatch.setattr(coordinator.store, "write_atomically", write_atomically)
    federation.coordinator.engine.storage_retry_s = 0.3
    for name in ("a", "b"):
        federation.start_site(name)
    federation.wait_online("a", "b")
    admin = federation.admin()
    full.set()
    job_id = admin.submit(heart_job(name="full", rounds=3, seed=7) + strategy).job_id
    wait_until(hit.is_set, 60, "round 2's checkpoint to fail")
    wait_until(lambda: any(kind == "round_failed" for _, _, kind, *_ in federation.store.events_after(job_id, 0)),
               30, "the round's failure to be recorded")
    assert federation.store.job(job_id).status == "running"
    assert check(federation.address, kit=federation.root / "sites" / "a") == "SERVING"
    full.clear()   # space is back

    assert federation.wait_job(job_id, 120) == "completed", federation.store.job(job_id).message
    events = federation.store.events_after(job_id, 0)
    failed = [message for _, _, kind, round_, _, message in events if kind == "round_failed"]
    assert len(failed) == 1 and "No space left on device" in failed[0]
    assert "job_resumed" in [kind for _, _, kind, *_ in events]
    assert [r[0] for r in federation.store.rounds(job_id) if r[2] == "closed"] == [1, 2, 3, 4]

    # The same job without the full disk gives the same model, bit for bit.
    again = admin.submit(heart_job(name="full", rounds=3, seed=7) + strategy).job_id
    assert federation.wait_job(again, 120) == "completed"
    assert _final_model(federation.store, job_id) == _final_model(federation.store, again)


def test_a_full_disk_under_incoming_updates_waits_for_room_without_the_sites_training_again(federation, monkeypatch):
    """Before: a spool write failing with ENOSPC was answered INTERNAL, with a traceback per call; the sites were
    given the task again at once and retrained in a loop (each retraining spends DP-SGD budget). Now the round is
    dropped, the sites are told UNAVAILABLE, and the job waits, untaken, until the state dir has room."""
    import coordinator.engine
    import coordinator.intake

    real = coordinator.intake.Upload.receive
    full, attempts = threading.Event(), []

    def receive(self, chunks, **kwargs):
        if full.is_set():
            attempts.append(self.journal.name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.journal))
        return real(self, chunks, **kwargs)

    free = {"bytes": 10 << 20}   # what statvfs says of the state dir
    monkeypatch.setattr(coordinator.intake.Upload, "receive", receive)
    monkeypatch.setattr(coordinator.engine, "_free_bytes", lambda path: free["bytes"])
    engine = federation.coordinator.engine
    engine.storage_retry_s = 0.2
    for name in ("a", "b"):
        federation.start_site(name)
    federation.wait_online("a", "b")
    full.set()
    job_id = federation.admin().submit(heart_job(name="spool", rounds=2, seed=3)).job_id
    wait_until(lambda: attempts, 60, "an update to meet the full disk")
    time.sleep(3)   # 15 of storage_retry_s: the job is not taken up again, so nobody trains again
    assert len(attempts) <= 2, attempts   # each site's first update, at most
    assert engine._free_wanted >= 64 << 20   # what it waits for: ROOM_BYTES and the model twice
    events = federation.store.events_after(job_id, 0)
    failed = [message for _, _, kind, _, _, message in events if kind == "round_failed"]
    assert len(failed) == 1 and "No space left on device" in failed[0], failed

    full.clear()
    free["bytes"] += 100 << 20   # the operator made room
    assert federation.wait_job(job_id, 120) == "completed", federation.store.job(job_id).message
    assert len(attempts) <= 2 and engine._free_wanted == 0


class EngineKilled(BaseException):
    """What no handler in the loop catches."""


def test_an_engine_thread_that_dies_turns_health_to_not_serving(federation, monkeypatch, caplog):
    kit = federation.root / "sites" / "a"
    assert check(federation.address, kit=kit) == "SERVING"

    def die():
        raise EngineKilled("injected")

    monkeypatch.setattr(federation.coordinator.engine, "tick", die)
    federation.coordinator.engine.nudge()

    wait_until(lambda: check(federation.address, kit=kit) == "NOT_SERVING", 20, "health to report NOT_SERVING")
    assert check(federation.address, kit=kit, service="plexus.v1.Federation") == "NOT_SERVING"
    assert any(r.levelno == logging.CRITICAL and "round engine stopped" in r.getMessage() for r in caplog.records)


def _config(pki_root, state, listen="127.0.0.1:0") -> CoordinatorConfig:
    return CoordinatorConfig(listen=listen, kit=pki_root / "coordinator", state_dir=state,
                             crl=pki_root / "coordinator" / "crl.pem", poll_timeout_s=1.0, rejoin_grace_s=0.0)


@pytest.mark.parametrize("loss", ["plexus.db", "audit.db", "audit.db damaged"])
def test_a_state_dir_that_lost_its_database_or_audit_log_is_refused_naming_it(pki_root, tmp_path, loss):
    """Before: without plexus.db the coordinator started empty (every job gone, the old WAL thrown away), without
    audit.db it started a new hash chain, and a damaged audit.db was a raw sqlite3 traceback."""
    state = tmp_path / "state"
    first = Coordinator(_config(pki_root, state))
    first.engine.submit(heart_job(name="kept"), "ops")
    first.stop()
    lost = state / loss.split()[0]
    if loss.endswith("damaged"):
        lost.write_bytes(b"not a database at all" * 10)
    else:
        lost.unlink()
    with pytest.raises(IntegrityError) as info:
        Coordinator(_config(pki_root, state))
    message = str(info.value)
    if loss == "plexus.db":
        assert message.startswith(f"{lost} is missing, but {state / 'audit.db'}, ") and "0.safetensors" in message
        assert not lost.exists()   # no new, empty database was made
    elif loss == "audit.db":
        assert message.startswith(f"{lost} is missing, but the state dir holds 1 job(s): a new audit log would "
                                  "start its hash chain over")
        assert not lost.exists()
    else:
        assert message.startswith(f"the audit log {lost} is damaged (file is not a database)")
    assert "docs/backup-restore.md" in message


def test_a_second_coordinator_on_the_same_state_dir_is_refused(federation, pki_root, tmp_path):
    state = federation.coordinator.store.state_dir
    with pytest.raises(FailedPrecondition, match=rf"state dir {state} is in use: process {os.getpid()} holds"):
        Coordinator(_config(pki_root, state))


def test_a_second_coordinator_on_the_same_port_is_refused(federation, pki_root, tmp_path):
    address = f"127.0.0.1:{federation.coordinator.port}"
    with pytest.raises(FailedPrecondition, match=f"listen: could not bind {address}"):
        Coordinator(_config(pki_root, tmp_path / "other-state", listen=address))
    Coordinator(_config(pki_root, tmp_path / "other-state")).stop()   # the refused one let go of its state dir


def test_a_second_coordinator_process_exits_with_the_reason(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "lock-test", hosts=["127.0.0.1"])
    config = root / "coordinator" / "coordinator.yaml"
    config.write_text(config.read_text().replace("127.0.0.1:8443", "127.0.0.1:0"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(tmp_path / "first.log", "wb")
    first = subprocess.Popen([sys.executable, "-m", "plexus", "coordinator", "run", "--config", str(config)],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    log.close()
    try:
        address = root / "coordinator" / "state" / "coordinator.addr"
        wait_until(address.exists, 60, "the first coordinator to listen")
        second = subprocess.run([sys.executable, "-m", "plexus", "coordinator", "run", "--config", str(config)],
                                capture_output=True, text=True, timeout=60, env=env)
        assert second.returncode == 1
        assert f"is in use: process {first.pid} holds" in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_retention_keeps_the_latest_checkpoints_and_the_job_model_downloads(pki_root, tmp_path):
    fed = Federation(pki_root, tmp_path / "state", checkpoints=CheckpointsSpec(keep_last=2))
    try:
        for name in ("a", "b"):
            fed.start_site(name)
        fed.wait_online("a", "b")
        admin = fed.admin()
        job_id = admin.submit(heart_job(name="kept", rounds=4)).job_id
        assert fed.wait_job(job_id) == "completed"
        folder = fed.store.checkpoints / job_id
        assert sorted(p.name for p in folder.iterdir()) == [
            "3.safetensors", "3.strategy.safetensors", "4.safetensors", "4.strategy.safetensors"]
        round_, state = admin.download(job_id, -1)
        assert round_ == 4 and state.keys() == fed.store.load_checkpoint(job_id, 4).keys()
        with pytest.raises(grpc.RpcError, match="removed by checkpoints.keep_last"):
            admin.download(job_id, 1)
    finally:
        fed.close()
