"""Behaviour of plexus.identity, what every process checks at run time: identities read from certificates,
kits, and the CRL that fails closed."""

import base64
import datetime as dt
import os
import ssl
import threading
import time

import pytest
from cryptography import x509

from plexus import errors, identity, pki

NOW = dt.datetime(2025, 1, 15, 12, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def fed(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "Test Fed", hosts=["fl.example.org", "10.0.0.5"], port=9443, now=NOW)
    return root


def _pem_to_der(pem: bytes) -> bytes:
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    return base64.b64decode(body)


def _der_to_pem(der: bytes, label: str) -> bytes:
    b64 = base64.encodebytes(der).replace(b"\n", b"")
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    return b"\n".join([f"-----BEGIN {label}-----".encode(), *lines, f"-----END {label}-----".encode(), b""])


# --- identities ------------------------------------------------------------------


def test_identity_from_site_admin_and_coordinator_certs(fed):
    site_pem = (pki.add_site(fed, "cleveland", now=NOW) / "cert.pem").read_bytes()
    admin_pem = (pki.add_admin(fed, "alice", role="admin", now=NOW) / "cert.pem").read_bytes()
    site = identity.identity_from_cert(site_pem)
    assert site == identity.Identity("cleveland", "site", None, _cert_serial(site_pem))
    assert identity.identity_from_cert(admin_pem) == identity.Identity("alice", "admin", "admin",
                                                                       _cert_serial(admin_pem))
    bob_pem = (pki.add_admin(fed, "bob", now=NOW) / "cert.pem").read_bytes()
    assert identity.identity_from_cert(bob_pem).role == "viewer"  # the default role is the least powerful
    coord = identity.identity_from_cert((fed / "coordinator" / "cert.pem").read_bytes())
    assert (coord.name, coord.kind, coord.role) == ("coordinator", "coordinator", None)
    assert identity.identity_from_cert(ssl.PEM_cert_to_DER_cert(site_pem.decode())) == site


def _cert_serial(pem):
    return x509.load_pem_x509_certificate(pem).serial_number


def test_a_relay_certificate_is_a_relay_identity_and_a_client_leaf(fed):
    assert identity.KINDS == ("coordinator", "relay", "site", "admin")
    relay_pem = (pki.add_relay(fed, "north", hosts=["relay.example.org"], now=NOW) / "cert.pem").read_bytes()
    assert identity.identity_from_cert(relay_pem) == identity.Identity("north", "relay", None,
                                                                       _cert_serial(relay_pem))
    ca_pem = (fed / "ca" / "ca.pem").read_bytes()
    identity.check_leaf(relay_pem, ca_pem)   # it dials its parent with this certificate, as a site does
    identity.verify_issued(relay_pem, ca_pem, name="north", kind="relay", now=NOW)
    with pytest.raises(errors.IntegrityError, match="presented for site 'north' belongs to relay 'north'"):
        identity.verify_issued(relay_pem, ca_pem, name="north", kind="site", now=NOW)
    with pytest.raises(errors.IntegrityError, match="plexus pki add-relay"):
        identity.verify_issued(relay_pem, ca_pem, name="north", kind="relay", now=NOW + dt.timedelta(days=900))


def test_identity_rejects_garbage_and_certs_without_a_kind(fed):
    with pytest.raises(errors.Unauthenticated):
        identity.identity_from_cert(b"not a certificate")
    with pytest.raises(errors.Unauthenticated):
        identity.identity_from_cert(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(errors.Unauthenticated, match="OU"):
        identity.identity_from_cert((fed / "ca" / "ca.pem").read_bytes())  # the CA has no OU


def test_crl_from_another_federation_is_rejected(fed, tmp_path):
    other = pki.init_federation(tmp_path / "other", "Other Fed", now=NOW)
    ca_pem = (fed / "ca" / "ca.pem").read_bytes()
    with pytest.raises(errors.IntegrityError, match="fails verification against this federation's CA"):
        identity.RevocationList(other / "crl.pem", ca_pem)


def test_crl_from_a_same_named_federation_is_rejected(fed, tmp_path):
    twin = pki.init_federation(tmp_path / "twin", "Test Fed", now=NOW)
    with pytest.raises(errors.IntegrityError):
        identity.RevocationList(twin / "crl.pem", (fed / "ca" / "ca.pem").read_bytes())


def test_tampered_crl_is_rejected(fed, tmp_path):
    pki.add_site(fed, "mallory", now=NOW)
    serial = pki.revoke(fed, "mallory", now=NOW)
    der = bytearray(_pem_to_der((fed / "crl.pem").read_bytes()))
    # Edit the revoked serial (an attacker un-revoking a cert): still parses, signature no longer holds.
    raw = serial.to_bytes((serial.bit_length() + 8) // 8, "big")
    at = bytes(der).index(raw)
    der[at + len(raw) - 1] ^= 0x01
    path = tmp_path / "tampered.pem"
    path.write_bytes(_der_to_pem(bytes(der), "X509 CRL"))
    ca_pem = (fed / "ca" / "ca.pem").read_bytes()
    with pytest.raises(errors.IntegrityError):
        identity.RevocationList(path, ca_pem)
    # Flipping any byte of the signature is caught too.
    der = bytearray(_pem_to_der((fed / "crl.pem").read_bytes()))
    der[-1] ^= 0x01
    path.write_bytes(_der_to_pem(bytes(der), "X509 CRL"))
    with pytest.raises(errors.IntegrityError):
        identity.RevocationList(path, ca_pem)


def test_crl_tampered_after_load_fails_closed(fed):
    site_pem = (pki.add_site(fed, "cleveland", now=NOW) / "cert.pem").read_bytes()
    ca_pem = (fed / "ca" / "ca.pem").read_bytes()
    crl_path = fed / "coordinator" / "crl.pem"
    crl = identity.RevocationList(crl_path, ca_pem, clock=NOW.timestamp)
    der = bytearray(_pem_to_der(crl_path.read_bytes()))
    der[-1] ^= 0x01
    crl_path.write_bytes(_der_to_pem(bytes(der), "X509 CRL"))
    with pytest.raises(errors.IntegrityError):
        crl.check(site_pem)


def test_older_crl_cannot_replace_a_newer_one(fed):
    pki.add_site(fed, "mallory", now=NOW)
    ca_pem = (fed / "ca" / "ca.pem").read_bytes()
    old = (fed / "crl.pem").read_bytes()
    pki.revoke(fed, "mallory", now=NOW)
    crl = identity.RevocationList(fed / "crl.pem", ca_pem, clock=NOW.timestamp)
    (fed / "crl.pem").write_bytes(old)
    with pytest.raises(errors.IntegrityError, match="older"):
        crl.check((fed / "sites" / "mallory" / "cert.pem").read_bytes())


def test_revoked_answers_for_a_serial_and_reloads_a_changed_crl(fed):
    kept, gone = (_serial(pki.add_site(fed, name, now=NOW)) for name in ("cleveland", "mallory"))
    heard = []
    crl = identity.RevocationList(fed / "coordinator" / "crl.pem", (fed / "ca" / "ca.pem").read_bytes(),
                                  clock=NOW.timestamp, on_revoked=heard.append)
    assert not crl.revoked(kept) and not crl.revoked(gone)
    assert pki.revoke(fed, "mallory", now=NOW) == gone
    assert crl.revoked(gone) and not crl.revoked(kept)   # the new file, without a call to check() first
    assert heard == [[gone]]


def test_the_watch_hears_of_revocations_without_a_call_and_logs_a_broken_crl_once(fed, caplog):
    gone = _serial(pki.add_site(fed, "mallory", now=NOW))
    crl_path = fed / "coordinator" / "crl.pem"
    heard, stop = [], threading.Event()
    crl = identity.RevocationList(crl_path, (fed / "ca" / "ca.pem").read_bytes(), clock=NOW.timestamp,
                                  on_revoked=lambda serials: (heard.append(serials), stop.set()))
    good = crl_path.read_bytes()
    crl_path.write_bytes(good[:100])   # broken for a few looks: logged once, and the watch goes on
    watching = threading.Thread(target=crl.watch, args=(stop, 0.01))
    watching.start()
    try:
        deadline = time.monotonic() + 10
        while "CRL" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert pki.revoke(fed, "mallory", now=NOW) == gone   # a good CRL again, with mallory on it
        watching.join(timeout=10)
    finally:
        stop.set()
        watching.join()
    assert heard == [[gone]]
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1, caplog.text


def test_revoked_fails_closed_as_check_does(fed):
    serial = _serial(pki.add_site(fed, "cleveland", now=NOW))
    crl_path = fed / "coordinator" / "crl.pem"
    now = [NOW.timestamp()]
    crl = identity.RevocationList(crl_path, (fed / "ca" / "ca.pem").read_bytes(), clock=lambda: now[0])
    der = bytearray(_pem_to_der(crl_path.read_bytes()))
    der[-1] ^= 0x01
    crl_path.write_bytes(_der_to_pem(bytes(der), "X509 CRL"))
    with pytest.raises(errors.IntegrityError, match="fails verification"):
        crl.revoked(serial)
    pki.reissue_crl(fed, now=NOW)
    assert not crl.revoked(serial)
    now[0] += pki.CRL_VALIDITY.total_seconds()   # an expired CRL may miss a revocation
    with pytest.raises(errors.IntegrityError, match="expired"):
        crl.revoked(serial)
    crl_path.unlink()
    with pytest.raises(errors.ConfigError, match="disappeared"):
        crl.revoked(serial)


def _serial(kit_dir) -> int:
    return identity.identity_from_cert((kit_dir / "cert.pem").read_bytes()).serial


def test_missing_crl_is_a_config_error(fed):
    with pytest.raises(errors.ConfigError, match="does not exist"):
        identity.RevocationList(fed / "nope.pem", (fed / "ca" / "ca.pem").read_bytes())


# --- kits ----------------------------------------------------------------------------


def test_load_kit_reads_a_valid_kit(fed):
    kit_dir = pki.add_site(fed, "cleveland", now=NOW)
    kit = identity.load_kit(kit_dir)
    assert kit.path == kit_dir
    assert kit.cert_pem == (kit_dir / "cert.pem").read_bytes()
    assert kit.ca_pem == (fed / "ca" / "ca.pem").read_bytes()
    assert kit.key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    identity.load_kit(fed / "coordinator")


def test_load_kit_missing_file(fed):
    kit_dir = pki.add_site(fed, "cleveland", now=NOW)
    (kit_dir / "cert.pem").unlink()
    with pytest.raises(errors.ConfigError, match=r"cert\.pem is missing.*plexus pki add-site.*add-relay") as err:
        identity.load_kit(kit_dir)
    assert str((kit_dir / "cert.pem").resolve()) in str(err.value)


def test_load_kit_rejects_a_readable_key(fed):
    kit_dir = pki.add_site(fed, "cleveland", now=NOW)
    os.chmod(kit_dir / "key.pem", 0o644)
    with pytest.raises(errors.ConfigError, match=r"chmod 600 .*key\.pem"):
        identity.load_kit(kit_dir)


def test_load_kit_rejects_cert_from_another_ca(fed, tmp_path):
    kit_dir = pki.add_site(fed, "cleveland", now=NOW)
    other = pki.add_site(pki.init_federation(tmp_path / "other", "Other Fed", now=NOW), "cleveland", now=NOW)
    for name in ("cert.pem", "key.pem"):
        (kit_dir / name).write_bytes((other / name).read_bytes())
    with pytest.raises(errors.IntegrityError, match="not issued by the CA"):
        identity.load_kit(kit_dir)


def test_load_kit_rejects_a_key_of_another_cert(fed):
    kit_dir = pki.add_site(fed, "cleveland", now=NOW)
    other = pki.add_site(fed, "boston", now=NOW)
    (kit_dir / "key.pem").write_bytes((other / "key.pem").read_bytes())
    with pytest.raises(errors.IntegrityError, match="does not belong"):
        identity.load_kit(kit_dir)
