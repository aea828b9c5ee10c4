"""A signed head exported from the coordinator pins its audit log: cutting the log short and rewriting
its head record, or rewriting an entry and re-chaining everything after it, are caught by
`plexus audit --verify --against HEAD_FILE` even though the chain itself is consistent again."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest

from plexus import pki
from plexus.audit import GENESIS, Entry
from plexus.cli import main as cli


def _fill(store, job_id: str, events: int) -> None:
    store.add_job(job_id, "heart", "name: heart\n", "fedavg", 2, "ops")
    for round_ in range(1, events + 1):
        store.event(job_id, "round_opened", round_, "", "train")


def _truncate(db_path, keep: int) -> None:
    """The attacker deletes the tail, points the head record at what is left and drops the signed heads."""
    with sqlite3.connect(db_path) as db:
        db.execute("DELETE FROM entries WHERE seq > ?", (keep,))
        db.execute("UPDATE head SET seq = ?, hash = (SELECT hash FROM entries WHERE seq = ?)", (keep, keep))
        db.execute("DELETE FROM anchors")


def _rewrite(db_path, seq: int, actor: str) -> None:
    """The attacker edits one entry, recomputes every hash from there on, and drops the signed heads."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT seq, at, actor, action, subject, details FROM entries ORDER BY seq").fetchall()
        prev = GENESIS
        for s, at, who, action, subject, details in rows:
            entry = Entry(s, at, actor if s == seq else who, action, subject, json.loads(details), prev)
            prev = entry.computed_hash()
            db.execute("UPDATE entries SET actor = ?, prev_hash = ?, hash = ? WHERE seq = ?",
                       (entry.actor, entry.prev_hash, prev, s))
        db.execute("UPDATE head SET hash = ?", (prev,))
        db.execute("DELETE FROM anchors")


@pytest.fixture
def exported(federation, tmp_path):
    """A log of 11 entries, its head exported at entry 6; returns (admin args, head file, audit db)."""
    args = ["--kit", str(federation.root / "admins" / "viewer"), "--coordinator", federation.address]
    head = tmp_path / "head.json"
    _fill(federation.store, "j1", 5)
    assert cli(["audit", "--export-head", str(head), *args]) == 0
    assert json.loads(head.read_text())["seq"] == 6
    _fill(federation.store, "j2", 4)
    assert cli(["audit", "--verify", "--against", str(head), *args]) == 0
    return args, head, federation.coordinator.audit_log.path


@pytest.mark.parametrize(("attack", "found"), [
    (lambda db: _truncate(db, 4), r"truncated: the signed head of .* covers entries 1\.\.6, the log now ends at seq 4"),
    (lambda db: _rewrite(db, 3, "admin:mallory"), r"rewritten: entry 6 is not the one the signed head"),
])
def test_attacks_that_pass_the_chain_check_are_caught_against_the_signed_head(exported, capsys, attack, found):
    args, head, db = exported
    attack(db)
    assert cli(["audit", "--verify", *args]) == 0   # the chain alone is consistent again: the attack's point
    capsys.readouterr()
    assert cli(["audit", "--verify", "--against", str(head), *args]) == 1
    assert re.search(found, capsys.readouterr().err)


def test_a_head_file_that_was_edited_or_signed_elsewhere_is_refused(exported, tmp_path, capsys):
    args, head, _ = exported
    doc = json.loads(head.read_text())
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**doc, "seq": 3}))
    capsys.readouterr()
    assert cli(["audit", "--verify", "--against", str(edited), *args]) == 1
    assert "signature verification failed" in capsys.readouterr().err
    other = pki.init_federation(tmp_path / "other", "other-federation")
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({**doc, "signer_cert": (other / "coordinator" / "cert.pem").read_text()}))
    assert cli(["audit", "--verify", "--against", str(foreign), *args]) == 1
    assert "not issued by this federation's CA" in capsys.readouterr().err


def test_the_coordinator_signs_its_head_at_shutdown(pki_root, tmp_path):
    from integration.harness import Federation

    fed = Federation(pki_root, tmp_path / "state")
    _fill(fed.store, "j1", 2)
    log_path = fed.coordinator.audit_log.path
    fed.close()
    with sqlite3.connect(log_path) as db:
        assert db.execute("SELECT seq FROM anchors").fetchall() == [(3,)]
