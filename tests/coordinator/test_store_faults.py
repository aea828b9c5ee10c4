"""The store against damaged files and a second process: checksummed checkpoints, the state-dir lock,
leftovers of interrupted writes, checkpoint retention, and a damaged or rolled-back database at start."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from coordinator.store import Store
from plexus.config import CheckpointsSpec
from plexus.errors import FailedPrecondition, IntegrityError, NotFound

import state_db
from checkpoint_damage import DAMAGE, bit_flip, data_offset, header


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state")
    yield s
    s.close()


def _model(seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"fc.bias": rng.standard_normal(4).astype(np.float32),
            "fc.weight": rng.standard_normal((4, 3)).astype(np.float32)}


# checksums --------------------------------------------------------------------------------

def test_a_checkpoint_carries_its_sha256_in_the_header_and_the_database(store):
    path = store.save_checkpoint("job-1", 1, _model())

    digest = header(path)["__metadata__"]["sha256"]
    rows = state_db.query(store.state_dir, "SELECT file, job_id, round, sha256 FROM checkpoints")

    assert len(digest) == 64 and digest != "0" * 64
    assert rows == [("checkpoints/job-1/1.safetensors", "job-1", 1, digest)]
    layout, blob = store.checkpoint_blob("job-1", 1)   # verifies
    assert bytes(blob) == path.read_bytes()[data_offset(path):]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_way_of_reading_a_damaged_checkpoint_refuses_it_naming_the_file_and_the_fix(store, damage):
    path = store.save_checkpoint("job-1", 2, _model())
    DAMAGE[damage](path)

    for read in (lambda: store.checkpoint_blob("job-1", 2), lambda: store.load_checkpoint("job-1", 2),
                 lambda: store.checkpoint_source("job-1", 2)):
        with pytest.raises(IntegrityError, match="damaged") as err:
            read()
        assert str(path) in str(err.value) and "docs/backup-restore.md" in str(err.value)


def test_a_checkpoint_whose_header_lost_its_checksum_is_refused_while_the_database_has_one(store):
    path = store.save_checkpoint("job-1", 1, _model())
    meta = header(path)
    del meta["__metadata__"]["sha256"]
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + path.read_bytes()[data_offset(path):])

    with pytest.raises(IntegrityError, match="its header records none"):
        store.checkpoint_blob("job-1", 1)


def test_a_damaged_strategy_state_is_refused(store):
    path = store.save_strategy_state("job-1", 1, {"m": np.ones(8, np.float32)}, {"step": 1})
    bit_flip(path)

    with pytest.raises(IntegrityError, match="damaged"):
        store.load_strategy_state("job-1", 1)


def test_a_checkpoint_from_before_checksums_still_loads(store):
    """An older state dir: safetensors files with no checksum in the header and no row in the database."""
    model = _model()
    path = store.checkpoint_path("job-old", 3)
    path.parent.mkdir(parents=True)
    save_file(model, str(path), metadata={"job": "job-old", "round": "3"})

    _, blob = store.checkpoint_blob("job-old", 3)
    loaded = store.load_checkpoint("job-old", 3)

    assert {k: v.tobytes() for k, v in loaded.items()} == {k: v.tobytes() for k, v in model.items()}
    assert len(blob) == 64


def test_a_checksum_without_a_database_row_is_checked_against_the_header(store):
    """A database restored from a backup older than the checkpoints beside it (backup-restore.md)."""
    path = store.save_checkpoint("job-1", 4, _model())
    state_db.execute(store.state_dir, "DELETE FROM checkpoints")
    store.checkpoint_blob("job-1", 4)

    bit_flip(path)
    with pytest.raises(IntegrityError, match="its header records"):
        store.checkpoint_blob("job-1", 4)


def test_checkpoints_written_from_blocks_carry_the_same_checksum_as_from_a_dict(store):
    from plexus.wire import encode

    layout, blob = encode(_model())
    a = store.save_checkpoint("job-1", 1, _model())
    b = store.save_checkpoint_blob("job-1", 2, layout, iter([blob[:10], blob[10:]]))

    assert header(a)["__metadata__"]["sha256"] == header(b)["__metadata__"]["sha256"]


# the state-dir lock -----------------------------------------------------------------------

def test_a_second_store_on_one_state_dir_is_refused_naming_the_holder(tmp_path):
    first = Store(tmp_path / "state")
    try:
        with pytest.raises(FailedPrecondition, match=rf"state dir .* is in use: process {os.getpid()} holds"):
            Store(tmp_path / "state")
    finally:
        first.close()
    Store(tmp_path / "state").close()   # released on close


def test_another_process_holding_the_state_dir_is_named(tmp_path):
    state = tmp_path / "state"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from coordinator.store import Store; s = Store(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()", str(state)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(FailedPrecondition, match=f"process {holder.pid} holds"):
            Store(state)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    Store(state).close()   # a process that ended holds nothing


# leftovers, retention ---------------------------------------------------------------------

def test_temporary_files_of_interrupted_writes_are_removed_at_start(tmp_path):
    s = Store(tmp_path / "state")
    s.save_checkpoint("job-1", 1, _model())
    s.close()
    leftovers = [tmp_path / "state" / "checkpoints" / "job-1" / ".1.safetensors.0123456789ab.tmp",
                 tmp_path / "state" / "checkpoints" / "job-1" / ".2.strategy.safetensors.0123456789ab.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a model")

    Store(tmp_path / "state").close()

    assert not any(p.exists() for p in leftovers)
    assert (tmp_path / "state" / "checkpoints" / "job-1" / "1.safetensors").exists()


def _rounds_on_disk(store: Store, job_id: str) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in (store.checkpoints / job_id).glob("*.safetensors")
                  if ".strategy." not in p.name)


def test_retention_keeps_the_last_rounds_and_every_mth_and_always_the_latest(tmp_path):
    s = Store(tmp_path / "state", retention=CheckpointsSpec(keep_last=2, keep_every=3))
    try:
        for round_ in range(8):
            s.save_checkpoint("job-1", round_, _model(round_))
            s.save_strategy_state("job-1", round_, {"m": np.ones(2, np.float32)}, {})
            s.prune_checkpoints("job-1", round_)
        assert _rounds_on_disk(s, "job-1") == [0, 3, 6, 7]
        assert sorted(p.name for p in (s.checkpoints / "job-1").glob("*.strategy.safetensors")) == [
            "0.strategy.safetensors", "3.strategy.safetensors", "6.strategy.safetensors", "7.strategy.safetensors"]
        assert [r for (r,) in state_db.query(s.state_dir, "SELECT round FROM checkpoints WHERE file NOT LIKE"
                                             " '%strategy%' ORDER BY round")] == [0, 3, 6, 7]
        with pytest.raises(NotFound, match="removed by checkpoints.keep_last"):
            s.checkpoint_source("job-1", 5)
    finally:
        s.close()


def test_keep_last_one_keeps_only_the_latest(tmp_path):
    s = Store(tmp_path / "state", retention=CheckpointsSpec(keep_last=1))
    try:
        for round_ in range(4):
            s.save_checkpoint("job-1", round_, _model(round_))
            s.prune_checkpoints("job-1", round_)
        assert _rounds_on_disk(s, "job-1") == [3]
        s.checkpoint_blob("job-1", 3)
    finally:
        s.close()


def test_a_checkpoint_being_downloaded_is_not_pruned_until_the_download_ends(tmp_path):
    s = Store(tmp_path / "state", retention=CheckpointsSpec(keep_last=1))
    try:
        s.save_checkpoint("job-1", 1, _model(1))
        with s.reading("job-1", 1):
            s.save_checkpoint("job-1", 2, _model(2))
            assert s.prune_checkpoints("job-1", 2) == []
            assert _rounds_on_disk(s, "job-1") == [1, 2]
        assert s.prune_checkpoints("job-1", 2) == [1]
        assert _rounds_on_disk(s, "job-1") == [2]
    finally:
        s.close()


def test_without_retention_every_checkpoint_is_kept(store):
    for round_ in range(4):
        store.save_checkpoint("job-1", round_, _model(round_))
        assert store.prune_checkpoints("job-1", round_) == []
    assert _rounds_on_disk(store, "job-1") == [0, 1, 2, 3]


# the database at start --------------------------------------------------------------------

def _fill(state, rows: int = 300) -> None:
    s = Store(state)
    for i in range(rows):
        s.event("job-1", "note", i, "", "x" * 200)
    s.close()


def test_a_corrupt_database_page_is_found_at_start_with_the_file_and_the_fix(tmp_path):
    state = tmp_path / "state"
    _fill(state)
    db = state / "plexus.db"
    raw = bytearray(db.read_bytes())
    page = 4096
    assert len(raw) > 6 * page
    raw[5 * page:5 * page + 64] = b"\xa5" * 64   # a b-tree page header and its cell pointers, in the events table
    db.write_bytes(bytes(raw))

    with pytest.raises(IntegrityError) as err:
        Store(state)
    assert f"{db} is damaged" in str(err.value) and "docs/backup-restore.md" in str(err.value)
    (state / "plexus.db").unlink()   # "restored": the refused start released the state dir's lock
    Store(state).close()


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "plexus.db").write_bytes(b"definitely not SQLite" * 300)

    with pytest.raises(IntegrityError, match="plexus.db is damaged"):
        Store(state)


CRASH_AFTER_WRITES = """
import os, sys
from coordinator.store import Store
s = Store(sys.argv[1])
s.add_job("job-1", "heart", "name: heart", "fedavg", 3, "ops")
for i in range(50):
    s.event("job-1", "note", i, "", "x" * 100)
os._exit(0)   # like SIGKILL: the WAL and its index stay behind, holding the last transactions
"""


def test_a_deleted_write_ahead_log_is_found_at_start(tmp_path):
    state = tmp_path / "state"
    subprocess.run([sys.executable, "-c", CRASH_AFTER_WRITES, str(state)], check=True, timeout=60)
    wal = state / "plexus.db-wal"
    assert wal.exists() and (state / "plexus.db-shm").exists()
    wal.unlink()

    with pytest.raises(IntegrityError) as err:
        Store(state)
    assert f"{wal} is missing" in str(err.value) and "last transactions are lost" in str(err.value)
    assert "docs/backup-restore.md" in str(err.value)


def test_after_a_crash_with_its_write_ahead_log_the_database_opens_with_everything(tmp_path):
    state = tmp_path / "state"
    subprocess.run([sys.executable, "-c", CRASH_AFTER_WRITES, str(state)], check=True, timeout=60)

    s = Store(state)
    try:
        assert s.job("job-1").name == "heart"
        assert len(s.events_after("job-1", 0)) == 51
    finally:
        s.close()


def test_an_existing_database_gains_the_checkpoints_table(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    with sqlite3.connect(state / "plexus.db") as db:   # a database from before checksums
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, config_yaml TEXT NOT NULL,"
                   " strategy TEXT NOT NULL, status TEXT NOT NULL, rounds INTEGER NOT NULL,"
                   " current_round INTEGER NOT NULL DEFAULT 0, message TEXT NOT NULL DEFAULT '',"
                   " submitted_by TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL)")
        db.execute("INSERT INTO jobs VALUES ('j', 'j', 'y', 'fedavg', 'running', 3, 1, '', 'ops', 1, 1)")
    db.close()

    s = Store(state)
    try:
        s.save_checkpoint("j", 2, _model())
        assert s.job("j").current_round == 1
        assert state_db.query(s.state_dir, "SELECT job_id, round FROM checkpoints") == [("j", 2)]
    finally:
        s.close()
