"""An append-only, hash-chained audit log in its own SQLite file.

Each entry's hash is SHA-256 over the canonical JSON of (seq, at, actor, action,
subject, details, prev_hash), so editing, deleting or reordering an entry breaks
the chain; a separate head record (last seq and hash), written in the same
transaction as each entry, catches a removed tail. Anyone who can write the
file can still rebuild a consistent chain from scratch: compare `head()` with a
copy kept elsewhere to rule that out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from plexus.errors import IntegrityError

GENESIS = "0" * 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY, at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
    subject TEXT NOT NULL, details TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS head (
    id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, hash TEXT NOT NULL);
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


class AuditLog:
    """The hash-chained log at `path` (created if missing); thread-safe, and other processes' writers serialise."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # an audit entry, once returned, survives a power cut
        self._db.executescript(_SCHEMA)

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
                self._db.execute("COMMIT")   # fails on a full disk too: roll back, so appends work once there is space
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        return entry

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
            finally:
                self._db.execute("COMMIT")
        entries = [_entry(row) for row in rows]
        _check_chain(entries)
        _check_head(entries, head)
        return len(entries)


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
