"""Tests for coordinator.store: atomic checkpoints and the durable job/round/task record."""

from __future__ import annotations

import itertools
import json
import sqlite3
import threading

import numpy as np
import pytest

from coordinator.aggregate import WeightedSum
from coordinator.store import Store
from plexus.errors import IntegrityError, NotFound, Reason
from plexus.wire import encode


class Clock:
    """An injectable clock that ticks one second per reading."""

    def __init__(self, start: float = 1000.0):
        self._ticks = itertools.count(start)

    def __call__(self) -> float:
        return float(next(self._ticks))


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state", clock=Clock())
    yield s
    s.close()


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    odd = np.array([0.0, -0.0, np.inf, 1e-45], np.float32)
    odd = np.concatenate([odd, np.frombuffer(bytes.fromhex("0100c07f"), np.float32)])  # a NaN with a payload
    return {
        "fc.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(4),
        "odd": odd,
        "half": np.array([1.0, -65504.0, 6e-8], np.float16),
        "steps": np.array(41, np.int64),
        "mask": np.arange(7, dtype=np.uint8),
        "empty": np.zeros((0, 3), np.float32),
        "transposed": np.arange(6, dtype=np.int32).reshape(2, 3).T,   # not C-contiguous
    }


def _assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name


# checkpoints ------------------------------------------------------------------------------

def test_checkpoint_round_trip_is_bit_exact_and_leaves_no_temporary(store, tmp_path):
    state = _state()

    path = store.save_checkpoint("job-1", 3, state)

    assert path == store.checkpoint_path("job-1", 3) and path.is_file()
    assert path.is_relative_to(tmp_path)
    _assert_bit_exact(store.load_checkpoint("job-1", 3), state)
    assert list(tmp_path.rglob("*.tmp")) == []


def test_overwriting_a_checkpoint_replaces_it_whole(store, tmp_path):
    store.save_checkpoint("job-1", 2, _state())
    newer = {"w": np.full((5,), 2.5, np.float32)}

    store.save_checkpoint("job-1", 2, newer)

    _assert_bit_exact(store.load_checkpoint("job-1", 2), newer)
    assert sorted(p.name for p in store.checkpoint_path("job-1", 2).parent.iterdir()) == ["2.safetensors"]


def test_a_crash_while_overwriting_keeps_the_previous_checkpoint(store, monkeypatch):
    state = _state()
    store.save_checkpoint("job-1", 2, state)
    path = store.checkpoint_path("job-1", 2)

    def crash_before_rename(fd):
        raise OSError("disk full")   # the new file is half-durable; it must never replace the old one

    monkeypatch.setattr("plexus.files.os.fsync", crash_before_rename)
    with pytest.raises(OSError, match="disk full"):
        store.save_checkpoint("job-1", 2, {"w": np.zeros(3, np.float32)})
    monkeypatch.undo()

    assert path.is_file()
    _assert_bit_exact(store.load_checkpoint("job-1", 2), state)
    assert sorted(p.name for p in path.parent.iterdir()) == ["2.safetensors"]   # no half-written file left


def test_checkpoints_of_different_rounds_and_jobs_are_kept_apart(store):
    store.save_checkpoint("job-1", 1, {"w": np.ones(2, np.float32)})
    store.save_checkpoint("job-1", 2, {"w": np.zeros(2, np.float32)})
    store.save_checkpoint("job-2", 1, {"w": np.full(2, 7.0, np.float32)})

    assert store.load_checkpoint("job-1", 1)["w"].tolist() == [1.0, 1.0]
    assert store.load_checkpoint("job-1", 2)["w"].tolist() == [0.0, 0.0]
    assert store.load_checkpoint("job-2", 1)["w"].tolist() == [7.0, 7.0]


def test_loading_a_missing_checkpoint_names_the_job_and_round(store):
    store.save_checkpoint("job-1", 1, {"w": np.ones(2, np.float32)})

    with pytest.raises(NotFound, match="job job-1 has no checkpoint for round 4"):
        store.load_checkpoint("job-1", 4)
    with pytest.raises(NotFound, match="job job-9 has no checkpoint for round 1"):
        store.load_checkpoint("job-9", 1)


# jobs, rounds and tasks -------------------------------------------------------------------

def _kinds(store: Store, job_id: str, after: int = 0) -> list[str]:
    return [e[2] for e in store.events_after(job_id, after)]


def test_a_job_lifecycle_is_recorded(store):
    store.add_job("j1", "heart", "name: heart\n", "fedavg", 2, "alice")
    store.add_job("j2", "other", "name: other\n", "fedavg", 1, "bob")

    queued = store.job("j1")
    assert (queued.id, queued.name, queued.config_yaml, queued.strategy) == ("j1", "heart", "name: heart\n", "fedavg")
    assert (queued.status, queued.rounds, queued.current_round, queued.submitted_by) == ("queued", 2, 0, "alice")
    assert queued.created == queued.updated

    store.set_job("j1", status="running", message="training", event=("job_started", 0, "", "go"))
    running = store.job("j1")
    assert (running.status, running.message, running.current_round) == ("running", "training", 0)
    assert running.updated > queued.updated and running.created == queued.created

    store.open_round("j1", 1, "train")
    store.add_task("t-a", "j1", 1, "site-a", "train", b"\x01" * 16)
    store.add_task("t-b", "j1", 1, "site-b", "train", b"\x02" * 16)
    [(number, kind, status, opened, closed, contributors, samples, message)] = store.rounds("j1")
    assert (number, kind, status, closed, contributors, samples, message) == (1, "train", "open", None, "[]", 0, "")
    assert store.task("t-a") == ("t-a", "j1", 1, "site-a", "train", b"\x01" * 16, "issued")
    assert store.task("nope") is None
    assert store.site_events("j1") == []          # issued tasks are not outcomes yet

    store.finish_task("t-a", "submitted", job_id="j1", round_=1, site="site-a",
                      metrics={(1, "train", "loss"): 0.25, (0, "eval", "accuracy"): 0.75,
                               (1, "train", "num_samples"): 40})
    assert store.metrics("j1") == [(0, "site-a", "eval", "accuracy", 0.75), (1, "site-a", "train", "loss", 0.25),
                                   (1, "site-a", "train", "num_samples", 40.0)]
    assert store.site_events("j1") == [("site-a", "submitted", 1, "")]

    store.close_round("j1", 1, status="closed", contributors=["site-a"], total_samples=40,
                      message="1 update(s), 40 samples", job_update={"current_round": 1})
    [(number, kind, status, opened2, closed, contributors, samples, message)] = store.rounds("j1")
    assert (number, status, samples, message) == (1, "closed", 40, "1 update(s), 40 samples")
    assert json.loads(contributors) == ["site-a"] and opened2 == opened and closed > opened
    assert store.job("j1").current_round == 1
    assert store.task("t-b")[6] == "late"          # never answered before the round closed
    assert store.site_events("j1") == [("site-a", "submitted", 1, ""),
                                       ("site-b", "late", 1, "no update before the round closed")]

    events = store.events_after("j1", 0)
    assert [e[2] for e in events] == ["job_submitted", "job_started", "round_opened", "site_submitted", "round_closed"]
    assert [e[0] for e in events] == sorted(e[0] for e in events)
    assert events[0][5] == "submitted by alice" and events[2][3:] == (1, "", "train")
    assert events[3][3:] == (1, "site-a", "") and events[4][5] == "1 update(s), 40 samples"
    assert [e[2] for e in store.events_after("j1", events[2][0])] == ["site_submitted", "round_closed"]
    assert store.events_after("j1", events[-1][0]) == []
    assert _kinds(store, "j2") == ["job_submitted"]
    assert store.metrics("j2") == [] and store.rounds("j2") == []
    assert [j.id for j in store.jobs()] == ["j1", "j2"]


def test_rows_come_back_named(store):
    heard = []
    store.subscribe(heard.append)
    store.add_job("j1", "heart", "x", "fedavg", 2, "alice", request=("req-1", "ab" * 32))
    store.open_round("j1", 1, "evaluate")
    store.add_task("t-a", "j1", 1, "site-a", "evaluate", b"n")
    store.finish_task("t-a", "rejected", "bad metrics", job_id="j1", round_=1, site="site-a",
                      metrics={(1, "eval", "accuracy"): 0.5}, code=Reason.METRICS)
    store.site_seen("site-a", agent_version="1.2", policy_digest="d" * 64, models=["mlp"], datasets=["heart"])

    assert store.submission("alice", "req-1").config_sha256 == "ab" * 32
    [round_] = store.rounds("j1")
    assert (round_.round, round_.kind, round_.status, round_.closed) == (1, "evaluate", "open", None)
    task = store.task("t-a")
    assert (task.task_id, task.site, task.kind, task.nonce, task.status) == ("t-a", "site-a", "evaluate", b"n",
                                                                             "rejected")
    [outcome] = store.site_events("j1")
    assert (outcome.site, outcome.status, outcome.round, outcome.reason) == ("site-a", "rejected", 1, "bad metrics")
    [metric] = store.metrics("j1")
    assert (metric.round, metric.site, metric.kind, metric.name, metric.value) == (1, "site-a", "eval", "accuracy",
                                                                                   0.5)
    [site] = store.sites()
    assert (site.name, site.agent_version, json.loads(site.models), json.loads(site.datasets)) == \
        ("site-a", "1.2", ["mlp"], ["heart"])
    events = store.events_after("j1", 0)
    assert [(e.kind, e.round, e.site) for e in events] == [("job_submitted", 0, ""), ("round_opened", 1, ""),
                                                           ("site_rejected", 1, "site-a")]
    assert events[2].message == "bad metrics" and events[0].id < events[1].id < events[2].id
    # What listeners hear carries the structure the rows leave out: who acted, why, which kind of round.
    assert [(e.kind, e.actor, e.reason, e.round_kind) for e in heard] == [
        ("job_submitted", "admin:alice", None, ""), ("round_opened", "coordinator", None, "evaluate"),
        ("site_rejected", "coordinator", Reason.METRICS, "")]


def test_close_round_can_finish_the_job_with_a_custom_event(store):
    store.add_job("j1", "heart", "x", "fedavg", 1, "alice")
    store.open_round("j1", 1, "evaluate")

    store.close_round("j1", 1, status="closed", contributors=[], total_samples=0, message="evaluated",
                      job_update={"status": "completed", "message": "done"}, event=("job_completed", "all done"))

    job = store.job("j1")
    assert (job.status, job.message) == ("completed", "done")
    assert store.events_after("j1", 0)[-1][2:] == ("job_completed", 1, "", "all done")


def test_reopening_a_round_voids_its_issued_tasks(store):
    store.add_job("j1", "heart", "x", "fedavg", 2, "alice")
    store.open_round("j1", 1, "train")
    store.add_task("t-a", "j1", 1, "site-a", "train", b"n")

    store.open_round("j1", 1, "train")

    assert store.task("t-a")[6] == "stale"
    assert [r[2] for r in store.rounds("j1")] == ["open"]


def test_interrupt_open_rounds_voids_open_rounds_and_issued_tasks(store):
    store.add_job("j1", "heart", "x", "fedavg", 3, "alice")
    store.open_round("j1", 1, "train")
    store.add_task("t-1", "j1", 1, "site-a", "train", b"n1")
    store.finish_task("t-1", "submitted", job_id="j1", round_=1, site="site-a")
    store.close_round("j1", 1, status="closed", contributors=["site-a"], total_samples=5, message="ok")
    store.open_round("j1", 2, "train")
    store.add_task("t-2a", "j1", 2, "site-a", "train", b"n2")
    store.add_task("t-2b", "j1", 2, "site-b", "train", b"n3")
    store.finish_task("t-2b", "rejected", "NaN in update", job_id="j1", round_=2, site="site-b")

    store.interrupt_open_rounds()

    rounds = {r[0]: r for r in store.rounds("j1")}
    assert rounds[1][2] == "closed" and rounds[2][2] == "interrupted"
    assert rounds[2][4] is not None and rounds[2][4] > rounds[2][3]
    assert [store.task(t)[6] for t in ("t-1", "t-2a", "t-2b")] == ["submitted", "stale", "rejected"]
    assert store.site_events("j1") == [("site-a", "submitted", 1, ""), ("site-b", "rejected", 2, "NaN in update")]


def test_tasks_left_unanswered_at_the_close_are_late_with_the_reason_for_their_kind(store):
    store.add_job("j1", "heart", "x", "fedavg", 2, "alice")
    store.open_round("j1", 1, "train")
    for site, kind in (("site-a", "train"), ("site-b", "evaluate"), ("site-c", "secagg_mask")):
        store.add_task(f"t-{site}", "j1", 1, site, kind, b"n")

    store.close_round("j1", 1, status="failed", contributors=[], total_samples=0, message="none",
                      late="by the round deadline (60 s)")

    assert store.site_events("j1") == [("site-a", "late", 1, "no update by the round deadline (60 s)"),
                                       ("site-b", "late", 1, "no evaluation result by the round deadline (60 s)"),
                                       ("site-c", "late", 1, "no answer by the round deadline (60 s)")]


def test_a_submission_is_recorded_with_its_job_per_admin_and_request_id(store):
    store.add_job("j1", "heart", "x", "fedavg", 1, "alice", request=("req-1", "ab" * 32))
    store.add_job("j2", "heart", "x", "fedavg", 1, "bob", request=("req-1", "cd" * 32))
    store.add_job("j3", "heart", "x", "fedavg", 1, "alice")

    assert store.submission("alice", "req-1") == ("j1", "ab" * 32)
    assert store.submission("bob", "req-1") == ("j2", "cd" * 32)
    assert store.submission("alice", "req-2") is None
    with pytest.raises(sqlite3.IntegrityError):   # one job per (admin, request id), whoever races for it
        store.add_job("j4", "heart", "x", "fedavg", 1, "alice", request=("req-1", "ab" * 32))
    assert [j.id for j in store.jobs()] == ["j1", "j2", "j3"]   # the refused one left no job behind


def test_a_state_dir_from_before_submissions_gains_the_table_and_keeps_its_jobs(tmp_path):
    folder = tmp_path / "state"
    old = Store(folder, clock=Clock())
    old.add_job("j1", "heart", "x", "fedavg", 1, "alice")
    old.close()
    db = sqlite3.connect(folder / "plexus.db")
    db.execute("DROP TABLE submissions")   # as an earlier version left it
    db.commit()
    db.close()

    upgraded = Store(folder, clock=Clock(5000.0))
    try:
        assert [j.id for j in upgraded.jobs()] == ["j1"]
        upgraded.add_job("j2", "heart", "x", "fedavg", 1, "alice", request=("req-1", "ab" * 32))
        assert upgraded.submission("alice", "req-1") == ("j2", "ab" * 32)
    finally:
        upgraded.close()


def test_what_a_site_joined_with_survives_reopening(tmp_path):
    folder = tmp_path / "state"
    serial = (1 << 158) + 12345   # X.509 serials run to 159 bits, past SQLite's integers
    first = Store(folder, clock=Clock())
    first.site_seen("site-a", agent_version="1.2", policy_digest="d" * 64, models=["mlp"], datasets=["heart"])
    first.site_joined("site-a", serial=7, dataset_rows={"heart": 303, "cxr": 5})
    first.site_joined("site-a", serial=serial, dataset_rows={"heart": 240})   # a later Join replaces it
    first.site_seen("site-b")   # seen, but never through a Join that recorded these
    first.close()

    second = Store(folder, clock=Clock(5000.0))
    try:
        a, b = second.sites()
        assert (a.name, int(a.serial), json.loads(a.dataset_rows), json.loads(a.datasets)) == \
            ("site-a", serial, {"heart": 240}, ["heart"])
        assert (b.name, b.serial, json.loads(b.dataset_rows)) == ("site-b", "", {})
    finally:
        second.close()


def test_a_state_dir_from_before_site_joins_gains_the_table_and_keeps_its_sites(tmp_path):
    folder = tmp_path / "state"
    old = Store(folder, clock=Clock())
    old.site_seen("site-a", agent_version="1.1", policy_digest="d" * 64, models=["mlp"], datasets=["heart"])
    old.close()
    db = sqlite3.connect(folder / "plexus.db")
    db.execute("DROP TABLE site_joins")   # as an earlier version left it
    db.commit()
    db.close()

    upgraded = Store(folder, clock=Clock(5000.0))
    try:
        [site] = upgraded.sites()
        assert (site.name, site.agent_version, site.serial, site.dataset_rows) == ("site-a", "1.1", "", "{}")
        upgraded.site_joined("site-a", serial=42, dataset_rows={"heart": 303})
        [site] = upgraded.sites()
        assert (site.serial, json.loads(site.dataset_rows)) == ("42", {"heart": 303})
    finally:
        upgraded.close()


def test_an_unknown_job_is_not_found(store):
    store.add_job("j1", "heart", "x", "fedavg", 1, "alice")

    with pytest.raises(NotFound, match="no job 'j404'"):
        store.job("j404")


def test_state_survives_closing_and_reopening(tmp_path):
    folder = tmp_path / "state"
    first = Store(folder, clock=Clock())
    first.add_job("j1", "heart", "name: heart\n", "fedavg", 2, "alice")
    first.open_round("j1", 1, "train")
    first.add_task("t-a", "j1", 1, "site-a", "train", b"nonce")
    first.finish_task("t-a", "submitted", job_id="j1", round_=1, site="site-a", metrics={(1, "train", "loss"): 0.5})
    first.close_round("j1", 1, status="closed", contributors=["site-a"], total_samples=9, message="ok",
                      job_update={"current_round": 1, "status": "running"})
    first.decline("j1", "site-z", "policy forbids model mlp")
    first.site_seen("site-a")
    state = {"w": np.array([1.5, -2.0], np.float32)}
    first.save_checkpoint("j1", 1, state)
    before = (first.job("j1"), first.rounds("j1"), first.metrics("j1"), first.events_after("j1", 0))
    first.close()

    second = Store(folder, clock=Clock(5000.0))
    try:
        assert (second.job("j1"), second.rounds("j1"), second.metrics("j1"), second.events_after("j1", 0)) == before
        assert second.job("j1").current_round == 1 and second.job("j1").status == "running"
        assert second.task("t-a")[6] == "submitted"
        assert second.declines("j1") == {"site-z": "policy forbids model mlp"}
        assert [s[0] for s in second.sites()] == ["site-a"]
        _assert_bit_exact(second.load_checkpoint("j1", 1), state)
        second.event("j1", "coordinator_restarted")
        assert second.events_after("j1", before[3][-1][0])[0][1:3] == (5000.0, "coordinator_restarted")
    finally:
        second.close()


def test_the_database_runs_in_wal_mode(store):
    db = sqlite3.connect(store.state_dir / "plexus.db")
    try:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        db.close()
    assert store.state_dir.joinpath("plexus.db-wal").exists()


def test_checkpoint_blob_is_the_wire_blob_and_loads_with_safetensors(store):
    from safetensors.numpy import load_file

    from plexus.wire import encode

    state = {k: v for k, v in _state().items() if k != "odd"}   # the engine never checkpoints NaN/Inf
    store.save_checkpoint("job-1", 3, state)
    layout, blob = store.checkpoint_blob("job-1", 3)
    want_layout, want_blob = encode(state)
    assert layout == want_layout and bytes(blob) == bytes(want_blob)
    _assert_bit_exact(load_file(str(store.checkpoint_path("job-1", 3))), state)


def test_checkpoint_blob_refuses_a_checkpoint_holding_nan(store):
    store.save_checkpoint("job-1", 4, _state())
    with pytest.raises(IntegrityError, match="NaN or Inf"):
        store.checkpoint_blob("job-1", 4)


def test_a_checkpoint_can_be_written_from_blocks_as_they_are_produced(store):
    state = {"a": np.arange(6, dtype=np.float32), "b": np.array([1.5, -2.0], np.float64)}
    layout, blob = encode(state)
    produced = []

    def blocks():
        for start in range(0, len(blob), 5):   # odd-sized blocks that split elements
            produced.append(start)
            yield memoryview(blob)[start:start + 5]

    store.save_checkpoint_blob("job-1", 1, layout, blocks())

    assert len(produced) == -(-len(blob) // 5)
    _assert_bit_exact(store.load_checkpoint("job-1", 1), state)


def test_a_mean_written_through_buffers_in_turn_is_hashed_beside_the_writes_and_verifies(store, tmp_path):
    rng = np.random.default_rng(5)
    state = {"a": rng.standard_normal(300_001).astype(np.float32), "b": np.arange(7, dtype=np.float64)}
    layout, blob = encode(state)
    total = WeightedSum(layout)
    total.fold([blob], 3, float(np.abs(state["a"]).max()), nbytes=len(blob))
    plain = Store(tmp_path / "plain")

    store.save_checkpoint_blob("job-1", 1, layout, total.mean_blocks(kept=4, elements=1 << 12))
    plain.save_checkpoint_blob("job-1", 1, layout, total.mean_blob())

    assert store.checkpoint_path("job-1", 1).read_bytes() == plain.checkpoint_path("job-1", 1).read_bytes()
    _assert_bit_exact(store.load_checkpoint("job-1", 1), total.mean())   # its SHA-256 checked against the database's
    assert not [t for t in threading.enumerate() if t.name == "plexus-fed-beside"]
    plain.close()


@pytest.mark.parametrize("cut", [-4, 4])
def test_blocks_that_miss_the_declared_size_save_nothing_and_keep_the_old_checkpoint(store, cut):
    state = {"a": np.arange(6, dtype=np.float32)}
    store.save_checkpoint("job-1", 1, state)
    layout, blob = encode(state)
    wrong = bytes(blob) + b"\0" * cut if cut > 0 else bytes(blob)[:cut]

    with pytest.raises(IntegrityError, match="not the 24 its header declares; nothing was saved"):
        store.save_checkpoint_blob("job-1", 1, layout, iter([wrong[:10], wrong[10:]]))

    _assert_bit_exact(store.load_checkpoint("job-1", 1), state)
    assert sorted(p.name for p in store.checkpoint_path("job-1", 1).parent.iterdir()) == ["1.safetensors"]
