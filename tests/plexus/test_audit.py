"""Tests for plexus.audit: the hash chain and every way of tampering with it, pinpointed."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading

import pytest

from plexus.audit import GENESIS, AuditLog
from plexus.errors import IntegrityError


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.5
        return self.now


@pytest.fixture
def log(tmp_path):
    with AuditLog(tmp_path / "audit.db", clock=Clock()) as audit:
        for i in range(1, 6):
            audit.append(f"admin:u{i}", "job_submitted", f"job:j{i}", {"round": i, "note": "ü"})
        yield audit


def _sql(log: AuditLog, *statements: str) -> None:
    db = sqlite3.connect(log.path, isolation_level=None)
    for statement in statements:
        db.execute(statement)
    db.close()


def test_append_chains_entries(tmp_path):
    with AuditLog(tmp_path / "a.db", clock=lambda: 12.0) as log:
        assert log.verify() == 0 and log.head() == (0, GENESIS)
        first = log.append("admin:ann", "job_submitted", "job:1", {"b": 2, "a": [1, "x"]})
        second = log.append("coordinator", "round_opened")
        assert (first.seq, first.at, first.prev_hash) == (1, 12.0, GENESIS)
        assert second.prev_hash == first.hash and second.details == {} and second.subject == ""
        assert first.hash == first.computed_hash() and len(first.hash) == 64
        assert log.entries() == [first, second]
        assert log.entries(limit=1) == [second]
        assert log.head() == (2, second.hash) and log.count() == 2
        assert log.verify() == 2
    with AuditLog(tmp_path / "a.db") as reopened:  # survives a restart, chain continues
        third = reopened.append("coordinator", "job_completed", "job:1")
        assert third.seq == 3 and third.prev_hash == second.hash and reopened.verify() == 3


def test_append_rejects_bad_input(tmp_path):
    with AuditLog(tmp_path / "a.db") as log:
        with pytest.raises(ValueError, match="non-empty actor"):
            log.append("", "x")
        with pytest.raises(TypeError):
            log.append("a", "x", details=["not", "a", "dict"])
        with pytest.raises(ValueError):
            log.append("a", "x", details={"v": float("nan")})
        assert log.count() == 0 and log.verify() == 0


def test_concurrent_appends_keep_one_chain(tmp_path):
    with AuditLog(tmp_path / "a.db") as log:
        threads = [threading.Thread(target=lambda i=i: [log.append(f"t{i}", "x") for _ in range(20)])
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert log.verify() == 80
        assert [e.seq for e in log.entries()] == list(range(1, 81))


def test_intact_log_verifies(log):
    assert log.verify() == 5


def test_edited_entry_is_pinpointed(log):
    _sql(log, "UPDATE entries SET actor = 'admin:mallory' WHERE seq = 3")
    with pytest.raises(IntegrityError, match=r"audit entry 3 was edited"):
        log.verify()


def test_edited_details_are_pinpointed(log):
    _sql(log, """UPDATE entries SET details = '{"note":"ü","round":99}' WHERE seq = 2""")
    with pytest.raises(IntegrityError, match=r"audit entry 2 was edited"):
        log.verify()


def test_garbled_details_are_pinpointed(log):
    _sql(log, "UPDATE entries SET details = '{not json' WHERE seq = 4")
    with pytest.raises(IntegrityError, match=r"audit entry 4 was edited: its details are not valid JSON"):
        log.verify()


def test_deleted_entry_is_pinpointed(log):
    _sql(log, "DELETE FROM entries WHERE seq = 2")
    with pytest.raises(IntegrityError, match=r"audit entry 2 was deleted: the log jumps from seq 1 to seq 3"):
        log.verify()


def test_deleted_first_entries_are_pinpointed(log):
    _sql(log, "DELETE FROM entries WHERE seq <= 2")
    with pytest.raises(IntegrityError, match=r"audit entries 1\.\.2 were deleted"):
        log.verify()


def test_reordered_entries_are_pinpointed(log):
    _sql(log, "UPDATE entries SET seq = -1 WHERE seq = 2", "UPDATE entries SET seq = 2 WHERE seq = 4",
         "UPDATE entries SET seq = 4 WHERE seq = -1")
    with pytest.raises(IntegrityError, match=r"audit entry 2 is out of order: it was written as seq 4"):
        log.verify()


def test_adjacent_swap_is_pinpointed(log):
    _sql(log, "UPDATE entries SET seq = -1 WHERE seq = 3", "UPDATE entries SET seq = 3 WHERE seq = 4",
         "UPDATE entries SET seq = 4 WHERE seq = -1")
    with pytest.raises(IntegrityError, match=r"audit entry 3 is out of order: it was written as seq 4"):
        log.verify()


def test_truncated_tail_is_detected(log):
    _sql(log, "DELETE FROM entries WHERE seq >= 4")
    with pytest.raises(IntegrityError, match=r"truncated: entries 4\.\.5 are missing"):
        log.verify()


def test_last_entry_removed_is_detected(log):
    _sql(log, "DELETE FROM entries WHERE seq = 5")
    with pytest.raises(IntegrityError, match=r"truncated: entry 5 is missing"):
        log.verify()


def test_head_tampering_is_detected(log):
    _sql(log, "UPDATE head SET hash = 'ab' || substr(hash, 3)")
    with pytest.raises(IntegrityError, match=r"head mismatch at seq 5"):
        log.verify()


def test_deleted_head_is_detected(log):
    _sql(log, "DELETE FROM head")
    with pytest.raises(IntegrityError, match=r"head record is missing"):
        log.verify()


def test_replaced_entry_with_valid_hash_breaks_the_link(log):
    """A forger who recomputes one entry's hash still breaks the next entry's prev_hash."""
    entry = log.entries()[2]
    forged = dataclasses.replace(entry, actor="admin:mallory")
    forged = dataclasses.replace(forged, hash=forged.computed_hash())
    _sql(log, f"UPDATE entries SET actor = 'admin:mallory', hash = '{forged.hash}' WHERE seq = 3")
    with pytest.raises(IntegrityError, match=r"audit entry 4 does not follow entry 3"):
        log.verify()
