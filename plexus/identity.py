"""What every Plexus process checks at run time: its own kit, a peer's identity and role from its verified
certificate, that the federation CA issued that certificate directly, and the CRL.

Identity is read from a verified peer certificate (CN = name, OU = kind, TITLE = admin role); a request
field is never trusted for it. Issuing certificates (offline, by the operator) is plexus.pki's.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from plexus import errors
from plexus.files import write_atomically

KINDS = ("coordinator", "relay", "site", "admin")   # a relay is its children's coordinator and its parent's site
# What issues a fresh certificate of each kind (the coordinator's: a new federation, docs/certificates.md).
_REISSUE = {"coordinator": "`plexus pki init`", "relay": "`plexus pki add-relay`", "site": "`plexus pki add-site`",
            "admin": "`plexus pki add-admin`"}
COORDINATOR_NAME = "coordinator"   # the CN of the coordinator's certificate
ROLES = ("admin", "operator", "viewer")
CRL_RENEW_BEFORE = dt.timedelta(days=7)   # a loaded CRL this close to its nextUpdate is logged as a warning
CRL_WATCH_S = 1.0   # how often a coordinator looks at its CRL file for changes (RevocationList.watch)

_KIT_FILES = ("ca.pem", "cert.pem", "key.pem")

log = logging.getLogger("plexus.pki")   # the name operators' log filters already match


@dataclass(frozen=True)
class Identity:
    """Who a certificate speaks for; `role` is set only for admins."""

    name: str
    kind: str
    role: str | None
    serial: int


@dataclass(frozen=True)
class Kit:
    """The PEM files of one participant's kit, as read from `path`."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    path: Path


def load_kit(kit_dir: Path) -> Kit:
    """Read and check a kit: files present, key private to its owner, cert issued by its CA."""
    kit_dir = Path(kit_dir)
    data = {}
    for fname in _KIT_FILES:
        path = kit_dir / fname
        try:
            data[fname] = path.read_bytes()
        except FileNotFoundError:
            raise errors.ConfigError(
                f"{path.resolve()} is missing; a kit (ca.pem, cert.pem, key.pem) is made by "
                "`plexus pki add-site DIR NAME`, `plexus pki add-relay DIR NAME --host HOST` or "
                "`plexus pki add-admin DIR NAME`"
            ) from None
    key_path = kit_dir / "key.pem"
    if os.name == "posix" and key_path.stat().st_mode & 0o077:
        raise errors.ConfigError(
            f"{key_path.resolve()} is readable by group or others; run `chmod 600 {key_path.resolve()}`"
        )
    ca = _load_cert_file(data["ca.pem"], kit_dir / "ca.pem")
    cert = _load_cert_file(data["cert.pem"], kit_dir / "cert.pem")
    try:
        key = serialization.load_pem_private_key(data["key.pem"], password=None)
    except (ValueError, TypeError) as exc:
        raise errors.ConfigError(f"{key_path.resolve()} is not an unencrypted PEM private key: {exc}") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise errors.IntegrityError(
            f"{kit_dir / 'cert.pem'} was not issued by the CA in {kit_dir / 'ca.pem'}; "
            "the kit mixes federations: issue a fresh one with `plexus pki add-site/add-relay/add-admin`"
        ) from None
    if key.public_key() != cert.public_key():
        raise errors.IntegrityError(
            f"{key_path} does not belong to {kit_dir / 'cert.pem'}; issue a fresh kit with "
            "`plexus pki add-site/add-relay/add-admin`"
        )
    return Kit(ca_pem=data["ca.pem"], cert_pem=data["cert.pem"], key_pem=data["key.pem"], path=kit_dir)


def identity_from_cert(cert_pem: bytes) -> Identity:
    """Read the identity from a certificate (PEM or DER) that TLS has already verified."""
    cert = _parse_cert(cert_pem)
    subject = cert.subject
    name = _single_attr(subject, NameOID.COMMON_NAME, "CN")
    kind = _single_attr(subject, NameOID.ORGANIZATIONAL_UNIT_NAME, "OU")
    if kind not in KINDS:
        raise errors.Unauthenticated(f"certificate of {name!r} has kind (OU) {kind!r}; expected one of {list(KINDS)}")
    role = None
    if kind == "admin":
        role = _single_attr(subject, NameOID.TITLE, "TITLE")
        if role not in ROLES:
            raise errors.Unauthenticated(f"admin certificate of {name!r} has unknown role {role!r}")
    return Identity(name=name, kind=kind, role=role, serial=cert.serial_number)


def kit_identity(kit: Kit, kind: str, fix: str) -> Identity:
    """The identity of `kit`'s certificate, which must be of `kind`: errors.ConfigError (naming the kit, the kind it
    holds and `fix`) for another's kit, which would otherwise fail only at its first peer, with a TLS error."""
    ident = identity_from_cert(kit.cert_pem)
    if ident.kind != kind:
        raise errors.ConfigError(f"{kit.path}: the kit's certificate is {ident.kind} {ident.name!r}'s; this needs a "
                                 f"{kind}'s kit: {fix}")
    return ident


def check_leaf(cert_pem: bytes, ca_pem: bytes) -> None:
    """Raise errors.Unauthenticated unless the certificate is a client leaf the federation CA issued directly.

    TLS accepts any chain that ends at the CA, so a leaf below an intermediate CA (or below a
    certificate that is itself a CA) would pass it; only the CA's own leaves identify anyone.
    """
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as exc:
        raise errors.ConfigError(f"the federation CA certificate is not a PEM certificate: {exc}") from None
    problem = _leaf_problem(_parse_cert(cert_pem), ca)
    if problem:
        raise errors.Unauthenticated(
            f"the client certificate {problem}; only certificates issued directly by this federation's CA "
            "(`plexus pki add-site` / `add-relay` / `add-admin`) identify a participant")


def federation_of(cert_pem: bytes) -> str:
    """The federation name (subject O) a certificate was issued for."""
    return _single_attr(_parse_cert(cert_pem).subject, NameOID.ORGANIZATION_NAME, "O")


def revoked_error(who: str, serial: int) -> errors.Unauthenticated:
    """The refusal of a revoked certificate (`who`: "site 'b'")."""
    return errors.Unauthenticated(f"certificate of {who} (serial {serial}) has been revoked; ask the federation "
                                  "operator for a new kit")


class RevocationList:
    """A CA-verified CRL that reloads itself when its file changes; `check` raises on revoked certs,
    `revoked` answers for a serial.

    Fails closed: if the file is replaced by one that is missing, unsigned, from another CA,
    older (a lower CRL number) or expired (past its nextUpdate), both raise instead of
    trusting a stale list silently. With `floor_file`, the highest CRL number ever loaded is
    kept there, so an old CRL put back while the coordinator was down is refused at restart.
    """

    def __init__(self, crl_path: Path, ca_pem: bytes, *, on_revoked=None, floor_file: Path | None = None,
                 clock=time.time):
        self._path = Path(crl_path)
        self.ca_pem = ca_pem   # the federation CA, whose direct leaves alone identify a peer (check_leaf)
        try:
            self._ca = x509.load_pem_x509_certificate(ca_pem)
        except (ValueError, TypeError) as exc:
            raise errors.ConfigError(f"the CA certificate given for the CRL is not a PEM certificate: {exc}") from None
        self._lock = threading.Lock()
        self._floor_file = None if floor_file is None else Path(floor_file)
        self._clock = clock
        self._number = self._read_floor()
        if not self._path.exists():
            raise errors.ConfigError(
                f"CRL {self._path} does not exist; copy crl.pem from the federation's PKI directory "
                "(made by `plexus pki init`)"
            )
        self._on_revoked = on_revoked  # called with the serials a reload newly finds revoked
        self._state = self._load()

    def check(self, cert_pem: bytes) -> None:
        """Raise errors.Unauthenticated if the certificate's serial is on the CRL."""
        cert = _parse_cert(cert_pem)
        if cert.serial_number in self._current():
            try:
                ident = identity_from_cert(cert_pem)
                who = f"{ident.kind} {ident.name!r}"
            except errors.Unauthenticated:
                who = "an unknown participant"
            raise revoked_error(who, cert.serial_number)

    def watch(self, stop: threading.Event, every_s: float = CRL_WATCH_S) -> None:
        """Reload the file whenever it changes (on_revoked then hears of new revocations at once, not at the next
        call that checks a certificate), until `stop` is set. A CRL that cannot be trusted is logged when it
        turns so; the calls' checks refuse everything meanwhile (fail closed)."""
        problem = ""
        while not stop.wait(every_s):
            try:
                self._current()
                problem = ""
            except (errors.PlexusError, OSError) as exc:   # the watch goes on: a fixed file is noticed too
                if str(exc) != problem:
                    log.error("%s", exc)
                problem = str(exc)

    def revoked(self, serial: int) -> bool:
        """Whether `serial` is on the CRL, reloading a changed file first. Fails closed as `check` does: a
        CRL that is gone, unverifiable, older or expired raises instead of answering."""
        return serial in self._current()

    def _current(self) -> frozenset[int]:
        """The revoked serials of the file as it is now, or raise (see the class docstring)."""
        # One tuple, swapped in one assignment, so a reader never pairs a new stat key with old serials.
        key, revoked, expires = self._state
        if self._stat() != key:
            newly: list[int] = []
            with self._lock:
                if self._stat() != self._state[0]:
                    before = self._state[1]
                    self._state = self._load()
                    newly = sorted(self._state[1] - before)
            if newly and self._on_revoked is not None:
                self._on_revoked(newly)   # outside the lock: the callback may take others' (the engine's)
            key, revoked, expires = self._state
        if self._clock() >= expires:
            raise errors.IntegrityError(self._expired_message(expires))
        return revoked

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            raise errors.ConfigError(f"CRL {self._path} has disappeared; restore it from the PKI directory") from None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self) -> tuple[tuple[int, int, int], frozenset[int], float]:
        key = self._stat()
        data = self._path.read_bytes()
        try:
            if data.lstrip().startswith(b"-----BEGIN"):
                crl = x509.load_pem_x509_crl(data)
            else:
                crl = x509.load_der_x509_crl(data)
        except ValueError as exc:
            raise errors.IntegrityError(f"CRL {self._path} cannot be parsed: {exc}") from None
        if crl.issuer != self._ca.subject or not crl.is_signature_valid(self._ca.public_key()):
            raise errors.IntegrityError(
                f"CRL {self._path} fails verification against this federation's CA (tampered, or "
                "from another federation); copy the crl.pem written by `plexus pki revoke` for this federation"
            )
        number = crl_number(crl)
        if number < self._number:
            where = f" (recorded in {self._floor_file})" if self._floor_file is not None else ""
            raise errors.IntegrityError(
                f"CRL {self._path} has number {number}, older than number {self._number} already loaded{where}; "
                f"an old CRL would un-revoke certificates: ship the latest DIR/coordinator/crl.pem, or "
                f"re-issue one with `plexus pki crl DIR`"
            )
        if crl.next_update_utc is None:
            raise errors.IntegrityError(
                f"CRL {self._path} has no nextUpdate, so its age cannot be checked; re-issue it with "
                "`plexus pki crl DIR`"
            )
        expires = crl.next_update_utc.timestamp()
        if self._clock() >= expires:
            raise errors.IntegrityError(self._expired_message(expires))
        if number > self._number and self._floor_file is not None:
            write_atomically(self._floor_file, f"{number}\n".encode(), mode=0o600)   # before it is trusted
        self._number = number
        if expires - self._clock() < CRL_RENEW_BEFORE.total_seconds():
            log.warning("CRL %s expires at %s; re-issue it before then with `plexus pki crl DIR` and ship "
                        "DIR/coordinator/crl.pem, or every call will be refused", self._path,
                        crl.next_update_utc.isoformat())
        return key, frozenset(r.serial_number for r in crl), expires

    def _read_floor(self) -> int:
        if self._floor_file is None or not self._floor_file.exists():
            return 0
        text = self._floor_file.read_text(encoding="ascii", errors="replace").strip()
        if not text.isdigit():
            raise errors.IntegrityError(
                f"{self._floor_file} should hold the highest CRL number this coordinator loaded, but holds "
                f"{text[:40]!r}; restore it from a backup, or delete it once you have checked that the CRL "
                f"in place is the latest DIR/coordinator/crl.pem")
        return int(text)

    def _expired_message(self, expires: float) -> str:
        when = dt.datetime.fromtimestamp(expires, dt.timezone.utc).isoformat()
        return (f"CRL {self._path} expired at {when} (its nextUpdate); an expired CRL may miss revocations, so "
                f"every call is refused: re-issue it with `plexus pki crl DIR` and ship DIR/coordinator/crl.pem")


def verify_issued(cert_pem: bytes, ca_pem: bytes, *, name: str, kind: str, now: dt.datetime | None = None) -> None:
    """Raise errors.IntegrityError unless `cert_pem` was signed by `ca_pem`, is valid `now`, and names `kind` `name`.

    For certificates that did not come through TLS (e.g. relayed secure-aggregation adverts).
    Revocation is not checked here: use RevocationList.check as well where a CRL is at hand.
    """
    now = as_utc(now)
    try:
        cert = _parse_cert(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
    except (errors.Unauthenticated, ValueError):
        raise errors.IntegrityError(
            f"the certificate presented for {kind} {name!r} (or the CA) cannot be parsed") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise errors.IntegrityError(
            f"the certificate presented for {kind} {name!r} was not issued by this federation's CA"
        ) from None
    problem = _usage_problem(cert)
    if problem:
        raise errors.IntegrityError(f"the certificate presented for {kind} {name!r} {problem}")
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise errors.IntegrityError(
            f"the certificate presented for {kind} {name!r} is not valid at {now.isoformat()} "
            f"(valid {cert.not_valid_before_utc.isoformat()} to {cert.not_valid_after_utc.isoformat()}); "
            f"issue a fresh kit with {_REISSUE.get(kind, '`plexus pki`')}"
        )
    try:
        ident = identity_from_cert(cert_pem)
    except errors.Unauthenticated as exc:
        raise errors.IntegrityError(
            f"the certificate presented for {kind} {name!r} has no valid identity: {exc}") from None
    if ident.name != name or ident.kind != kind:
        raise errors.IntegrityError(
            f"the certificate presented for {kind} {name!r} belongs to {ident.kind} {ident.name!r}"
        )


# ---------------------------------------------------------------------------
# Helpers


def as_utc(now: dt.datetime | None) -> dt.datetime:
    """`now` as an aware UTC datetime (the current time when None); naive datetimes are refused."""
    if now is None:
        return dt.datetime.now(dt.timezone.utc)
    if not isinstance(now, dt.datetime):
        raise TypeError(f"now must be a datetime, not {type(now).__name__}")
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware, e.g. datetime.now(timezone.utc)")
    return now.astimezone(dt.timezone.utc)


def _leaf_problem(cert: x509.Certificate, ca: x509.Certificate) -> str:
    """What disqualifies `cert` as a client leaf issued directly by `ca`, or "" when nothing does."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "was not issued directly by the federation CA (an intermediate or another issuer signed it)"
    return _usage_problem(cert)


def _usage_problem(cert: x509.Certificate) -> str:
    """What disqualifies `cert` as a client leaf (CA:FALSE, digitalSignature only, clientAuth), or ""."""
    extensions = cert.extensions
    try:
        if extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return "is a CA certificate (basicConstraints CA:TRUE), not a leaf"
        usage = extensions.get_extension_for_class(x509.KeyUsage).value
        client = ExtendedKeyUsageOID.CLIENT_AUTH in extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return "lacks basicConstraints, keyUsage or extendedKeyUsage, which every Plexus certificate carries"
    except ValueError:
        return "has extensions that cannot be parsed"
    if not usage.digital_signature or usage.key_cert_sign or usage.crl_sign:
        return "has a key usage other than digitalSignature alone (it may sign certificates or CRLs)"
    if not client:
        return "is not for client authentication (extendedKeyUsage lacks clientAuth)"
    return ""


def crl_number(crl: x509.CertificateRevocationList) -> int:
    """The CRL's number extension, 0 when it has none."""
    try:
        return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        return 0


def _parse_cert(cert_pem: bytes) -> x509.Certificate:
    if not isinstance(cert_pem, (bytes, bytearray, memoryview)):
        raise TypeError(f"certificate must be bytes, not {type(cert_pem).__name__}")
    data = bytes(cert_pem)
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError:
        raise errors.Unauthenticated("the peer certificate cannot be parsed") from None


def _load_cert_file(data: bytes, path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise errors.ConfigError(f"{path} is not a PEM certificate: {exc}") from None


def _single_attr(subject: x509.Name, oid: x509.ObjectIdentifier, label: str) -> str:
    attrs = subject.get_attributes_for_oid(oid)
    if len(attrs) != 1 or not isinstance(attrs[0].value, str):
        raise errors.Unauthenticated(
            f"certificate subject must hold exactly one {label}; got {subject.rfc4514_string()}")
    return attrs[0].value
