"""The admin commands on a state dir no coordinator runs on (`--state DIR`): a stopped coordinator's, and the
layout `plexus simulate --state DIR` writes (DIR/coordinator)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import threading

import pytest
from safetensors.numpy import load_file

from coordinator.store import Store
from plexus import pki
from plexus.cli import main as cli

from integration.harness import Federation, heart_job
from state_db import execute


@pytest.fixture(scope="module")
def finished(pki_root, tmp_path_factory):
    """A state dir holding one completed job (heart disease, 2 rounds, sites a and b), its coordinator stopped:
    (the dir, the job id)."""
    state = tmp_path_factory.mktemp("stopped") / "state"
    federation = Federation(pki_root, state)
    try:
        for name in "ab":
            federation.start_site(name)
        federation.wait_online("a", "b")
        job_id = federation.admin().submit(heart_job(rounds=2, min=2)).job_id
        assert federation.wait_job(job_id) == "completed"
    finally:
        federation.close()
    return state, job_id


@pytest.fixture
def simulation(finished, tmp_path):
    """A copy of the finished state dir as a simulation dir holds it, in its coordinator/ folder."""
    state, job_id = finished
    shutil.copytree(state, tmp_path / "sim" / "coordinator")
    return tmp_path / "sim", job_id


def test_the_reads_answer_from_a_stopped_coordinators_state_dir(finished, tmp_path, capsys, monkeypatch):
    state, job_id = finished
    monkeypatch.setenv("PLEXUS_KIT", "/nowhere")            # name a live coordinator: --state does without them
    monkeypatch.setenv("PLEXUS_COORDINATOR", "127.0.0.1:9")
    at = ["--state", str(state)]
    assert cli(["job", "list", "--json", *at]) == 0
    [job] = json.loads(capsys.readouterr().out)
    assert (job["job_id"], job["status"], job["round"], job["rounds"]) == (job_id, "completed", 2, 2)

    assert cli(["job", "show", job_id, *at]) == 0
    shown = capsys.readouterr().out
    assert f"job {job_id}  (heart, fedavg)  status: completed  round 2/2" in shown
    rounds = [line.split()[:3] for line in shown.splitlines() if line[:1].isdigit()]
    assert rounds == [["1", "closed", "2"], ["2", "closed", "2"], ["3", "closed", "(evaluation)"]]

    assert cli(["job", "metrics", job_id, "--format", "json", *at]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert {(m["round"], m["site"]) for m in metrics if m["name"] == "train_loss"} == {
        (1, "a"), (1, "b"), (2, "a"), (2, "b")}

    assert cli(["job", "watch", job_id, "--json", *at]) == 0   # the recorded events, then it ends
    events = [e for line in capsys.readouterr().out.splitlines()
              if (e := json.loads(line))["kind"] != "model_downloaded"]   # recorded by a download with --state
    assert events[0]["kind"] == "job_submitted" and events[-1]["kind"] == "job_completed"
    assert [e["round"] for e in events if e["kind"] == "round_closed"] == [1, 2]
    assert events[-1]["global_model"]["round"] == 2 and events[-1]["status"] == "completed"

    assert cli(["job", "plot", job_id, "-o", str(tmp_path / "plot.png"), *at]) == 0
    assert f"of job {job_id} to {tmp_path / 'plot.png'}" in capsys.readouterr().out
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert cli(["sites", "list", "--json", *at]) == 0
    sites = json.loads(capsys.readouterr().out)
    assert [(s["site"], s["online"], s["revoked"]) for s in sites] == [("a", False, False), ("b", False, False)]
    Store(state).close()   # every command let go of the state dir


def test_a_download_is_the_checkpoint_bit_for_bit(finished, tmp_path, capsys):
    state, job_id = finished
    for round_, argv in ((2, []), (1, ["--round", "1"])):
        out = tmp_path / f"model-{round_}.safetensors"
        assert cli(["job", "download", job_id, "-o", str(out), *argv, "--state", str(state)]) == 0
        assert f"wrote round {round_} of job {job_id}" in capsys.readouterr().out
        got, saved = load_file(str(out)), load_file(str(state / "checkpoints" / job_id / f"{round_}.safetensors"))
        assert sorted(got) == sorted(saved)
        for name, tensor in saved.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
            assert got[name].tobytes() == tensor.tobytes(), name
    assert "plexus-send-watchdog" not in {t.name for t in threading.enumerate()}   # stopped with the client


def test_a_simulation_dir_is_read_through_its_coordinator_folder(simulation, capsys):
    sim, job_id = simulation
    assert cli(["job", "show", job_id, "--json", "--state", str(sim)]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["status"] == "completed"


def test_a_job_the_state_dir_left_running_is_watched_to_its_last_event(simulation, capsys):
    sim, job_id = simulation   # as a coordinator stopped mid-job leaves it: nothing will add events
    execute(sim / "coordinator", "UPDATE jobs SET status = 'running' WHERE id = ?", (job_id,))
    execute(sim / "coordinator", "DELETE FROM events WHERE kind = 'job_completed'")
    assert cli(["job", "watch", job_id, "--state", str(sim)]) == 1   # it did not complete
    lines = capsys.readouterr().out.splitlines()
    assert "job_submitted" in lines[0] and sum("site_evaluated" in line for line in lines) == 2
    assert not any("job_completed" in line for line in lines)


def test_sites_revoked_by_the_crl_beside_the_state_dir_read_as_revoked(simulation, tmp_path, capsys):
    sim, _ = simulation
    root = tmp_path / "pki"
    pki.init_federation(root, "other", hosts=["127.0.0.1"])
    pki.add_site(root, "a")
    serial = pki.revoke(root, "a")
    shutil.copy(root / "crl.pem", sim / "crl.pem")
    shutil.copy(root / "ca" / "ca.pem", sim / "ca.pem")
    execute(sim / "coordinator", "UPDATE site_joins SET serial = ? WHERE name = 'a'", (str(serial),))
    assert cli(["sites", "list", "--json", "--state", str(sim)]) == 0
    assert [(s["site"], s["revoked"]) for s in json.loads(capsys.readouterr().out)] == [("a", True), ("b", False)]


def test_a_folder_that_is_no_state_dir_is_refused_untouched(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["job", "list", "--state", str(empty)]) == 1
    assert f"--state {empty} holds no plexus.db (nor coordinator/plexus.db): give a coordinator's state dir" in \
        capsys.readouterr().err
    assert list(empty.iterdir()) == []   # no store was made of it
    assert cli(["sites", "list", "--state", str(tmp_path / "gone")]) == 1
    assert f"--state {tmp_path / 'gone'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("content", [b"", b"hello\n", "another program's"])
def test_a_plexus_db_that_is_no_coordinators_is_refused_and_left_as_it_was(tmp_path, capsys, content):
    """Before: an empty plexus.db got the coordinator's schema written into it (and another program's SQLite
    database would have too), plus a lock, checkpoints/ and spool/ beside it, and the reads showed no jobs."""
    state = tmp_path / "state"
    state.mkdir()
    db = state / "plexus.db"
    if isinstance(content, bytes):
        db.write_bytes(content)
    else:
        with contextlib.closing(sqlite3.connect(db)) as other:
            other.execute("CREATE TABLE patients (id INTEGER)")
            other.commit()
    before = db.read_bytes()
    assert cli(["job", "list", "--state", str(state)]) == 1
    err = capsys.readouterr().err
    assert f"--state: {db} is not a coordinator's database ({len(before)} bytes, no jobs table" in err, err
    assert "restore its plexus.db from a backup (docs/backup-restore.md)" in err
    assert db.read_bytes() == before and [p.name for p in state.iterdir()] == ["plexus.db"]


def test_a_state_dir_in_use_is_refused_naming_its_holder(finished, capsys):
    state, job_id = finished
    store = Store(state)   # as a running coordinator holds it
    try:
        assert cli(["job", "show", job_id, "--state", str(state)]) == 1
    finally:
        store.close()
    assert (f"state dir {state} is in use by a running coordinator or simulation (PID {os.getpid()}); read it once "
            "that stops, or call the coordinator with --kit") in capsys.readouterr().err


@pytest.mark.parametrize("argv, doing", [
    (["job", "submit", "JOB"], "submit a job"), (["job", "submit", "JOB", "--wait"], "submit a job"),
    (["job", "abort", "j"], "abort a job"), (["job", "resume", "j"], "resume a job"),
    (["audit", "--verify"], "read the audit log"),
    (["job", "export", "j", "--mlflow", "file:/x"], "export a job"), (["dashboard"], "serve the dashboard")])
def test_commands_that_need_a_running_coordinator_refuse_state(argv, doing, tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: x\n")
    argv = [str(job) if a == "JOB" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        cli([*argv, "--state", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--state reads a state dir; to {doing}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [job]


@pytest.mark.parametrize("flags", [["--kit", "K"], ["--coordinator", "h:1"], ["--kit", "K", "--coordinator", "h:1"]])
def test_state_with_a_kit_or_coordinator_is_refused(flags, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["job", "list", "--state", str(tmp_path), *flags])
    assert exit_.value.code == 2
    given = " and ".join(sorted(f for f in flags if f.startswith("--")))
    assert f"--state reads a state dir without a coordinator; leave out {given}" in capsys.readouterr().err


def test_without_the_entry_point_state_says_to_reinstall(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("plexus.cli.admin.entry_points", lambda group: [])
    assert cli(["job", "list", "--state", str(tmp_path)]) == 1
    assert "plexus.local_admin entry point, which is not installed; reinstall plexus" in capsys.readouterr().err
