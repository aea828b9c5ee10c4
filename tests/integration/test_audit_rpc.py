"""`plexus audit` over real mTLS: the Admin.GetAudit RPC, role-checked, with tampering pinpointed."""

from __future__ import annotations

import json
import sqlite3
from concurrent import futures

import pytest

from coordinator.audit import CoordinatorAudit
from coordinator.engine import Engine
from coordinator.service import AdminService
from coordinator.store import Store
from plexus import identity, transport
from plexus.audit import AuditLog
from plexus.cli import main as cli
from plexus.proto.plexus.v1 import admin_pb2_grpc
from plexus.rpc import Authenticator


class AuditServer:
    """Just the Admin service, with or without an audit log, on 127.0.0.1:0."""

    def __init__(self, pki_root, state_dir, *, with_audit: bool):
        kit = identity.load_kit(pki_root / "coordinator")
        self.store = Store(state_dir)
        self.log = AuditLog(state_dir / "audit.db") if with_audit else None
        if self.log is not None:
            CoordinatorAudit(self.log, self.store)
        engine = Engine(self.store, federation="test-federation", poll_timeout_s=1.0)
        auth = Authenticator(identity.RevocationList(pki_root / "coordinator" / "crl.pem", kit.ca_pem))
        self.executor = futures.ThreadPoolExecutor(max_workers=8)
        self.server, port = transport.server(kit, "127.0.0.1:0", executor=self.executor)
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminService(engine, auth, chunk_bytes=65536, audit=self.log), self.server)
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def close(self):
        self.server.stop(0).wait()
        self.executor.shutdown(wait=True)
        if self.log is not None:
            self.log.close()
        self.store.close()


@pytest.fixture
def audited(pki_root, tmp_path):
    srv = AuditServer(pki_root, tmp_path / "state", with_audit=True)
    yield srv
    srv.close()


def _args(srv, pki_root, name="viewer"):
    return ["--kit", str(pki_root / "admins" / name), "--coordinator", srv.address]


def test_viewer_reads_and_verifies_the_coordinator_audit_log(audited, pki_root, capsys):
    audited.store.add_job("j1", "heart", "name: heart\n", "fedavg", 2, "ops")
    audited.store.event("j1", "model_downloaded", 1, "", "by ops")
    assert cli(["audit", "--verify", *_args(audited, pki_root)]) == 0
    out = capsys.readouterr().out
    assert "admin:ops" in out and "job_submitted" in out and "model_downloaded" in out
    assert "verified: 2 entries, hash chain intact" in out
    assert cli(["audit", "--json", "--limit", "1", *_args(audited, pki_root)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["count"] == 2 and [e["action"] for e in doc["entries"]] == ["model_downloaded"]
    assert doc["entries"][0]["details"] == {"message": "by ops", "round": 1}


def test_tampering_is_reported_with_exit_code_1(audited, pki_root, capsys):
    for i in range(3):
        audited.store.event("j1", "round_opened", i + 1, "", "train")
    db = sqlite3.connect(audited.log.path, isolation_level=None)
    db.execute("DELETE FROM entries WHERE seq = 2")
    db.close()
    assert cli(["audit", "--verify", *_args(audited, pki_root)]) == 1
    assert "audit log verification FAILED: audit entry 2 was deleted" in capsys.readouterr().err
    assert cli(["audit", "--verify", "--json", *_args(audited, pki_root)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is False and "entry 2 was deleted" in doc["problem"]


def test_without_an_audit_log_the_reply_says_so(pki_root, tmp_path, capsys):
    srv = AuditServer(pki_root, tmp_path / "bare", with_audit=False)
    try:
        assert cli(["audit", *_args(srv, pki_root)]) == 1
        assert "no audit log configured" in capsys.readouterr().err
    finally:
        srv.close()
