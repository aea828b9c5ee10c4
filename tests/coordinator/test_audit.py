"""Tests for coordinator.audit: committed store events become audit entries with the right actor."""

from __future__ import annotations

from coordinator.audit import CoordinatorAudit
from coordinator.store import Store
from plexus.audit import AuditLog


def test_store_events_are_audited_with_their_actor(tmp_path):
    store = Store(tmp_path / "state")
    log = AuditLog(tmp_path / "state" / "audit.db")
    audit = CoordinatorAudit(log, store)
    store.add_job("j1", "heart", "name: heart\n", "fedavg", 2, "ann")
    store.event("j1", "round_opened", 1, "", "train")
    store.event("j1", "site_declined", 1, "oslo", "model 'cnn' is not allowed", actor="site:oslo")
    store.event("j1", "site_failed", 1, "bergen", "training diverged; caused by overflow")
    store.event("j1", "model_downloaded", 1, "", "by bob", actor="admin:bob")
    store.event("j1", "job_aborted", 1, "", "aborted by ann", actor="admin:ann")
    audit.site_joined("oslo", policy_digest="d" * 64, agent_version="0.1.0")
    audit.certificate_revoked("bergen", serial=1234)
    got = [(e.actor, e.action, e.subject) for e in log.entries()]
    assert got == [
        ("admin:ann", "job_submitted", "job:j1"),
        ("coordinator", "round_opened", "job:j1"),
        ("site:oslo", "site_declined", "job:j1"),
        ("coordinator", "site_failed", "job:j1"),
        ("admin:bob", "model_downloaded", "job:j1"),
        ("admin:ann", "job_aborted", "job:j1"),
        ("site:oslo", "site_joined", "site:oslo"),
        ("coordinator", "certificate_revoked", "cert:bergen"),
    ]
    assert log.entries()[2].details == {"round": 1, "site": "oslo", "message": "model 'cnn' is not allowed"}
    assert log.verify() == 8
    log.close()
    store.close()


def test_a_join_is_audited_when_it_says_something_new_not_at_every_call(tmp_path):
    """A site calling Join in a loop (726 a second, in a probe) grew the append-only log by one entry each time."""
    store = Store(tmp_path / "state")
    log = AuditLog(tmp_path / "state" / "audit.db")
    audit = CoordinatorAudit(log, store)
    for _ in range(50):
        audit.site_joined("oslo", policy_digest="d" * 64, agent_version="0.1.0", serial=7)
    audit.site_joined("oslo", policy_digest="e" * 64, agent_version="0.1.0", serial=7)   # its policy changed
    audit.site_joined("oslo", policy_digest="e" * 64, agent_version="0.2.0", serial=7)   # upgraded
    audit.site_joined("oslo", policy_digest="e" * 64, agent_version="0.2.0", serial=8)   # a new certificate
    audit.site_joined("bergen", policy_digest="d" * 64, agent_version="0.1.0", serial=9)
    got = [(e.subject, e.details["policy_digest"][0], e.details["agent_version"]) for e in log.entries()]
    assert got == [("site:oslo", "d", "0.1.0"), ("site:oslo", "e", "0.1.0"), ("site:oslo", "e", "0.2.0"),
                   ("site:oslo", "e", "0.2.0"), ("site:bergen", "d", "0.1.0")]
    log.close()
    store.close()
