"""Signed heads in plexus.audit: kept every N entries, checked by verify(), and pinned outside the log."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from plexus import identity, pki
from plexus.audit import AuditLog, SignedHead, verify_against
from plexus.errors import IntegrityError


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    return pki.init_federation(tmp_path_factory.mktemp("pki") / "fed", "anchor-test")


@pytest.fixture
def log(tmp_path, federation):
    kit = identity.load_kit(federation / "coordinator")
    start = int(time.time())   # the signer's certificate is valid from now
    clock = iter(range(start, start + 1000))
    with AuditLog(tmp_path / "audit.db", clock=lambda: float(next(clock)), signer=(kit.key_pem, kit.cert_pem),
                  anchor_every=3) as audit:
        for i in range(1, 8):
            audit.append(f"admin:u{i}", "job_submitted", f"job:j{i}", {"round": i})
        yield audit


def _sql(log, *statements):
    with sqlite3.connect(log.path) as db:
        for statement, *args in statements:
            db.execute(statement, *args)


def test_heads_are_signed_every_n_entries_and_on_demand(log, federation):
    with sqlite3.connect(log.path) as db:
        assert [r[0] for r in db.execute("SELECT seq FROM anchors ORDER BY seq")] == [3, 6]
    head = log.anchor()
    assert (head.seq, head.hash) == log.head() == (7, log.entries()[-1].hash)
    head.verify((federation / "ca" / "ca.pem").read_bytes())
    assert SignedHead.from_json(head.to_json()) == head
    assert log.verify() == 7
    verify_against(log.entries(), head, (federation / "ca" / "ca.pem").read_bytes())


def test_verify_catches_a_truncation_below_a_kept_signed_head(log):
    last4 = log.entries()[3].hash
    _sql(log, ("DELETE FROM entries WHERE seq > 4",), ("UPDATE head SET seq = 4, hash = ?", (last4,)))
    with pytest.raises(IntegrityError, match=r"truncated: a signed head kept in the log .* covers entries 1\.\.6"):
        log.verify()


def test_verify_catches_a_rechained_rewrite_below_a_kept_signed_head(log):
    entries = log.entries()
    _sql(log, ("DELETE FROM entries WHERE seq > 5",), ("DELETE FROM head",))
    # Re-append 6 and 7 after a forged 5: the chain and head records are consistent again.
    forged = entries[4].__class__(5, entries[4].at, "admin:mallory", entries[4].action, entries[4].subject,
                                  entries[4].details, entries[3].hash)
    _sql(log, ("UPDATE entries SET actor = ?, hash = ? WHERE seq = 5", ("admin:mallory", forged.computed_hash())),
         ("INSERT INTO head VALUES (1, 5, ?)", (forged.computed_hash(),)))
    log.append("admin:u6", "job_submitted", "job:j6", {"round": 6})
    with pytest.raises(IntegrityError, match="rewritten: entry 6 is not the one a signed head kept in the log"):
        log.verify()


def test_an_edited_kept_head_fails_its_signature(log):
    _sql(log, ("UPDATE anchors SET at = at + 1 WHERE seq = 3",))
    with pytest.raises(IntegrityError, match="signed head kept for audit entry 3 fails its signature"):
        log.verify()


def test_a_log_without_a_signer_signs_nothing(tmp_path):
    with AuditLog(tmp_path / "site.db") as plain:
        plain.append("site", "ran", "job:j", {})
        with pytest.raises(IntegrityError, match="no signing key"):
            plain.anchor()


@pytest.mark.parametrize("text", ["", "[]", json.dumps({"format": "other"}),
                                  json.dumps({"format": "plexus-audit-head/1"})])
def test_a_file_that_is_not_a_signed_head_is_refused(text):
    with pytest.raises(IntegrityError, match="not a signed audit head"):
        SignedHead.from_json(text, source="head.json")


def test_a_relay_signs_its_own_log_s_head_and_a_site_cannot(tmp_path, federation):
    ca = (federation / "ca" / "ca.pem").read_bytes()
    if not (federation / "relays" / "relay-north").exists():
        pki.add_relay(federation, "relay-north", hosts=["127.0.0.1"])
        pki.add_site(federation, "clinic")
    for kit_dir, signs in ((federation / "relays" / "relay-north", True), (federation / "sites" / "clinic", False)):
        kit = identity.load_kit(kit_dir)
        with AuditLog(tmp_path / f"{kit_dir.name}.db", signer=(kit.key_pem, kit.cert_pem)) as audit:
            audit.append("admin:ops", "job_submitted", "job:j1", {"round": 1})
            head = audit.anchor()
            if signs:
                head.verify(ca)
                verify_against(audit.entries(), head, ca)
            else:
                with pytest.raises(IntegrityError, match="coordinator"):
                    head.verify(ca)
