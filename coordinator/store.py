"""The coordinator's durable state: SQLite (WAL) plus one safetensors checkpoint per closed round."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from plexus.errors import IntegrityError, NotFound
from plexus.files import write_atomically, write_blocks
from plexus.wire import Layout, Receiver, encode

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, config_yaml TEXT NOT NULL, strategy TEXT NOT NULL,
    status TEXT NOT NULL, rounds INTEGER NOT NULL, current_round INTEGER NOT NULL DEFAULT 0,
    message TEXT NOT NULL DEFAULT '', submitted_by TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
    opened REAL NOT NULL, closed REAL, total_samples INTEGER NOT NULL DEFAULT 0,
    contributors TEXT NOT NULL DEFAULT '[]', message TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (job_id, round));
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL,
    kind TEXT NOT NULL, nonce BLOB NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
    issued REAL NOT NULL, finished REAL);
CREATE INDEX IF NOT EXISTS tasks_by_round ON tasks (job_id, round, site);
CREATE TABLE IF NOT EXISTS declines (
    job_id TEXT NOT NULL, site TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (job_id, site));
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL, kind TEXT NOT NULL,
    name TEXT NOT NULL, value REAL NOT NULL, PRIMARY KEY (job_id, round, site, kind, name));
CREATE TABLE IF NOT EXISTS sites (
    name TEXT PRIMARY KEY, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    agent_version TEXT NOT NULL DEFAULT '', policy_digest TEXT NOT NULL DEFAULT '',
    models TEXT NOT NULL DEFAULT '[]', datasets TEXT NOT NULL DEFAULT '[]');
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, at REAL NOT NULL, kind TEXT NOT NULL,
    round INTEGER NOT NULL DEFAULT 0, site TEXT NOT NULL DEFAULT '', message TEXT NOT NULL DEFAULT '');
"""

TERMINAL = ("completed", "budget_reached", "failed", "aborted")


@dataclass(frozen=True)
class JobRow:
    id: str
    name: str
    config_yaml: str
    strategy: str
    status: str
    rounds: int
    current_round: int
    message: str
    submitted_by: str
    created: float
    updated: float


class Store:
    """All SQL lives here; callers get rows and plain values back. Thread-safe."""

    def __init__(self, state_dir: Path, *, clock=time.time):
        self.state_dir = Path(state_dir)
        self.checkpoints = self.state_dir / "checkpoints"
        self.spool = self.state_dir / "spool"
        for d in (self.state_dir, self.checkpoints, self.spool):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        for leftover in [*self.spool.glob("*.part"), *self.spool.glob("*.held")]:  # half-received updates of a crashed run are void
            leftover.unlink()
        self.clock = clock
        self._listeners: list = []
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.state_dir / "plexus.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def subscribe(self, listener) -> None:
        """Call listener(event) after each committed event; event = (job_id, kind, round, site, message).

        For observers (metrics, audit): a listener that raises is logged and never breaks the caller.
        """
        self._listeners.append(listener)

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        for sql, args in statements:
            if sql.startswith("INSERT INTO events"):
                job_id, _, kind, round_, site, message = args
                for listener in self._listeners:
                    try:
                        listener((job_id, kind, round_, site, message))
                    except Exception:
                        logging.getLogger("plexus.store").exception("event listener failed")

    def _all(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # jobs -------------------------------------------------------------------------------
    def add_job(self, job_id: str, name: str, config_yaml: str, strategy: str, rounds: int, who: str) -> None:
        now = self.clock()
        self._tx([("INSERT INTO jobs (id, name, config_yaml, strategy, status, rounds, submitted_by, created, updated)"
                   " VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?)", (job_id, name, config_yaml, strategy, rounds, who, now, now)),
                  self._event_sql(job_id, "job_submitted", 0, "", f"submitted by {who}")])

    def job(self, job_id: str) -> JobRow:
        rows = self._all("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise NotFound(f"no job {job_id!r}; `plexus job list` shows the jobs this coordinator knows")
        return JobRow(*rows[0])

    def jobs(self) -> list[JobRow]:
        return [JobRow(*r) for r in self._all("SELECT * FROM jobs ORDER BY created, id")]

    def set_job(self, job_id: str, *, status: str | None = None, current_round: int | None = None,
                message: str | None = None, event: tuple[str, int, str, str] | None = None) -> None:
        sets, args = ["updated = ?"], [self.clock()]
        for column, value in (("status", status), ("current_round", current_round), ("message", message)):
            if value is not None:
                sets.append(f"{column} = ?")
                args.append(value)
        statements = [(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))]
        if event:
            statements.append(self._event_sql(job_id, *event))
        self._tx(statements)

    # rounds and tasks --------------------------------------------------------------------
    def open_round(self, job_id: str, round_: int, kind: str) -> None:
        self._tx([("DELETE FROM rounds WHERE job_id = ? AND round = ?", (job_id, round_)),
                  ("UPDATE tasks SET status = 'stale' WHERE job_id = ? AND round = ? AND status = 'issued'",
                   (job_id, round_)),
                  ("INSERT INTO rounds (job_id, round, kind, status, opened) VALUES (?, ?, ?, 'open', ?)",
                   (job_id, round_, kind, self.clock())),
                  self._event_sql(job_id, "round_opened", round_, "", kind)])

    def close_round(self, job_id: str, round_: int, *, status: str, contributors: list[str], total_samples: int,
                    message: str, job_update: dict | None = None, event: tuple[str, str] | None = None) -> None:
        """Close a round, and in the same transaction move the job on (its current round, status)."""
        statements = [
            ("UPDATE rounds SET status = ?, closed = ?, contributors = ?, total_samples = ?, message = ?"
             " WHERE job_id = ? AND round = ?",
             (status, self.clock(), json.dumps(contributors), total_samples, message, job_id, round_)),
            ("UPDATE tasks SET status = 'late', finished = ? WHERE job_id = ? AND round = ? AND status = 'issued'",
             (self.clock(), job_id, round_)),
        ]
        if job_update:
            cols = ", ".join(f"{k} = ?" for k in job_update)
            statements.append((f"UPDATE jobs SET {cols}, updated = ? WHERE id = ?",
                               (*job_update.values(), self.clock(), job_id)))
        kind, text = event or (f"round_{status}", message)
        statements.append(self._event_sql(job_id, kind, round_, "", text))
        self._tx(statements)

    def interrupt_open_rounds(self) -> None:
        """After a restart: rounds that were open are void and their tasks can no longer be answered."""
        self._tx([("UPDATE tasks SET status = 'stale' WHERE status = 'issued'", ()),
                  ("UPDATE rounds SET status = 'interrupted', closed = ? WHERE status = 'open'", (self.clock(),))])

    def rounds(self, job_id: str) -> list[tuple]:
        return self._all("SELECT round, kind, status, opened, closed, contributors, total_samples, message"
                         " FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))

    def add_task(self, task_id: str, job_id: str, round_: int, site: str, kind: str, nonce: bytes) -> None:
        self._tx([("INSERT INTO tasks (task_id, job_id, round, site, kind, nonce, status, issued)"
                   " VALUES (?, ?, ?, ?, ?, ?, 'issued', ?)", (task_id, job_id, round_, site, kind, nonce, self.clock()))])

    def task(self, task_id: str) -> tuple | None:
        rows = self._all("SELECT task_id, job_id, round, site, kind, nonce, status FROM tasks WHERE task_id = ?",
                         (task_id,))
        return rows[0] if rows else None

    def finish_task(self, task_id: str, status: str, reason: str = "", *, job_id: str = "", round_: int = 0,
                    site: str = "", metrics: Mapping[tuple[int, str, str], float] | None = None) -> None:
        """Record a task's outcome, its metrics and an event, atomically."""
        statements = [("UPDATE tasks SET status = ?, reason = ?, finished = ? WHERE task_id = ?",
                       (status, reason, self.clock(), task_id))]
        for (round_key, kind, name), value in (metrics or {}).items():
            statements.append(("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?, ?)",
                               (job_id, round_key, site, kind, name, float(value))))
        statements.append(self._event_sql(job_id, f"site_{status}", round_, site, reason))
        self._tx(statements)

    def record_metrics(self, job_id: str, metrics: Mapping[tuple[int, str, str, str], float]) -> None:
        """Job-level metrics (site "" for the federation as a whole), e.g. the privacy ledger's ε."""
        self._tx([("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?, ?)",
                   (job_id, round_, site, kind, name, float(value)))
                  for (round_, site, kind, name), value in metrics.items()])

    def job_sites(self, job_id: str) -> set[str]:
        """Every site that was given a task of the job, whatever became of it."""
        return {site for (site,) in self._all("SELECT DISTINCT site FROM tasks WHERE job_id = ?", (job_id,))}

    def site_events(self, job_id: str) -> list[tuple]:
        return self._all("SELECT site, status, round, reason FROM tasks WHERE job_id = ?"
                         " AND status NOT IN ('issued', 'stale') ORDER BY round, site", (job_id,))

    def decline(self, job_id: str, site: str, reason: str) -> None:
        self._tx([("INSERT OR REPLACE INTO declines VALUES (?, ?, ?, ?)", (job_id, site, reason, self.clock()))])

    def declines(self, job_id: str) -> dict[str, str]:
        return dict(self._all("SELECT site, reason FROM declines WHERE job_id = ?", (job_id,)))

    def metrics(self, job_id: str) -> list[tuple]:
        return self._all("SELECT round, site, kind, name, value FROM metrics WHERE job_id = ?"
                         " ORDER BY round, site, kind, name", (job_id,))

    # sites and events --------------------------------------------------------------------
    def site_seen(self, name: str, **info) -> None:
        now = self.clock()
        with self._lock:
            self._db.execute("INSERT INTO sites (name, first_seen, last_seen) VALUES (?, ?, ?)"
                             " ON CONFLICT(name) DO UPDATE SET last_seen = excluded.last_seen", (name, now, now))
            if info:
                self._db.execute(
                    "UPDATE sites SET agent_version = ?, policy_digest = ?, models = ?, datasets = ? WHERE name = ?",
                    (info["agent_version"], info["policy_digest"], json.dumps(info["models"]),
                     json.dumps(info["datasets"]), name))

    def sites(self) -> list[tuple]:
        return self._all("SELECT name, last_seen, agent_version, policy_digest, models, datasets FROM sites"
                         " ORDER BY name")

    def event(self, job_id: str, kind: str, round_: int = 0, site: str = "", message: str = "") -> None:
        self._tx([self._event_sql(job_id, kind, round_, site, message)])

    def events_after(self, job_id: str, after_id: int) -> list[tuple]:
        return self._all("SELECT id, at, kind, round, site, message FROM events WHERE job_id = ? AND id > ?"
                         " ORDER BY id", (job_id, after_id))

    def _event_sql(self, job_id: str, kind: str, round_: int, site: str, message: str) -> tuple[str, tuple]:
        return ("INSERT INTO events (job_id, at, kind, round, site, message) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, self.clock(), kind, round_, site, message))

    # checkpoints -------------------------------------------------------------------------
    def checkpoint_path(self, job_id: str, round_: int) -> Path:
        return self.checkpoints / job_id / f"{round_}.safetensors"

    def save_checkpoint(self, job_id: str, round_: int, state: Mapping[str, np.ndarray]) -> Path:
        """Write atomically: a crash leaves either the old file or the complete new one."""
        layout, blob = encode({k: np.asarray(v) for k, v in state.items()})
        return self.save_checkpoint_blob(job_id, round_, layout, blob)

    def save_checkpoint_blob(self, job_id: str, round_: int, layout: Layout, blob) -> Path:
        """A safetensors file whose data section is exactly the wire blob (bytes-like, or an iterator of its
        consecutive blocks): no serialising copy of the model."""
        return self._write_safetensors(self.checkpoint_path(job_id, round_), layout, blob,
                                       {"job": job_id, "round": str(round_)})

    def strategy_state_path(self, job_id: str, round_: int) -> Path:
        return self.checkpoints / job_id / f"{round_}.strategy.safetensors"

    def save_strategy_state(self, job_id: str, round_: int, arrays: Mapping[str, np.ndarray], meta: dict) -> Path:
        """The strategy's state after a round (server optimizer moments, control variates, schedule),
        written before the round is marked closed so a restart resumes the strategy exactly."""
        layout, blob = encode({k: np.asarray(v) for k, v in arrays.items()})
        return self._write_safetensors(self.strategy_state_path(job_id, round_), layout, blob,
                                       {"job": job_id, "round": str(round_), "strategy": json.dumps(meta)})

    def load_strategy_state(self, job_id: str, round_: int) -> tuple[dict[str, np.ndarray], dict]:
        path = self.strategy_state_path(job_id, round_)
        if not path.exists():
            raise NotFound(f"job {job_id} has no strategy state for round {round_} ({path} is missing); "
                           "the job cannot resume its strategy exactly")
        with safe_open(str(path), framework="numpy") as fh:
            meta = json.loads((fh.metadata() or {}).get("strategy", "{}"))
            arrays = {name: fh.get_tensor(name) for name in fh.keys()}
        return arrays, meta

    def _write_safetensors(self, path: Path, layout: Layout, blob, metadata: dict[str, str]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        header = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.nbytes]}
                  for t in layout.tensors}
        header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)   # safetensors pads the header to 8-byte alignment
        return write_atomically(path, len(text).to_bytes(8, "little"), text, _exactly(blob, layout.total_bytes, path),
                                mode=0o600)

    def _checkpoint_header(self, job_id: str, round_: int) -> tuple[Layout, Path, int, bool]:
        """(layout, file, data offset, whether the data section is in wire order) of a checkpoint."""
        path = self.checkpoint_path(job_id, round_)
        if not path.exists():
            raise NotFound(f"job {job_id} has no checkpoint for round {round_}")
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        header.pop("__metadata__", None)
        layout = Layout.build([(name, t["dtype"], tuple(t["shape"])) for name, t in header.items()])
        ours = all(header[t.name]["data_offsets"] == [t.offset, t.offset + t.nbytes] for t in layout.tensors)
        return layout, path, 8 + header_len, ours

    def checkpoint_source(self, job_id: str, round_: int) -> tuple[Layout, Path, int]:
        """(layout, file, data offset) of a checkpoint this store wrote: its data section is the wire blob,
        so it can be streamed from the file (and the page cache) without holding the model in memory."""
        layout, path, start, ours = self._checkpoint_header(job_id, round_)
        if not ours:
            raise NotFound(f"checkpoint {path} is not laid out in wire order")
        return layout, path, start

    def checkpoint_blob(self, job_id: str, round_: int) -> tuple[Layout, bytearray]:
        """(layout, blob) of a checkpoint, reading the file once; validated like any wire input."""
        layout, path, start, ours = self._checkpoint_header(job_id, round_)
        if not ours:
            return encode(self.load_checkpoint(job_id, round_))   # laid out by another writer
        blob = bytearray(layout.total_bytes)
        with open(path, "rb") as fh:
            fh.seek(start)
            if fh.readinto(blob) != layout.total_bytes or fh.read(1):
                raise IntegrityError(f"checkpoint {path} does not hold exactly the bytes its header describes")
        receiver = Receiver(layout)   # size and finiteness, as for any model on the wire; no copy
        receiver.feed(0, blob)
        receiver.finish()
        return layout, blob

    def load_checkpoint(self, job_id: str, round_: int) -> dict[str, np.ndarray]:
        path = self.checkpoint_path(job_id, round_)
        if not path.exists():
            raise NotFound(f"job {job_id} has no checkpoint for round {round_}")
        return load_file(str(path))


def _exactly(data, size: int, path: Path) -> Iterator[memoryview]:
    """The data section's blocks (a bytes-like blob or an iterator of blocks), refused before the file
    replaces anything unless they come to `size` bytes."""
    written = 0
    for block in write_blocks(data):
        written += len(block := memoryview(block).cast("B"))
        if written > size:
            break
        yield block
    if written != size:
        raise IntegrityError(f"{path.name}: the model data came to {'more than ' if written > size else ''}"
                             f"{written} bytes, not the {size} its header declares; nothing was saved")
