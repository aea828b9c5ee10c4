"""Tests for site_agent.audit and `plexus site audit`: the site's own log of what it ran, sent and declined."""

from __future__ import annotations

import json
import sqlite3

from plexus.cli import main as cli
from site_agent.audit import SiteAudit


def _site_yaml(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("site: oslo\ncoordinator: coord.example.org:8443\nkit: kit\nstate_dir: state\n")
    return path


def _fill(tmp_path):
    audit = SiteAudit(tmp_path / "state", actor="site:oslo", clock=lambda: 1_700_000_000.0)
    audit.declined("job-1", "model 'cnn' is not in this site's policy.allowed_models ['mlp']")
    audit.ran("job-2", 1, "heart-disease", "mlp", "train")
    audit.sent("job-2", 1, "ab" * 32, 212)
    audit.close()


def test_site_audit_records_what_the_site_did(tmp_path):
    _fill(tmp_path)
    audit = SiteAudit(tmp_path / "state")
    entries = audit.log.entries()
    assert [(e.actor, e.action, e.subject) for e in entries] == [
        ("site:oslo", "declined", "job:job-1"), ("site:oslo", "ran", "job:job-2"), ("site:oslo", "sent", "job:job-2")]
    assert entries[1].details == {"round": 1, "dataset": "heart-disease", "model": "mlp", "kind": "train"}
    assert entries[2].details == {"round": 1, "sha256": "ab" * 32, "num_samples": 212}
    assert audit.log.verify() == 3
    audit.close()


def test_site_audit_cli_prints_and_verifies(tmp_path, capsys):
    _fill(tmp_path)
    config = _site_yaml(tmp_path)
    assert cli(["site", "audit", "--config", str(config), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "declined" in out and "heart-disease" in out and "verified: 3 entries, hash chain intact" in out
    assert cli(["site", "audit", "--config", str(config), "--json", "--limit", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["count"] == 3 and [e["action"] for e in doc["entries"]] == ["sent"]


def test_site_audit_cli_pinpoints_tampering(tmp_path, capsys):
    _fill(tmp_path)
    db = sqlite3.connect(tmp_path / "state" / "audit.db", isolation_level=None)
    db.execute("UPDATE entries SET details = replace(details, '212', '999') WHERE seq = 3")
    db.close()
    assert cli(["site", "audit", "--config", str(_site_yaml(tmp_path)), "--verify"]) == 1
    assert "audit log verification FAILED: audit entry 3 was edited" in capsys.readouterr().err


def test_site_audit_cli_without_a_log_does_not_create_one(tmp_path, capsys):
    assert cli(["site", "audit", "--config", str(_site_yaml(tmp_path))]) == 1
    assert "no audit log at" in capsys.readouterr().err
    assert not (tmp_path / "state" / "audit.db").exists()
