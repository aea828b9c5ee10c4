"""Behaviour of the federation PKI (plexus.pki, offline): layout, certificates, issuing errors, revocation and
the configs of the kits; what processes check at run time is in test_identity.py."""

import datetime as dt
import ipaddress
import json
import stat
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from plexus import errors, identity, pki
from plexus.cli import main as cli
from plexus.config import (
    DatasetSpec,
    TierSpec,
    load_admin_config,
    load_coordinator_config,
    load_relay_config,
    load_site_config,
)

NOW = dt.datetime(2025, 1, 15, 12, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def fed(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "Test Fed", hosts=["fl.example.org", "10.0.0.5"], port=9443, now=NOW)
    return root


def _cert(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


# --- init and layout ---------------------------------------------------------


def test_init_creates_layout_with_private_modes(fed):
    site = pki.add_site(fed, "cleveland", now=NOW)
    admin = pki.add_admin(fed, "alice", role="operator", now=NOW)
    expected = [
        "ca/ca.pem", "ca/ca.key", "federation.json", "crl.pem",
        "coordinator/ca.pem", "coordinator/cert.pem", "coordinator/key.pem",
        "coordinator/crl.pem", "coordinator/coordinator.yaml",
        "sites/cleveland/ca.pem", "sites/cleveland/cert.pem", "sites/cleveland/key.pem",
        "sites/cleveland/site.yaml",
        "admins/alice/ca.pem", "admins/alice/cert.pem", "admins/alice/key.pem", "admins/alice/admin.yaml",
    ]
    for rel in expected:
        assert (fed / rel).is_file(), rel
    assert site == fed / "sites" / "cleveland" and admin == fed / "admins" / "alice"
    for key in ["ca/ca.key", "coordinator/key.pem", "sites/cleveland/key.pem", "admins/alice/key.pem"]:
        assert _mode(fed / key) == 0o600, key
    for d in [fed, fed / "ca", fed / "coordinator", fed / "sites", site, fed / "admins", admin]:
        assert _mode(d) == 0o700, d
    assert not list(fed.rglob("*.tmp"))

    registry = json.loads((fed / "federation.json").read_text())
    assert registry["federation"] == "Test Fed"
    assert registry["hosts"] == ["fl.example.org", "10.0.0.5"] and registry["port"] == 9443
    issued = {e["name"]: e for e in registry["issued"]}
    assert set(issued) == {"coordinator", "cleveland", "alice"}
    assert issued["alice"]["kind"] == "admin" and issued["alice"]["role"] == "operator"
    assert issued["cleveland"]["serial"] == _cert(site / "cert.pem").serial_number
    assert not any(e["revoked"] for e in registry["issued"])


def test_init_refuses_an_existing_federation(fed):
    ca_before = (fed / "ca" / "ca.pem").read_bytes()
    with pytest.raises(errors.ConfigError, match="already holds a federation"):
        pki.init_federation(fed, "Other", now=NOW)
    assert (fed / "ca" / "ca.pem").read_bytes() == ca_before


@pytest.mark.parametrize("bad", ["", " lead", "a/b", "x" * 65, "naïve"])
def test_init_rejects_bad_federation_name(tmp_path, bad):
    with pytest.raises(errors.ConfigError, match="federation name"):
        pki.init_federation(tmp_path / "pki", bad)
    assert not (tmp_path / "pki").exists()


@pytest.mark.parametrize("host", ["fl.example.org:8443", "bad host", "-x.org"])
def test_init_rejects_bad_host(tmp_path, host):
    with pytest.raises(errors.ConfigError, match="--port|DNS name"):
        pki.init_federation(tmp_path / "pki", "Fed", hosts=[host])


def test_commands_on_uninitialised_root_say_how_to_init(tmp_path):
    for call in (
        lambda: pki.add_site(tmp_path, "a"),
        lambda: pki.add_admin(tmp_path / "missing", "a"),
        lambda: pki.revoke(tmp_path, "a"),
    ):
        with pytest.raises(errors.ConfigError, match=r"plexus pki init DIR --federation NAME"):
            call()


# --- certificates --------------------------------------------------------------


def test_ca_is_a_constrained_ca(fed):
    ca = _cert(fed / "ca" / "ca.pem")
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert ca.subject.rfc4514_string() == "O=Test Fed,CN=Test Fed CA"
    assert ca.not_valid_after_utc - NOW > dt.timedelta(days=3600)


def test_leaf_certs_are_issued_by_the_ca(fed):
    ca = _cert(fed / "ca" / "ca.pem")
    kits = {
        "coordinator": (fed / "coordinator", ExtendedKeyUsageOID.SERVER_AUTH),
        "site": (pki.add_site(fed, "cleveland", now=NOW), ExtendedKeyUsageOID.CLIENT_AUTH),
        "admin": (pki.add_admin(fed, "alice", now=NOW), ExtendedKeyUsageOID.CLIENT_AUTH),
        "relay": (pki.add_relay(fed, "north", hosts=["relay.example.org"], now=NOW), ExtendedKeyUsageOID.SERVER_AUTH),
    }
    for kind, (kit, usage) in kits.items():
        cert = _cert(kit / "cert.pem")
        cert.verify_directly_issued_by(ca)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature
        assert usage in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert cert.serial_number.bit_length() > 32
        aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        assert aki.key_identifier == ski.digest
        assert cert.not_valid_after_utc == NOW + dt.timedelta(days=825)
        assert cert.not_valid_before_utc <= NOW
        assert (kit / "ca.pem").read_bytes() == (fed / "ca" / "ca.pem").read_bytes(), kind


def test_coordinator_san_has_hosts_and_loopback(fed):
    san = _cert(fed / "coordinator" / "cert.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"fl.example.org", "localhost"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("127.0.0.1"),
    }


def test_site_san_is_its_name(fed):
    kit = pki.add_site(fed, "st-marys_2", now=NOW)
    san = _cert(kit / "cert.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["st-marys_2"]


# --- issuing errors ----------------------------------------------------------------


def test_duplicate_name_refused_until_revoked(fed):
    pki.add_site(fed, "cleveland", now=NOW)
    with pytest.raises(errors.ConfigError, match="revoke it first"):
        pki.add_site(fed, "cleveland", now=NOW)
    with pytest.raises(errors.ConfigError, match="revoke it first"):
        pki.add_admin(fed, "cleveland", now=NOW)
    with pytest.raises(errors.ConfigError, match="revoke it first"):
        pki.add_site(fed, "coordinator", now=NOW)
    old = pki.revoke(fed, "cleveland", now=NOW)
    new = identity.identity_from_cert((pki.add_site(fed, "cleveland", now=NOW) / "cert.pem").read_bytes())
    assert new.serial != old


@pytest.mark.parametrize("bad", ["Cleveland", "-site", "_x", "a b", "a.b", "../etc", "", "x" * 64])
def test_bad_names_refused_with_the_name_in_the_message(fed, bad):
    with pytest.raises(errors.ConfigError) as site_err:
        pki.add_site(fed, bad, now=NOW)
    assert repr(bad) in str(site_err.value)
    with pytest.raises(errors.ConfigError) as admin_err:
        pki.add_admin(fed, bad, now=NOW)
    assert repr(bad) in str(admin_err.value)
    assert not (fed / "sites").exists()


def test_unknown_role_refused(fed):
    with pytest.raises(errors.ConfigError, match=r"unknown role 'root'.*\['admin', 'operator', 'viewer'\]"):
        pki.add_admin(fed, "alice", role="root", now=NOW)


def test_naive_clock_refused(fed):
    with pytest.raises(ValueError, match="timezone-aware"):
        pki.add_site(fed, "cleveland", now=dt.datetime(2025, 1, 1))


# --- revocation --------------------------------------------------------------------


def test_revoke_is_seen_by_an_existing_revocation_list(fed):
    bad_pem = (pki.add_site(fed, "mallory", now=NOW) / "cert.pem").read_bytes()
    good_pem = (pki.add_site(fed, "cleveland", now=NOW) / "cert.pem").read_bytes()
    ca_pem = (fed / "ca" / "ca.pem").read_bytes()
    crl = identity.RevocationList(fed / "coordinator" / "crl.pem", ca_pem, clock=NOW.timestamp)
    crl.check(bad_pem)
    crl.check(good_pem)

    serial = pki.revoke(fed, "mallory", now=NOW + dt.timedelta(hours=1))

    assert serial == identity.identity_from_cert(bad_pem).serial
    with pytest.raises(errors.Unauthenticated, match=rf"site 'mallory' \(serial {serial}\) has been revoked"):
        crl.check(bad_pem)
    crl.check(good_pem)
    fresh = identity.RevocationList(fed / "crl.pem", ca_pem, clock=NOW.timestamp)
    with pytest.raises(errors.Unauthenticated):
        fresh.check(bad_pem)
    fresh.check(good_pem)
    registry = json.loads((fed / "federation.json").read_text())
    assert {e["name"]: e["revoked"] for e in registry["issued"]} == {
        "coordinator": False, "mallory": True, "cleveland": False,
    }


def test_revoked_crl_lists_all_revoked_serials_with_increasing_numbers(fed):
    a = pki.add_site(fed, "a", now=NOW)
    pki.add_admin(fed, "b", role="admin", now=NOW)
    sa = pki.revoke(fed, "a", now=NOW)
    first = x509.load_pem_x509_crl((fed / "crl.pem").read_bytes())
    sb = pki.revoke(fed, "b", now=NOW + dt.timedelta(days=1))
    second = x509.load_pem_x509_crl((fed / "crl.pem").read_bytes())
    assert (fed / "coordinator" / "crl.pem").read_bytes() == (fed / "crl.pem").read_bytes()
    assert {r.serial_number for r in second} == {sa, sb}
    assert _crl_number(second) > _crl_number(first)
    assert second.last_update_utc == NOW + dt.timedelta(days=1)
    assert second.next_update_utc == NOW + dt.timedelta(days=31)
    assert second.is_signature_valid(_cert(fed / "ca" / "ca.pem").public_key())
    assert _cert(a / "cert.pem").serial_number == sa


def _crl_number(crl):
    return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number


def test_revoke_unknown_or_twice(fed):
    with pytest.raises(errors.NotFound, match="'nobody'"):
        pki.revoke(fed, "nobody", now=NOW)
    pki.add_site(fed, "cleveland", now=NOW)
    pki.revoke(fed, "cleveland", now=NOW)
    with pytest.raises(errors.ConfigError, match="already revoked"):
        pki.revoke(fed, "cleveland", now=NOW)


def test_revoking_the_coordinator_is_refused_because_nobody_would_check_it(fed):
    """Sites, relays and admins verify the coordinator against ca.pem only: a CRL entry for it would have been
    reported done and protected nothing."""
    crl = (fed / "coordinator" / "crl.pem").read_bytes()
    registry = (fed / "federation.json").read_text()
    with pytest.raises(errors.ConfigError) as info:
        pki.revoke(fed, "coordinator", now=NOW)
    assert str(info.value).startswith("'coordinator' is the coordinator's certificate, and revoking it would "
                                      "protect nothing: sites, relays and admins check the coordinator against "
                                      "ca.pem alone"), info.value
    assert "make a new federation (`plexus pki init`)" in str(info.value)
    assert (fed / "coordinator" / "crl.pem").read_bytes() == crl and (fed / "federation.json").read_text() == registry


# --- ready configs ---------------------------------------------------------------------


def test_generated_configs_parse_and_hold_the_expected_keys(fed):
    coord_text = (fed / "coordinator" / "coordinator.yaml").read_text()
    assert "The kits dial fl.example.org:9443; this listens on every interface" in coord_text
    assert yaml.safe_load(coord_text) == {
        "listen": "0.0.0.0:9443", "kit": ".", "state_dir": "./state", "crl": "crl.pem",
    }
    site_text = (pki.add_site(fed, "123", now=NOW) / "site.yaml").read_text()
    assert "heart-disease: {kind: heart-disease, hospital: cleveland}" in site_text
    assert yaml.safe_load(site_text) == {
        "site": "123",
        "coordinator": "fl.example.org:9443",
        "kit": ".",
        "state_dir": "./state",
        "datasets": {},
        "policy": {"allowed_models": ["logistic", "mlp", "cnn"], "require_secure_aggregation": False},
    }
    admin = yaml.safe_load((pki.add_admin(fed, "alice", now=NOW) / "admin.yaml").read_text())
    assert admin == {"coordinator": "fl.example.org:9443", "kit": "."}


def test_configs_default_to_localhost_without_hosts(tmp_path):
    root = pki.init_federation(tmp_path / "pki", "Fed", now=NOW)
    site = yaml.safe_load((pki.add_site(root, "a", now=NOW) / "site.yaml").read_text())
    assert site["coordinator"] == "localhost:8443"
    assert yaml.safe_load((root / "coordinator" / "coordinator.yaml").read_text())["listen"] == "127.0.0.1:8443"


@pytest.mark.parametrize("host, dialled, listen", [
    ("127.0.0.1", "127.0.0.1:8443", "127.0.0.1:8443"), ("localhost", "localhost:8443", "127.0.0.1:8443"),
    ("::1", "[::1]:8443", "[::1]:8443"), ("10.0.0.5", "10.0.0.5:8443", "0.0.0.0:8443"),
    ("fd00::5", "[fd00::5]:8443", "[::]:8443"), ("fl.example.org", "fl.example.org:8443", "0.0.0.0:8443")])
def test_the_coordinator_listens_where_the_kits_dial(tmp_path, host, dialled, listen):
    root = pki.init_federation(tmp_path / "pki", "Fed", hosts=[host], now=NOW)
    coordinator = load_coordinator_config(root / "coordinator" / "coordinator.yaml")
    assert coordinator.listen == listen
    assert load_admin_config(pki.add_admin(root, "ann", now=NOW) / "admin.yaml").coordinator == dialled
    assert load_site_config(pki.add_site(root, "a", now=NOW) / "site.yaml").coordinator == dialled
    loopback = listen.startswith(("127.", "[::1]"))
    assert ("loopback only" in (root / "coordinator" / "coordinator.yaml").read_text()) is loopback


def test_a_site_kit_maps_the_datasets_it_is_issued_with(fed):
    datasets = {"heart-disease": {"kind": "heart-disease", "hospital": "va"},
                "registry": {"kind": "csv", "path": "/srv/data/heart \"2024\".csv", "label": "target"}}
    kit = pki.add_site(fed, "va", datasets=datasets, now=NOW)
    site = load_site_config(kit / "site.yaml")
    assert site.datasets["heart-disease"] == DatasetSpec(kind="heart-disease", hospital="va")
    assert site.datasets["registry"] == DatasetSpec(kind="csv", path=Path('/srv/data/heart "2024".csv'),
                                                    label="target")
    assert site.kit == kit and site.state_dir == kit / "state"   # absolute: the agent runs from any directory


# --- relays ------------------------------------------------------------------------------


def test_relay_kit_layout_and_certificate(fed):
    kit = pki.add_relay(fed, "north", hosts=["relay.example.org", "10.1.2.3"], port=9444, now=NOW)
    assert kit == fed / "relays" / "north"
    for rel in ("ca.pem", "cert.pem", "key.pem", "crl.pem", "relay.yaml"):
        assert (kit / rel).is_file(), rel
    assert _mode(kit / "key.pem") == 0o600 and _mode(kit) == 0o700 and _mode(fed / "relays") == 0o700
    assert (kit / "crl.pem").read_bytes() == (fed / "crl.pem").read_bytes()
    assert identity.load_kit(kit).path == kit
    cert = _cert(kit / "cert.pem")
    assert identity.identity_from_cert((kit / "cert.pem").read_bytes()) == identity.Identity(
        "north", "relay", None, cert.serial_number)
    # A server to its children and a client of its parent.
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["relay.example.org", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3"),
                                                       ipaddress.ip_address("127.0.0.1")]
    registry = json.loads((fed / "federation.json").read_text())
    (entry,) = [e for e in registry["issued"] if e["name"] == "north"]
    assert entry["kind"] == "relay" and entry["serial"] == cert.serial_number and entry["role"] is None


def test_relay_yaml_loads_and_points_at_the_coordinator(fed):
    kit = pki.add_relay(fed, "north", hosts=["relay.example.org"], port=9444, now=NOW)
    text = (kit / "relay.yaml").read_text()
    relay = load_relay_config(kit / "relay.yaml")
    assert relay.parent == "fl.example.org:9443"   # the coordinator's address, as the site kits dial it
    assert relay.listen == "0.0.0.0:9444"
    assert relay.kit == kit and relay.state_dir == kit / "state" and relay.crl == kit / "crl.pem"
    assert relay.tier == TierSpec(sites_min=1, deadline_s=300)
    # The comments tell the operator what the fields are and where the children must point.
    assert "`coordinator:` in each child's site.yaml" in text and "relay.example.org:9444" in text
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for key in ("parent", "listen", "kit", "crl", "state_dir", "tier", "sites_min", "deadline_s"):
        assert f"{key}: " in comments, key


@pytest.mark.parametrize("hosts, dialled, listen", [
    ((), "localhost:8443", "127.0.0.1:8443"), (("127.0.0.1",), "127.0.0.1:8443", "127.0.0.1:8443"),
    (("fd00::7",), "[fd00::7]:8443", "[::]:8443"), (("relay.example.org",), "relay.example.org:8443", "0.0.0.0:8443")])
def test_a_relay_listens_where_its_children_dial(fed, hosts, dialled, listen):
    kit = pki.add_relay(fed, "north", hosts=hosts, now=NOW)
    assert load_relay_config(kit / "relay.yaml").listen == listen
    assert dialled in (kit / "relay.yaml").read_text()


def test_relay_names_are_unique_across_kinds(fed):
    pki.add_site(fed, "cleveland", now=NOW)
    with pytest.raises(errors.ConfigError, match="site 'cleveland' is already issued.*revoke it first"):
        pki.add_relay(fed, "cleveland", hosts=["relay.example.org"], now=NOW)
    pki.add_relay(fed, "north", hosts=["relay.example.org"], now=NOW)
    for add in (lambda: pki.add_site(fed, "north", now=NOW), lambda: pki.add_admin(fed, "north", now=NOW),
                lambda: pki.add_relay(fed, "north", now=NOW)):
        with pytest.raises(errors.ConfigError, match="relay 'north' is already issued"):
            add()
    with pytest.raises(errors.ConfigError, match="revoke it first"):
        pki.add_relay(fed, "coordinator", now=NOW)
    assert not (fed / "relays" / "cleveland").exists() and not (fed / "relays" / "coordinator").exists()


@pytest.mark.parametrize("kw, match", [
    ({"name": "North"}, "relay name 'North' is invalid"), ({"hosts": ["relay.example.org:9444"]}, "--port"),
    ({"hosts": "relay.example.org"}, "sequence of host names"), ({"port": 0}, "port 0 is invalid"),
    ({"port": True}, "port True is invalid")])
def test_bad_relay_arguments_are_refused_before_anything_is_issued(fed, kw, match):
    args = {"name": "north", "hosts": ["relay.example.org"], "port": 8443, **kw}
    with pytest.raises((errors.ConfigError, TypeError), match=match):
        pki.add_relay(fed, args.pop("name"), **args, now=NOW)
    assert not (fed / "relays").exists()
    assert [e["name"] for e in json.loads((fed / "federation.json").read_text())["issued"]] == ["coordinator"]


def test_add_relay_on_an_uninitialised_root_says_how_to_init(tmp_path):
    with pytest.raises(errors.ConfigError, match=r"plexus pki init DIR --federation NAME"):
        pki.add_relay(tmp_path, "north", hosts=["relay.example.org"])


def test_revoking_a_relay_reaches_the_coordinator_and_every_relay(fed):
    north = pki.add_relay(fed, "north", hosts=["north.example.org"], now=NOW)
    south = pki.add_relay(fed, "south", hosts=["south.example.org"], now=NOW)
    site_pem = (pki.add_site(fed, "cleveland", now=NOW) / "cert.pem").read_bytes()
    north_pem = (north / "cert.pem").read_bytes()
    ca_pem = (fed / "ca" / "ca.pem").read_bytes()
    at_south = identity.RevocationList(south / "crl.pem", ca_pem, clock=NOW.timestamp)
    at_south.check(site_pem)

    serial = pki.revoke(fed, "north", now=NOW)
    pki.revoke(fed, "cleveland", now=NOW)

    assert serial == _cert(north / "cert.pem").serial_number
    for crl_file in (fed / "crl.pem", fed / "coordinator" / "crl.pem", north / "crl.pem", south / "crl.pem"):
        assert crl_file.read_bytes() == (fed / "crl.pem").read_bytes(), crl_file
    with pytest.raises(errors.Unauthenticated, match=rf"relay 'north' \(serial {serial}\) has been revoked"):
        identity.RevocationList(fed / "coordinator" / "crl.pem", ca_pem, clock=NOW.timestamp).check(north_pem)
    with pytest.raises(errors.Unauthenticated, match="site 'cleveland'"):
        at_south.check(site_pem)   # a relay's children are checked against its copy of the CRL
    assert pki.crl_kits(fed) == [fed / "coordinator", north, south]
    number = pki.reissue_crl(fed, now=NOW + dt.timedelta(days=20))
    assert _crl_number(x509.load_pem_x509_crl((south / "crl.pem").read_bytes())) == number
    # Re-issued under the same name once revoked; a fresh kit, with a fresh CRL.
    again = pki.add_relay(fed, "north", hosts=["north.example.org"], now=NOW)
    assert _cert(again / "cert.pem").serial_number != serial
    assert (again / "crl.pem").read_bytes() == (fed / "crl.pem").read_bytes()


def test_cli_add_relay_says_where_the_kit_is_and_what_to_do_next(fed, capsys):
    assert cli(["pki", "add-relay", str(fed), "north", "--host", "relay.example.org", "--host", "10.1.2.3",
                "--port", "9444"]) == 0
    out = capsys.readouterr().out
    kit = fed / "relays" / "north"
    assert f"relay kit: {kit}" in out and "plexus relay run --config relay.yaml" in out
    assert "`coordinator:`" in out and "relay.example.org:9444" in out and "fl.example.org:9443" in out
    san = _cert(kit / "cert.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.1.2.3") in san.get_values_for_type(x509.IPAddress)
    assert cli(["pki", "revoke", str(fed), "north"]) == 0
    out = capsys.readouterr().out
    assert str(kit / "crl.pem") in out and str(fed / "coordinator" / "crl.pem") in out and "each relay" in out
    with pytest.raises(SystemExit) as exit_:   # argparse: the children need a name to dial
        cli(["pki", "add-relay", str(fed), "south"])
    assert exit_.value.code == 2 and "--host" in capsys.readouterr().err
    assert cli(["pki", "add-relay", str(fed), "south", "--host", "bad host"]) == 1
    assert "neither an IP address nor a DNS name" in capsys.readouterr().err
