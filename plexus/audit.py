"""An append-only, hash-chained audit log in its own SQLite file.

Each entry's hash is SHA-256 over the canonical JSON of (seq, at, actor, action,
subject, details, prev_hash), so editing, deleting or reordering an entry breaks
the chain; a separate head record (last seq and hash), written in the same
transaction as each entry, catches a removed tail. Anyone who can write the
file can still rebuild a consistent chain from scratch, so a log given a signer
(the coordinator's kit) signs its head every `anchor_every` entries and on
`anchor()`: a SignedHead kept outside the coordinator (`plexus audit
--export-head`) pins every entry up to its seq, and `verify_against` finds a
log cut short of it or rewritten below it.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from plexus import crypto, errors, identity
from plexus.errors import IntegrityError

GENESIS = "0" * 64
ANCHOR_EVERY = 100                     # entries between signed heads stored in the log itself
HEAD_FORMAT = "plexus-audit-head/1"
_HEAD_PURPOSE = "plexus/v1/audit-head"  # signed with the head, so the signature means nothing else

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY, at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
    subject TEXT NOT NULL, details TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS head (
    id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, hash TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS anchors (
    seq INTEGER PRIMARY KEY, hash TEXT NOT NULL, at REAL NOT NULL, signature BLOB NOT NULL, cert TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Entry:
    """One audit record; `hash` chains it to the entry before."""

    seq: int
    at: float
    actor: str
    action: str
    subject: str
    details: dict = field(default_factory=dict)
    prev_hash: str = GENESIS
    hash: str = ""

    def computed_hash(self, seq: int | None = None) -> str:
        """The hash this entry's contents give (at position `seq`, by default its own)."""
        body = [self.seq if seq is None else seq, self.at, self.actor, self.action, self.subject, self.details,
                self.prev_hash]
        return hashlib.sha256(_canonical(body).encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"seq": self.seq, "at": self.at, "actor": self.actor, "action": self.action, "subject": self.subject,
                "details": self.details, "prev_hash": self.prev_hash, "hash": self.hash}


@dataclass(frozen=True)
class SignedHead:
    """The chain's head (seq, hash) signed at `at` by the certificate's key; kept elsewhere, it pins the log."""

    seq: int
    hash: str
    at: float
    signature: bytes
    cert_pem: bytes

    @classmethod
    def sign(cls, seq: int, hash_: str, at: float, signer: tuple[bytes, bytes]) -> SignedHead:
        key_pem, cert_pem = signer
        unsigned = cls(seq, hash_, at, b"", cert_pem)
        return dataclasses.replace(unsigned, signature=crypto.sign(key_pem, unsigned.message()))

    def message(self) -> bytes:
        return _canonical([_HEAD_PURPOSE, self.seq, self.hash, self.at]).encode()

    def verify(self, ca_pem: bytes) -> None:
        """Raise IntegrityError unless the federation's coordinator, or one of its relays (whose own log it is),
        signed exactly this head."""
        when = dt.datetime.fromtimestamp(self.at, dt.timezone.utc)
        try:
            signer = identity.identity_from_cert(self.cert_pem)
        except errors.PlexusError:
            signer = None
        if signer is not None and signer.kind == "relay":
            identity.verify_issued(self.cert_pem, ca_pem, name=signer.name, kind="relay", now=when)
        else:
            identity.verify_issued(self.cert_pem, ca_pem, name=identity.COORDINATOR_NAME, kind="coordinator",
                                   now=when)
        crypto.verify(self.cert_pem, self.message(), self.signature)

    def to_json(self) -> str:
        return json.dumps({"format": HEAD_FORMAT, "seq": self.seq, "hash": self.hash, "at": self.at,
                           "signature": base64.b64encode(self.signature).decode(),
                           "signer_cert": self.cert_pem.decode()}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "signed head") -> SignedHead:
        try:
            doc = json.loads(text)
            if doc.get("format") != HEAD_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, not {HEAD_FORMAT!r}")
            head = cls(int(doc["seq"]), str(doc["hash"]), float(doc["at"]), base64.b64decode(doc["signature"]),
                       str(doc["signer_cert"]).encode())
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise IntegrityError(f"{source} is not a signed audit head written by `plexus audit --export-head` "
                                 f"({type(exc).__name__}: {exc})") from None
        return head


class AuditLog:
    """The hash-chained log at `path` (created if missing); thread-safe, and other processes' writers serialise.

    With `signer` = (key PEM, certificate PEM), the head is signed every `anchor_every` entries and on
    `anchor()`, and the signed heads are kept in the log (checked by verify)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time,
                 signer: tuple[bytes, bytes] | None = None, anchor_every: int = ANCHOR_EVERY) -> None:
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be at least 1, not {anchor_every}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.clock = clock
        self._signer, self._anchor_every = signer, anchor_every
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # an audit entry, once returned, survives a power cut
            self._db.executescript(_SCHEMA)
        except sqlite3.OperationalError:   # locked or unreadable: not a damaged file
            self._db.close()
            raise
        except sqlite3.DatabaseError as exc:   # not a database at all, or a malformed page
            self._db.close()
            raise IntegrityError(f"the audit log {self.path} is damaged ({exc}); restore it from a backup "
                                 "(docs/backup-restore.md): the log is hash-chained, so a damaged one cannot be "
                                 "mended in place") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, actor: str, action: str, subject: str = "", details: dict | None = None) -> Entry:
        """Record one action; returns the entry as stored."""
        for name, value in (("actor", actor), ("action", action), ("subject", subject)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not actor or not action:
            raise ValueError("an audit entry needs a non-empty actor and action")
        details = {} if details is None else details
        if not isinstance(details, dict):
            raise TypeError(f"details must be a dict, not {type(details).__name__}")
        details = json.loads(_canonical(details))  # fails early on values JSON cannot hold; stored as read back
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT seq, hash FROM head WHERE id = 1").fetchone()
                seq, prev = (row[0] + 1, row[1]) if row else (1, GENESIS)
                entry = Entry(seq, float(self.clock()), actor, action, subject, details, prev)
                entry = dataclasses.replace(entry, hash=entry.computed_hash())
                self._db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                 (entry.seq, entry.at, actor, action, subject, _canonical(details), prev, entry.hash))
                self._db.execute("INSERT OR REPLACE INTO head (id, seq, hash) VALUES (1, ?, ?)", (seq, entry.hash))
                if self._signer is not None and seq % self._anchor_every == 0:
                    self._store_anchor(SignedHead.sign(seq, entry.hash, entry.at, self._signer))
                self._db.execute("COMMIT")   # fails on a full disk too: roll back, so appends work once there is space
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        return entry

    def anchor(self) -> SignedHead:
        """Sign the current head now (at shutdown, and for `plexus audit --export-head`), keep it, return it."""
        if self._signer is None:
            raise IntegrityError(f"audit log {self.path} has no signing key; only the coordinator's log signs heads")
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT seq, hash FROM head WHERE id = 1").fetchone()
                seq, hash_ = row if row else (0, GENESIS)
                head = SignedHead.sign(seq, hash_, float(self.clock()), self._signer)
                self._store_anchor(head)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        return head

    def _store_anchor(self, head: SignedHead) -> None:
        """Keep a signed head (the first one signed at its seq); call inside a write transaction."""
        self._db.execute("INSERT OR IGNORE INTO anchors VALUES (?, ?, ?, ?, ?)",
                         (head.seq, head.hash, head.at, head.signature, head.cert_pem.decode()))

    def entries(self, *, limit: int | None = None) -> list[Entry]:
        """All entries in seq order, or the last `limit` of them."""
        sql = "SELECT seq, at, actor, action, subject, details, prev_hash, hash FROM entries"
        with self._lock:
            if limit:
                rows = self._db.execute(f"SELECT * FROM ({sql} ORDER BY seq DESC LIMIT ?) ORDER BY seq",
                                        (int(limit),)).fetchall()
            else:
                rows = self._db.execute(f"{sql} ORDER BY seq").fetchall()
        return [_entry(row) for row in rows]

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last entry as the head record states it; (0, GENESIS) when empty."""
        with self._lock:
            row = self._db.execute("SELECT seq, hash FROM head WHERE id = 1").fetchone()
        return (row[0], row[1]) if row else (0, GENESIS)

    def verify(self) -> int:
        """Check the whole chain; returns the entry count, raises IntegrityError naming the first bad seq."""
        with self._lock:  # one read transaction: entries and head from the same snapshot
            self._db.execute("BEGIN")
            try:
                rows = self._db.execute("SELECT seq, at, actor, action, subject, details, prev_hash, hash"
                                        " FROM entries ORDER BY seq").fetchall()
                head = self._db.execute("SELECT seq, hash FROM head WHERE id = 1").fetchone()
                anchors = self._db.execute("SELECT seq, hash, at, signature, cert FROM anchors ORDER BY seq").fetchall()
            finally:
                self._db.execute("COMMIT")
        entries = [_entry(row) for row in rows]
        _check_chain(entries)
        _check_head(entries, head)
        for seq, hash_, at, signature, cert in anchors:
            anchor = SignedHead(seq, hash_, at, bytes(signature), cert.encode())
            try:
                crypto.verify(anchor.cert_pem, anchor.message(), anchor.signature)
            except IntegrityError:
                raise IntegrityError(f"the signed head kept for audit entry {seq} fails its signature check "
                                     "(it was edited)") from None
            _check_anchored(entries, anchor, "a signed head kept in the log")
        return len(entries)


def verify_against(entries: list[Entry], head: SignedHead, ca_pem: bytes) -> None:
    """Check that `entries` (the whole log, as read back) chain intact and hold the head the federation's
    coordinator signed: not cut short of it, not rewritten up to it. Raises IntegrityError naming what."""
    head.verify(ca_pem)
    _check_chain(entries)
    _check_anchored(entries, head, "the signed head")


def _check_anchored(entries: list[Entry], head: SignedHead, what: str) -> None:
    signed = dt.datetime.fromtimestamp(head.at, dt.timezone.utc).isoformat(timespec="seconds")
    last = entries[-1].seq if entries else 0
    if head.seq > last:
        raise IntegrityError(f"audit log was truncated: {what} of {signed} covers entries 1..{head.seq}, "
                             f"the log now ends at seq {last}")
    if head.seq and entries[head.seq - 1].hash != head.hash:
        raise IntegrityError(f"audit log was rewritten: entry {head.seq} is not the one {what} of {signed} "
                             f"covers (entries up to {head.seq} were changed and re-chained)")


def _check_chain(entries: list[Entry]) -> None:
    prev_hash = GENESIS
    for expected, entry in enumerate(entries, start=1):
        if entry.seq != expected:
            missing = (f"entry {expected} was" if entry.seq == expected + 1
                       else f"entries {expected}..{entry.seq - 1} were")
            raise IntegrityError(f"audit {missing} deleted: the log jumps from seq {expected - 1} to seq {entry.seq}")
        if entry.computed_hash() != entry.hash:
            # Intact contents under another seq: the entry was moved, not edited.
            written = next((s for s in range(1, entries[-1].seq + 1)
                            if s != entry.seq and entry.computed_hash(s) == entry.hash), None)
            if written is not None:
                raise IntegrityError(f"audit entry {entry.seq} is out of order: it was written as seq {written} "
                                     "(entries were reordered)")
            raise IntegrityError(f"audit entry {entry.seq} was edited: its contents no longer match its hash")
        if entry.prev_hash != prev_hash:
            raise IntegrityError(f"audit entry {entry.seq} does not follow entry {expected - 1}: its prev_hash "
                                 "does not match (an entry before it was replaced or inserted)")
        prev_hash = entry.hash


def _check_head(entries: list[Entry], head: tuple[int, str] | None) -> None:
    last_seq, last_hash = (entries[-1].seq, entries[-1].hash) if entries else (0, GENESIS)
    if head is None:
        if entries:
            raise IntegrityError(f"audit log head record is missing, but the log has {last_seq} entries; "
                                 "the head was deleted")
        return
    head_seq, head_hash = head
    if head_seq > last_seq:
        missing = f"entry {head_seq} is" if head_seq == last_seq + 1 else f"entries {last_seq + 1}..{head_seq} are"
        raise IntegrityError(f"audit log was truncated: {missing} missing "
                             f"(the head record says the log ends at seq {head_seq}, it ends at seq {last_seq})")
    if head_seq != last_seq or head_hash != last_hash:
        raise IntegrityError(f"audit log head mismatch at seq {last_seq}: the head record says "
                             f"(seq {head_seq}, {head_hash[:16]}…), the last entry is (seq {last_seq}, "
                             f"{last_hash[:16]}…)")


def _entry(row: tuple) -> Entry:
    seq, at, actor, action, subject, details, prev_hash, hash_ = row
    try:
        parsed = json.loads(details)
    except (ValueError, TypeError):
        raise IntegrityError(f"audit entry {seq} was edited: its details are not valid JSON") from None
    return Entry(seq, at, actor, action, subject, parsed, prev_hash, hash_)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
