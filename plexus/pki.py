"""The federation PKI, offline: the operator's CA, the kits it issues to the coordinator, relays, sites and
admins, revocation and the CRL.

Every certificate is ECDSA P-256 signed with SHA-256 by the federation CA; its subject carries the identity
plexus.identity reads back at run time (CN = name, OU = kind, TITLE = admin role).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from plexus import errors
from plexus.files import write_atomically
from plexus.identity import COORDINATOR_NAME, ROLES, as_utc, crl_number

CA_VALIDITY = dt.timedelta(days=3650)
LEAF_VALIDITY = dt.timedelta(days=825)
CRL_VALIDITY = dt.timedelta(days=30)
# Backdate not_valid_before so a peer whose clock runs a little behind still accepts a fresh cert.
CLOCK_SKEW = dt.timedelta(minutes=5)

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_FEDERATION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}$")
_DNS_LABEL_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_INIT_HINT = "run `plexus pki init DIR --federation NAME` first"
_ISSUE_HINT = "`plexus pki add-site/add-relay/add-admin`"


# ---------------------------------------------------------------------------
# Issuing


def init_federation(
    root: Path,
    federation: str,
    *,
    hosts: Sequence[str] = (),
    port: int = 8443,
    now: dt.datetime | None = None,
) -> Path:
    """Create the federation CA, an empty CRL and the coordinator kit under `root`; return `root`."""
    root = Path(root)
    now = as_utc(now)
    if not isinstance(federation, str) or not _FEDERATION_RE.match(federation):
        raise errors.ConfigError(
            f"federation name {federation!r} is invalid: use 1-64 letters, digits, spaces, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    hosts = _check_hosts(hosts)
    _check_port(port)
    if (root / "federation.json").exists() or (root / "ca").exists():
        raise errors.ConfigError(
            f"{root} already holds a federation; refusing to overwrite its CA. "
            f"Pick an empty directory, or use {_ISSUE_HINT} to extend this one"
        )

    if not root.exists():  # a directory the user already had keeps its mode; every subfolder is 0700
        _make_dir(root)
    _make_dir(root / "ca")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, f"{federation} CA"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, federation),
        ]
    )
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_atomically(root / "ca" / "ca.key", _key_pem(ca_key), mode=0o600)
    write_atomically(root / "ca" / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))

    registry = {"federation": federation, "hosts": hosts, "port": port, "issued": []}
    kit_dir = root / COORDINATOR_NAME
    crl_pem = _build_crl(ca_cert, ca_key, registry, number=1, now=now)
    _issue(
        root, registry, ca_cert, ca_key, COORDINATOR_NAME, "coordinator", None, _server_san(hosts), kit_dir, now,
        config=("coordinator.yaml", _coordinator_yaml(registry)),
    )
    write_atomically(root / "crl.pem", crl_pem)
    write_atomically(kit_dir / "crl.pem", crl_pem)
    return root


def add_site(root: Path, name: str, *, datasets: Mapping[str, Mapping[str, str]] | None = None,
             now: dt.datetime | None = None, via: str | None = None) -> Path:
    """Issue a site certificate and write its kit; return the kit dir `root/sites/<name>`.

    `datasets` (dataset name -> its site.yaml entry, e.g. {"kind": "heart-disease", "hospital": "va"})
    fills the kit's site.yaml `datasets:`; without it, the site's operator fills it in.
    """
    return add_sites(root, {name: datasets or {}}, now=now, via=via)[0]


def add_sites(root: Path, sites: Mapping[str, Mapping[str, Mapping[str, str]]], *, now: dt.datetime | None = None,
              durable: bool = True, via: str | None = None) -> list[Path]:
    """Issue a certificate and write a kit for each site of `sites` (name -> its `datasets`, as add_site takes
    them); the kit dirs, in order. The registry is read and written once, whatever the number of sites.
    `durable=False` leaves the kits' files to the page cache (no fsync): for a federation that is thrown away
    after one run (`plexus simulate`), never for a real one."""
    root = Path(root)
    now = as_utc(now)
    registry = _load_registry(root)
    for name in sites:
        _check_name(name, "site")
        _check_unique(registry, name)
    if len(set(sites)) != len(sites):
        raise errors.ConfigError("a site name is given twice")
    ca_cert, ca_key = _load_ca(root)
    address = _coordinator_address(registry) if via is None else _relay_address(registry, via)
    for name in sites:
        _make_kit_dir(root / "sites" / name)
    issued = [(name, _certify(registry, ca_cert, ca_key, name, "site", None, [x509.DNSName(name)], now))
              for name in sites]
    _save_registry(root, registry)   # every certificate that exists on disk can be revoked
    kits = []
    for name, (key, cert) in issued:
        kits.append(root / "sites" / name)
        _write_kit(kits[-1], key, cert, ca_cert, ("site.yaml", _site_yaml(name, address, sites[name])),
                   sync=durable)
    return kits


def add_admin(root: Path, name: str, *, role: str = "viewer", now: dt.datetime | None = None) -> Path:
    """Issue an admin certificate carrying `role` and write its kit; return `root/admins/<name>`."""
    root = Path(root)
    now = as_utc(now)
    _check_name(name, "admin")
    if role not in ROLES:
        raise errors.ConfigError(f"unknown role {role!r} for admin {name!r}: use one of {sorted(ROLES)}")
    registry = _load_registry(root)
    _check_unique(registry, name)
    ca_cert, ca_key = _load_ca(root)
    kit_dir = root / "admins" / name
    _issue(
        root, registry, ca_cert, ca_key, name, "admin", role, [x509.DNSName(name)], kit_dir, now,
        config=("admin.yaml", _admin_yaml(_coordinator_address(registry))),
    )
    return kit_dir


def add_relay(root: Path, name: str, *, hosts: Sequence[str] = (), port: int = 8443,
              now: dt.datetime | None = None) -> Path:
    """Issue a relay certificate and write its kit; return the kit dir `root/relays/<name>`.

    A relay is a server to its children (sites or relays below it), which dial one of `hosts` at `port`, and a
    client to its parent: its certificate carries both serverAuth and clientAuth, and names `hosts` (plus
    localhost and 127.0.0.1) as the coordinator's does. The kit holds the CRL, which the relay checks its
    children against.
    """
    root = Path(root)
    now = as_utc(now)
    _check_name(name, "relay")
    hosts = _check_hosts(hosts)
    _check_port(port)
    registry = _load_registry(root)
    _check_unique(registry, name)
    ca_cert, ca_key = _load_ca(root)
    try:
        crl_pem = (root / "crl.pem").read_bytes()
    except FileNotFoundError:
        raise errors.ConfigError(f"{root / 'crl.pem'} is missing; write it with `plexus pki crl {root}`") from None
    kit_dir = root / "relays" / name
    dialled = hosts[0] if hosts else "localhost"   # what the children's configs name, as for the coordinator
    _issue(
        root, registry, ca_cert, ca_key, name, "relay", None, _server_san(hosts), kit_dir, now,
        config=("relay.yaml", _relay_yaml(name, _coordinator_address(registry), _listen_address(dialled, port),
                                          _address(dialled, port))),
        extra={"address": _address(dialled, port)},   # what `pki add-site --via` writes into its children's kits
    )
    write_atomically(kit_dir / "crl.pem", crl_pem)
    return kit_dir


def revoke(root: Path, name: str, *, now: dt.datetime | None = None) -> int:
    """Revoke the active certificate issued to `name`, rebuild the CRL, return the revoked serial."""
    root = Path(root)
    now = as_utc(now)
    registry = _load_registry(root)
    entries = [e for e in registry["issued"] if e["name"] == name]
    active = [e for e in entries if not e["revoked"]]
    if not entries:
        known = sorted({e["name"] for e in registry["issued"]})
        raise errors.NotFound(f"no certificate was issued to {name!r} in {root}; issued names: {known}")
    if not active:
        raise errors.ConfigError(
            f"the certificate of {name!r} is already revoked; issue a new one with "
            f"{_ISSUE_HINT} if it should come back"
        )
    entry = active[0]
    if entry.get("kind") == "coordinator":
        raise errors.ConfigError(
            f"{name!r} is the coordinator's certificate, and revoking it would protect nothing: sites, relays and "
            "admins check the coordinator against ca.pem alone (they hold no CRL), so they would go on trusting it. "
            "If its key has leaked, make a new federation (`plexus pki init`) and install new kits everywhere; "
            "docs/certificates.md, \"Rotating the coordinator's certificate or the CA\", says how"
        )
    entry["revoked"] = True
    entry["revoked_at"] = now.isoformat()
    # CRLs first: if writing the registry then fails, a rerun revokes again instead of
    # reporting "already revoked" for a serial that no CRL lists.
    _publish_crl(root, registry, now)
    _save_registry(root, registry)
    return entry["serial"]


def reissue_crl(root: Path, *, now: dt.datetime | None = None) -> int:
    """Sign the CRL afresh (same revocations, next number, valid CRL_VALIDITY from now); return its number.

    A coordinator (or relay) refuses every call once its CRL passes nextUpdate, so run this (e.g. weekly
    from cron) and ship `root/coordinator/crl.pem` (and `root/relays/<name>/crl.pem` to each relay)."""
    root = Path(root)
    return _publish_crl(root, _load_registry(root), as_utc(now))


# ---------------------------------------------------------------------------
# Helpers


def _check_name(name: str, kind: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise errors.ConfigError(
            f"{kind} name {name!r} is invalid: use 1-63 lowercase letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )


def _check_unique(registry: dict, name: str) -> None:
    for entry in registry["issued"]:
        if entry["name"] == name and not entry["revoked"]:
            raise errors.ConfigError(
                f"a certificate for {entry['kind']} {name!r} is already issued (serial {entry['serial']}); "
                f"names are unique across the federation: revoke it first with "
                f"`plexus pki revoke DIR {name}`, or pick another name"
            )


def _check_hosts(hosts: Sequence[str]) -> list[str]:
    """`hosts` without repeats, each checked as a bare DNS name or IP address."""
    if isinstance(hosts, str):
        raise TypeError("hosts must be a sequence of host names, not a single string")
    hosts = list(dict.fromkeys(hosts))
    for host in hosts:
        _parse_host(host)
    return hosts


def _check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise errors.ConfigError(f"port {port!r} is invalid: use an integer between 1 and 65535")


def _server_san(hosts: list[str]) -> list[x509.GeneralName]:
    """The SAN of a server's certificate (the coordinator's, a relay's): the hosts it is dialled at, then
    localhost and 127.0.0.1 for a client on the same machine."""
    san: list[x509.GeneralName] = [_parse_host(h) for h in hosts]
    for extra in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))):
        if extra not in san:
            san.append(extra)
    return san


def _parse_host(host: str) -> x509.GeneralName:
    if not isinstance(host, str):
        raise TypeError(f"host must be a string, not {type(host).__name__}")
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_DNS_LABEL_RE.match(label) for label in labels):
        raise errors.ConfigError(
            f"host {host!r} is neither an IP address nor a DNS name; pass the bare name "
            "(the port goes in --port)"
        )
    return x509.DNSName(host.rstrip("."))


def _dialled_host(registry: dict) -> str:
    """The host the kits dial: the first --host given to `pki init`, localhost without one."""
    return registry["hosts"][0] if registry["hosts"] else "localhost"


def _coordinator_address(registry: dict) -> str:
    """What the kits dial: _dialled_host at the federation's port."""
    return _address(_dialled_host(registry), registry["port"])


def _relay_address(registry: dict, relay: str) -> str:
    """Where the children of relay `relay` dial it, as `pki add-relay` recorded it."""
    entries = [e for e in registry["issued"] if e["kind"] == "relay" and not e["revoked"]]
    for entry in entries:
        if entry["name"] == relay:
            if "address" not in entry:
                raise errors.ConfigError(f"relay {relay!r} was issued before relays recorded their address; set "
                                         "`coordinator:` in the site's site.yaml to its host:port by hand")
            return entry["address"]
    known = ", ".join(sorted(e["name"] for e in entries)) or "none"
    raise errors.ConfigError(f"--via {relay!r}: no relay of that name in this federation (relays: {known}); issue it "
                             "with `plexus pki add-relay DIR NAME --host HOST` first")


def _address(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if _ip_version(host) == 6 else f"{host}:{port}"


def _listen_address(host: str, port: int) -> str:
    """Where a server (the coordinator, a relay) listens so that clients dialling `host` reach it: on loopback
    when they dial a loopback host, else on every interface (the name they dial may resolve to an address this
    host cannot bind, behind NAT or a load balancer)."""
    version = _ip_version(host)
    if host.lower().rstrip(".") == "localhost" or (version and ipaddress.ip_address(host).is_loopback):
        return f"[::1]:{port}" if version == 6 else f"127.0.0.1:{port}"
    return f"[::]:{port}" if version == 6 else f"0.0.0.0:{port}"


def _ip_version(host: str) -> int:
    """4 or 6 for an IP address, 0 for a DNS name."""
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return 0


def _make_kit_dir(kit_dir: Path) -> None:
    """The kit's folder, made before its certificate is issued and recorded: a name whose kit cannot be written
    (a file in the way, no permission) is refused, not recorded as issued with no kit to show for it."""
    try:
        _make_dir(kit_dir.parent)
        _make_dir(kit_dir)
    except OSError as exc:
        raise errors.ConfigError(f"cannot make the kit folder {kit_dir} ({exc.strerror or exc}); move what is in "
                                 "the way, or fix its permissions, and run the command again") from None


def _make_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_registry(root: Path) -> dict:
    path = root / "federation.json"
    if not path.is_file() or not (root / "ca" / "ca.key").is_file():
        raise errors.ConfigError(f"{root} is not an initialised federation PKI directory; {_INIT_HINT}")
    try:
        registry = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(f"{path} is not valid JSON ({exc}); restore it from a backup") from None
    if not isinstance(registry, dict) or not {"federation", "hosts", "port", "issued"} <= registry.keys():
        raise errors.ConfigError(
            f"{path} lacks federation/hosts/port/issued; it was not written by `plexus pki init`"
        )
    return registry


def _save_registry(root: Path, registry: dict) -> None:
    text = json.dumps(registry, indent=2, sort_keys=False) + "\n"
    write_atomically(root / "federation.json", text.encode("utf-8"))


def _load_ca(root: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((root / "ca" / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((root / "ca" / "ca.key").read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise errors.ConfigError(f"{exc.filename} is missing; {_INIT_HINT}") from None
    except (ValueError, TypeError) as exc:
        raise errors.ConfigError(f"the CA in {root / 'ca'} cannot be loaded: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise errors.ConfigError(f"{root / 'ca' / 'ca.key'} does not match {root / 'ca' / 'ca.pem'}")
    return cert, key


def _issue(
    root: Path,
    registry: dict,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    name: str,
    kind: str,
    role: str | None,
    san: list[x509.GeneralName],
    kit_dir: Path,
    now: dt.datetime,
    *,
    config: tuple[str, str],
    extra: dict | None = None,
) -> None:
    """Issue a leaf cert, record it in federation.json (with `extra` in its entry), then write the kit."""
    _make_kit_dir(kit_dir)
    key, cert = _certify(registry, ca_cert, ca_key, name, kind, role, san, now)
    registry["issued"][-1].update(extra or {})
    _save_registry(root, registry)   # before the kit: every certificate that exists on disk can be revoked
    _write_kit(kit_dir, key, cert, ca_cert, config)


def _certify(registry: dict, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, kind: str,
             role: str | None, san: list[x509.GeneralName], now: dt.datetime
             ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new key and leaf certificate, recorded in `registry` (not yet saved)."""
    federation = registry["federation"]
    attrs = [
        x509.NameAttribute(NameOID.COMMON_NAME, name),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, federation),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, kind),
    ]
    if role is not None:
        attrs.append(x509.NameAttribute(NameOID.TITLE, role))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if kind in ("coordinator", "relay"):   # the servers: a relay is its children's coordinator
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    key = ec.generate_private_key(ec.SECP256R1())
    serial = x509.random_serial_number()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(min(now + LEAF_VALIDITY, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    registry["issued"].append(
        {"name": name, "kind": kind, "role": role, "serial": serial, "revoked": False, "revoked_at": None}
    )
    return key, cert


def _write_kit(kit_dir: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, ca_cert: x509.Certificate,
               config: tuple[str, str], *, sync: bool = True) -> None:
    _make_dir(kit_dir.parent)
    _make_dir(kit_dir)
    write_atomically(kit_dir / "key.pem", _key_pem(key), mode=0o600, sync=sync)
    write_atomically(kit_dir / "cert.pem", cert.public_bytes(serialization.Encoding.PEM), sync=sync)
    write_atomically(kit_dir / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM), sync=sync)
    write_atomically(kit_dir / config[0], config[1].encode("utf-8"), sync=sync)


def _build_crl(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, registry: dict, *, number: int, now: dt.datetime
) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + CRL_VALIDITY)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
    )
    for entry in registry["issued"]:
        if entry["revoked"]:
            revoked_at = dt.datetime.fromisoformat(entry["revoked_at"]) if entry.get("revoked_at") else now
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(entry["serial"])
                .revocation_date(revoked_at)
                .build()
            )
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _publish_crl(root: Path, registry: dict, now: dt.datetime) -> int:
    """Write a CRL of the registry's revocations, numbered above every CRL written before, to `root` and to
    the kit of each server (the coordinator, the relays) that checks its clients against it; return the number."""
    ca_cert, ca_key = _load_ca(root)
    number = max(_crl_number(root / "crl.pem"), _crl_number(root / COORDINATOR_NAME / "crl.pem")) + 1
    crl_pem = _build_crl(ca_cert, ca_key, registry, number=number, now=now)
    write_atomically(root / "crl.pem", crl_pem)
    for kit_dir in crl_kits(root):
        write_atomically(kit_dir / "crl.pem", crl_pem)
    return number


def crl_kits(root: Path) -> list[Path]:
    """The kit dirs under `root` that hold a copy of the CRL: the coordinator's, then each relay's."""
    root = Path(root)
    kits = [root / COORDINATOR_NAME] if (root / COORDINATOR_NAME).is_dir() else []
    relays = root / "relays"
    return kits + (sorted(p for p in relays.iterdir() if (p / "crl.pem").is_file()) if relays.is_dir() else [])


def _crl_number(path: Path) -> int:
    try:
        return crl_number(x509.load_pem_x509_crl(path.read_bytes()))
    except (FileNotFoundError, ValueError):
        return 0


def _coordinator_yaml(registry: dict) -> str:
    listen, dialled = _listen_address(_dialled_host(registry), registry["port"]), _coordinator_address(registry)
    where = ("loopback only: sites and admins on other machines cannot reach it; for them, make the federation "
             "with `plexus pki init --host` set to this machine's DNS name or IP"
             if listen.startswith(("127.", "[::1]")) else
             "every interface (firewall the port to the sites' networks, or set listen to one address)")
    return (
        "# Plexus coordinator config; relative paths are relative to this file's folder.\n"
        f"# The kits dial {dialled}; this listens on {where}.\n"
        f'listen: "{listen}"\n'
        'kit: "."\n'
        'state_dir: "./state"\n'
        'crl: "crl.pem"\n'
    )


def _site_yaml(name: str, coordinator: str, datasets: Mapping[str, Mapping[str, str]]) -> str:
    # JSON strings and objects are YAML flow scalars and mappings: every name and path is quoted safely.
    mapped = "".join(f"  {json.dumps(key)}: {json.dumps(dict(entry))}\n" for key, entry in datasets.items())
    return (
        "# Plexus site config; relative paths are relative to this file's folder.\n"
        f'site: "{name}"\n'
        f'coordinator: "{coordinator}"\n'
        'kit: "."\n'
        'state_dir: "./state"\n'
        "# Map each dataset name a job asks for (its data.dataset) to data on this machine, e.g.\n"
        "#   heart-disease: {kind: heart-disease, hospital: cleveland}\n"
        "#   registry: {kind: csv, path: /data/heart.csv, label: target}\n"
        + (f"datasets:\n{mapped}" if mapped else "datasets: {}\n") +
        "policy:\n"
        "  allowed_models: [logistic, mlp, cnn]\n"
        "  require_secure_aggregation: false\n"
    )


def _relay_yaml(name: str, parent: str, listen: str, dialled: str) -> str:
    return (
        f"# Plexus relay {name!r}: `plexus relay run --config relay.yaml`. Relative paths are relative to this\n"
        "# file's folder. To its children (sites, or relays below it) a relay is their coordinator: set\n"
        "# `coordinator:` in each child's site.yaml (`parent:` in a child relay's relay.yaml) to\n"
        f"# {dialled}, or to another host given to `plexus pki add-relay --host` (TLS refuses any other name).\n"
        "#\n"
        "# parent: the coordinator (or the relay above this one), host:port; to it this relay is one site.\n"
        f'parent: "{parent}"\n'
        "# listen: where the children dial in (mutual TLS).\n"
        f'listen: "{listen}"\n'
        "# kit: this folder (ca.pem, cert.pem, key.pem). crl: the federation CRL the children are checked\n"
        "# against; ship the newest crl.pem here after each `plexus pki revoke` or `plexus pki crl`.\n"
        'kit: "."\n'
        'crl: "crl.pem"\n'
        "# state_dir: the relay's own records (its rounds, jobs and partial sums).\n"
        'state_dir: "./state"\n'
        "# tier: the relay's round at its tier. sites_min: how many children must answer before it answers its\n"
        "# parent; deadline_s: how long it waits for them at most (less when the parent's deadline comes first).\n"
        "tier:\n"
        "  sites_min: 1\n"
        "  deadline_s: 300\n"
    )


def _admin_yaml(coordinator: str) -> str:
    return (
        "# Plexus admin CLI config; relative paths are relative to this file's folder.\n"
        f'coordinator: "{coordinator}"\n'
        'kit: "."\n'
    )
