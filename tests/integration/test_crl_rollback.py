"""A CRL cannot be rolled back or left to expire: the coordinator keeps the highest CRL number it has
loaded in its state dir and refuses an older or expired CRL, across restarts (fail closed)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

import grpc
import pytest
from cryptography import x509

from coordinator.server import Coordinator
from plexus import errors, identity, pki
from plexus.cli import main as cli
from plexus.config import CoordinatorConfig

from integration.harness import RawSite, free_port, wait_until

NOW = dt.datetime(2025, 1, 15, 12, 0, tzinfo=dt.timezone.utc)


class CoordinatorProcess:
    """`plexus coordinator run` in its own process, as an operator starts it."""

    def __init__(self, config, log):
        self.config, self.log, self.proc = config, log, None

    def start(self) -> subprocess.Popen:
        addr = self.config.parent / "state" / "coordinator.addr"
        addr.unlink(missing_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "plexus", "coordinator", "run", "--config",
                                          str(self.config)], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_until(lambda: addr.exists() or self.proc.poll() is not None, 120, "the coordinator to listen or exit")
        return self.proc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def coordinator_process(tmp_path):
    root = tmp_path / "pki"
    port = free_port()
    pki.init_federation(root, "crl-test", hosts=["127.0.0.1"], port=port)
    for name in ("a", "b"):
        pki.add_site(root, name)
    proc = CoordinatorProcess(root / "coordinator" / "coordinator.yaml", tmp_path / "coordinator.log")
    yield root, f"127.0.0.1:{port}", proc
    proc.stop()


def _join(root, address, name):
    site = RawSite(root / "sites" / name, address)
    try:
        return site.join().site
    finally:
        site.close()


def test_an_old_crl_put_back_during_a_restart_keeps_the_coordinator_down(coordinator_process, tmp_path):
    root, address, coordinator = coordinator_process
    crl_path = root / "coordinator" / "crl.pem"
    old_crl = crl_path.read_bytes()   # number 1: nobody revoked
    assert coordinator.start().poll() is None
    assert _join(root, address, "b") == "b"
    pki.revoke(root, "b")             # number 2
    with pytest.raises(grpc.RpcError) as err:
        _join(root, address, "b")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    coordinator.stop()

    crl_path.write_bytes(old_crl)     # the attack: roll the CRL back while the coordinator is down
    proc = coordinator.start()
    assert proc.wait(timeout=60) == 1, "the coordinator started with a rolled-back CRL"
    log = coordinator.log.read_text()
    assert "number 1, older than number 2" in log and "plexus pki crl" in log, log

    # The fix the message names: a fresh CRL from the PKI folder; b stays revoked, a is welcome.
    assert cli(["pki", "crl", str(root)]) == 0
    assert coordinator.start().poll() is None
    with pytest.raises(grpc.RpcError) as err:
        _join(root, address, "b")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _join(root, address, "a") == "a"


def _config(root, state_dir) -> CoordinatorConfig:
    return CoordinatorConfig(listen="127.0.0.1:0", kit=root / "coordinator", state_dir=state_dir,
                             crl=root / "coordinator" / "crl.pem", poll_timeout_s=1.0)


def test_an_expired_crl_keeps_the_coordinator_down_until_it_is_reissued(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "crl-test", hosts=["127.0.0.1"], now=dt.datetime.now(dt.timezone.utc)
                        - pki.CRL_VALIDITY - dt.timedelta(days=1))
    pki.add_site(root, "a")
    with pytest.raises(errors.IntegrityError, match=r"expired at .*plexus pki crl"):
        Coordinator(_config(root, tmp_path / "state"))
    pki.reissue_crl(root)
    coordinator = Coordinator(_config(root, tmp_path / "state"))
    coordinator.start()
    try:
        assert _join(root, f"127.0.0.1:{coordinator.port}", "a") == "a"
    finally:
        coordinator.stop(grace=0.5)


# --- the RevocationList itself, with an injected clock ---------------------------------


def test_the_highest_crl_number_survives_in_the_floor_file(tmp_path):
    root = pki.init_federation(tmp_path / "pki", "crl-test", now=NOW)
    ca_pem = (root / "ca" / "ca.pem").read_bytes()
    old = (root / "crl.pem").read_bytes()
    pki.add_site(root, "mallory", now=NOW)
    pki.revoke(root, "mallory", now=NOW)
    floor = tmp_path / "state" / "crl-number"
    floor.parent.mkdir()
    identity.RevocationList(root / "crl.pem", ca_pem, floor_file=floor, clock=NOW.timestamp)
    assert floor.read_text() == "2\n" and floor.stat().st_mode & 0o777 == 0o600
    (root / "crl.pem").write_bytes(old)
    with pytest.raises(errors.IntegrityError, match=rf"number 1, older than number 2 .*{floor.name}"):
        identity.RevocationList(root / "crl.pem", ca_pem, floor_file=floor, clock=NOW.timestamp)
    floor.write_text("garbage\n")
    with pytest.raises(errors.IntegrityError, match="highest CRL number"):
        identity.RevocationList(root / "crl.pem", ca_pem, floor_file=floor, clock=NOW.timestamp)


def test_a_crl_that_expires_while_loaded_refuses_calls_until_a_fresh_one_arrives(tmp_path):
    root = pki.init_federation(tmp_path / "pki", "crl-test", now=NOW)
    site_pem = (pki.add_site(root, "a", now=NOW) / "cert.pem").read_bytes()
    now = [NOW.timestamp()]
    crl = identity.RevocationList(root / "coordinator" / "crl.pem", (root / "ca" / "ca.pem").read_bytes(),
                             clock=lambda: now[0])
    crl.check(site_pem)
    now[0] += pki.CRL_VALIDITY.total_seconds()
    with pytest.raises(errors.IntegrityError, match="expired"):
        crl.check(site_pem)
    assert pki.reissue_crl(root, now=NOW + pki.CRL_VALIDITY) == 2
    crl.check(site_pem)


def test_reissue_keeps_the_revocations_with_the_next_number_and_a_fresh_next_update(tmp_path):
    root = pki.init_federation(tmp_path / "pki", "crl-test", now=NOW)
    pki.add_site(root, "mallory", now=NOW)
    serial = pki.revoke(root, "mallory", now=NOW)
    later = NOW + dt.timedelta(days=20)
    assert pki.reissue_crl(root, now=later) == 3
    crl = x509.load_pem_x509_crl((root / "coordinator" / "crl.pem").read_bytes())
    assert (root / "crl.pem").read_bytes() == (root / "coordinator" / "crl.pem").read_bytes()
    assert [r.serial_number for r in crl] == [serial]
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 3
    assert crl.next_update_utc == later + pki.CRL_VALIDITY
