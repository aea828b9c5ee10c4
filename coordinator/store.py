"""The coordinator's durable state: SQLite (WAL) plus one safetensors checkpoint per closed round."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

from coordinator.events import COORDINATOR, Event, admin_actor, outcome_actor
from plexus.config import CheckpointsSpec
from plexus.errors import IntegrityError, NotFound, Reason
from plexus.files import TMP_PATTERN, Blocks, fed_beside, lock_exclusively, write_atomically, write_blocks
from plexus.wire import Layout, Receiver, encode

log = logging.getLogger("plexus.store")

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
CREATE TABLE IF NOT EXISTS site_joins (
    name TEXT PRIMARY KEY, serial TEXT NOT NULL DEFAULT '', dataset_rows TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS relay_joins (
    name TEXT PRIMARY KEY, children TEXT NOT NULL DEFAULT '[]');
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, at REAL NOT NULL, kind TEXT NOT NULL,
    round INTEGER NOT NULL DEFAULT 0, site TEXT NOT NULL DEFAULT '', message TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS checkpoints (
    file TEXT PRIMARY KEY, job_id TEXT NOT NULL, round INTEGER NOT NULL, sha256 TEXT NOT NULL, written REAL NOT NULL);
CREATE TABLE IF NOT EXISTS submissions (
    submitted_by TEXT NOT NULL, request_id TEXT NOT NULL, job_id TEXT NOT NULL, config_sha256 TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (submitted_by, request_id));
"""
# A state dir from an earlier version gains the tables it lacks when a store opens it (CREATE ... IF NOT
# EXISTS above): so far every upgrade has only added tables (docs/upgrading.md). So what a Join reports
# beyond the `sites` columns lives in a table of its own, `site_joins` (the serial as decimal text: X.509
# serials run to 159 bits, past SQLite's 64-bit integers).

RESTORE = "restore the state directory from a backup (docs/backup-restore.md)"
DB_FILE, LOCK_FILE = "plexus.db", "coordinator.lock"   # in the state dir
READ_BYTES = 4 << 20
_NO_DIGEST = "0" * 64   # the header's checksum while the data is still being written


@dataclass(frozen=True)
class JobRow:
    """One job: its config as submitted, where it stands (status, current round) and its last message."""

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


class RoundRow(NamedTuple):
    """One round of a job; `contributors` is the JSON list of the sites whose updates it used."""

    round: int
    kind: str
    status: str
    opened: float
    closed: float | None
    contributors: str
    total_samples: int
    message: str


class TaskRow(NamedTuple):
    """One task granted to a site."""

    task_id: str
    job_id: str
    round: int
    site: str
    kind: str
    nonce: bytes
    status: str


class SiteEventRow(NamedTuple):
    """A task's outcome for a site (submitted, rejected, late, ...) and why, as `plexus job show` lists it."""

    site: str
    status: str
    round: int
    reason: str


class MetricRow(NamedTuple):
    """One metric value; site "" for the federation as a whole (e.g. kind "privacy", name "epsilon")."""

    round: int
    site: str
    kind: str
    name: str
    value: float


class SiteRow(NamedTuple):
    """A site that joined; `models` and `datasets` are JSON lists of what it reported at its last Join,
    `dataset_rows` a JSON object of training rows per dataset, `serial` its certificate's serial then
    (decimal; "" if it last joined before this was recorded)."""

    name: str
    last_seen: float
    agent_version: str
    policy_digest: str
    models: str
    datasets: str
    serial: str
    dataset_rows: str
    children: str = ""        # a relay: JSON list of the children it named at its last Join; "" for a site


def rows_by_dataset(sites: Iterable[SiteRow], *, without: str = "") -> dict[str, int]:
    """The training rows the sites reported at their last Join, summed per dataset (leaving out site `without`)."""
    rows: dict[str, int] = {}
    for site in sites:
        if site.name != without:
            for dataset, n in json.loads(site.dataset_rows or "{}").items():
                rows[dataset] = rows.get(dataset, 0) + int(n)
    return rows


class EventRow(NamedTuple):
    """One recorded job event, as WatchJob streams it."""

    id: int
    at: float
    kind: str
    round: int
    site: str
    message: str


class SubmissionRow(NamedTuple):
    """The job an admin's request id made, and the SHA-256 of the config it was made from."""

    job_id: str
    config_sha256: str


class Store:
    """The coordinator's durable state: jobs, rounds, tasks, metrics, sites and events in SQLite (WAL),
    checkpoints and strategy state as safetensors files. All SQL lives here; callers get named rows
    (NamedTuples, so tuple unpacking still works) and plain values back. Thread-safe; one process per
    state dir. Every change that is an event commits with it and is then published to `subscribe`rs."""

    def __init__(self, state_dir: Path, *, clock=time.time, retention: CheckpointsSpec = CheckpointsSpec()):
        self.state_dir = Path(state_dir)
        self.checkpoints = self.state_dir / "checkpoints"
        self.spool = self.state_dir / "spool"
        for d in (self.state_dir, self.checkpoints, self.spool):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One process per state dir, for its lifetime: two would both take up the same job. First, so
        # that nothing below removes another coordinator's files in progress.
        self._lock_fd = lock_exclusively(self.state_dir / LOCK_FILE, f"state dir {self.state_dir}")
        try:
            self._open(clock, retention)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _open(self, clock, retention: CheckpointsSpec) -> None:
        # half-received updates of a crashed run are void
        for leftover in [*self.spool.glob("*.part"), *self.spool.glob("*.held")]:
            leftover.unlink()
        interrupted = [p for p in self.state_dir.rglob(TMP_PATTERN) if p.is_file()]
        for leftover in interrupted:   # a write that never reached its rename: the old file is intact
            leftover.unlink()
        if interrupted:
            log.info("removed %d temporary file(s) of interrupted writes", len(interrupted))
        self.clock = clock
        self.retention = retention
        self._listeners: list = []
        self._lock = threading.RLock()
        self._reading: Counter = Counter()   # (job, round) -> downloads streaming that checkpoint now
        path = self.state_dir / DB_FILE
        _check_wal(path)
        _check_not_lost(path, self.checkpoints)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            # Linear in the database's size, once per start: a damaged page is found now, not mid-job.
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check(5)") if row[0] != "ok"]
        except sqlite3.OperationalError:   # locked or unreadable: not a damaged file
            self._db.close()
            raise
        except sqlite3.DatabaseError as exc:   # not a database at all, or a malformed page
            problems = [str(exc)]
        if problems:
            self._db.close()
            raise IntegrityError(f"{path} is damaged ({'; '.join(problems)}); {RESTORE}")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        """Close the database and release the state dir for another process."""
        with self._lock:
            self._db.close()
        os.close(self._lock_fd)

    def subscribe(self, listener) -> None:
        """Call listener(event) after each committed event, a coordinator.events.Event.

        For observers (metrics, audit): a listener that raises is logged and never breaks the caller.
        """
        self._listeners.append(listener)

    def _tx(self, statements: list[tuple[str, tuple]], event: Event | None = None) -> None:
        """Run statements in one transaction, recording `event` with them; listeners hear of it once committed."""
        if event is not None:
            statements = [*statements, self._event_sql(event)]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        if event is not None:
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    logging.getLogger("plexus.store").exception("event listener failed")

    def _all(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # jobs -------------------------------------------------------------------------------
    def add_job(self, job_id: str, name: str, config_yaml: str, strategy: str, rounds: int, who: str,
                request: tuple[str, str] | None = None) -> None:
        """Record a queued job; `request` = (request id, config SHA-256) records the submission that made it,
        in the same transaction, so that a repeat of it finds this job (`submission`)."""
        now = self.clock()
        statements = [("INSERT INTO jobs (id, name, config_yaml, strategy, status, rounds, submitted_by, created,"
                       " updated) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?)",
                       (job_id, name, config_yaml, strategy, rounds, who, now, now))]
        if request is not None:
            request_id, digest = request
            statements.append(("INSERT INTO submissions VALUES (?, ?, ?, ?, ?)",
                               (who, request_id, job_id, digest, now)))
        self._tx(statements, Event(job_id, "job_submitted", 0, "", f"submitted by {who}", actor=admin_actor(who)))

    def submission(self, who: str, request_id: str) -> SubmissionRow | None:
        """(job id, config SHA-256) of the job admin `who` submitted under `request_id`, or None."""
        rows = self._all("SELECT job_id, config_sha256 FROM submissions WHERE submitted_by = ? AND request_id = ?",
                         (who, request_id))
        return SubmissionRow(*rows[0]) if rows else None

    def job(self, job_id: str) -> JobRow:
        """The job `job_id`; NotFound if this coordinator has none."""
        rows = self._all("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise NotFound(f"no job {job_id!r}; `plexus job list` shows the jobs this coordinator knows")
        return JobRow(*rows[0])

    def jobs(self) -> list[JobRow]:
        """Every job, oldest first."""
        return [JobRow(*r) for r in self._all("SELECT * FROM jobs ORDER BY created, id")]

    def set_job(self, job_id: str, *, status: str | None = None, current_round: int | None = None,
                message: str | None = None, event: tuple[str, int, str, str] | None = None,
                actor: str = COORDINATOR) -> None:
        """Update a job; `event` = (kind, round, site, message) is recorded with it, attributed to `actor`."""
        sets, args = ["updated = ?"], [self.clock()]
        for column, value in (("status", status), ("current_round", current_round), ("message", message)):
            if value is not None:
                sets.append(f"{column} = ?")
                args.append(value)
        self._tx([(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))],
                 Event(job_id, *event, actor=actor) if event else None)

    # rounds and tasks --------------------------------------------------------------------
    def open_round(self, job_id: str, round_: int, kind: str) -> None:
        """Open (or reopen, for a retry) a round: an earlier attempt's row goes and its unanswered tasks turn stale."""
        self._tx([("DELETE FROM rounds WHERE job_id = ? AND round = ?", (job_id, round_)),
                  ("UPDATE tasks SET status = 'stale' WHERE job_id = ? AND round = ? AND status = 'issued'",
                   (job_id, round_)),
                  ("INSERT INTO rounds (job_id, round, kind, status, opened) VALUES (?, ?, ?, 'open', ?)",
                   (job_id, round_, kind, self.clock()))],
                 Event(job_id, "round_opened", round_, "", kind, round_kind=kind))

    def close_round(self, job_id: str, round_: int, *, status: str, contributors: list[str], total_samples: int,
                    message: str, job_update: dict | None = None, event: tuple[str, str] | None = None,
                    late: str = "before the round closed", flushed: list[str] = (),
                    metrics: Mapping[tuple[int, str, str, str], float] | None = None) -> None:
        """Close a round, and in the same transaction move the job on (its current round, status). Tasks
        still unanswered become late, their reason "no update/evaluation result/answer " + `late`.
        `flushed`: asynchronous tasks whose buffered updates (under secure aggregation: updates kept at their
        sites) this round's model took in: buffered or trained → submitted; `metrics`: job-level metrics of the
        round (record_metrics' keys), written with it."""
        statements = [(f"UPDATE tasks SET status = 'submitted' WHERE status IN ('buffered', 'trained') AND task_id IN "
                       f"({', '.join('?' * len(flushed))})", tuple(flushed))] if flushed else []
        statements += [
            ("UPDATE rounds SET status = ?, closed = ?, contributors = ?, total_samples = ?, message = ?"
             " WHERE job_id = ? AND round = ?",
             (status, self.clock(), json.dumps(contributors), total_samples, message, job_id, round_)),
            ("UPDATE tasks SET status = 'late', finished = ?, reason = CASE kind WHEN 'train' THEN 'no update '"
             " WHEN 'evaluate' THEN 'no evaluation result ' ELSE 'no answer ' END || ?"
             " WHERE job_id = ? AND round = ? AND status = 'issued'", (self.clock(), late, job_id, round_)),
        ]
        statements += [("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?, ?)",
                        (job_id, key_round, site, kind, name, float(value)))
                       for (key_round, site, kind, name), value in (metrics or {}).items()]
        if job_update:
            cols = ", ".join(f"{k} = ?" for k in job_update)
            statements.append((f"UPDATE jobs SET {cols}, updated = ? WHERE id = ?",
                               (*job_update.values(), self.clock(), job_id)))
        kind, text = event or (f"round_{status}", message)
        self._tx(statements, Event(job_id, kind, round_, "", text))

    def interrupt_open_rounds(self) -> None:
        """After a restart: rounds that were open are void and their tasks can no longer be answered."""
        self._tx([("UPDATE tasks SET status = 'stale' WHERE status = 'issued'", ()),
                  ("UPDATE rounds SET status = 'interrupted', closed = ? WHERE status = 'open'", (self.clock(),))])

    def unflushed(self, job_id: str) -> list[TaskRow]:
        """An asynchronous job's updates that no version has taken in yet: in its buffer ('buffered'), or under
        secure aggregation kept at their sites for a cohort ('trained')."""
        return [TaskRow(*r) for r in self._all(
            "SELECT task_id, job_id, round, site, kind, nonce, status FROM tasks WHERE job_id = ?"
            " AND status IN ('buffered', 'trained') ORDER BY issued", (job_id,))]

    def last_task_round(self, job_id: str, kinds: Iterable[str]) -> int | None:
        """The highest round of the job's tasks of these kinds, or None if it has none."""
        kinds = tuple(kinds)
        rows = self._all(f"SELECT MAX(round) FROM tasks WHERE job_id = ? AND kind IN ({', '.join('?' * len(kinds))})",
                         (job_id, *kinds))
        return rows[0][0] if rows else None

    def task_counts(self, job_id: str) -> dict[str, int]:
        """site -> how many tasks of the job it was given."""
        return dict(self._all("SELECT site, COUNT(*) FROM tasks WHERE job_id = ? GROUP BY site", (job_id,)))

    def void_issued(self, job_id: str) -> None:
        """The job's unanswered tasks can no longer be answered (its driver was taken up again)."""
        self._tx([("UPDATE tasks SET status = 'stale' WHERE job_id = ? AND status = 'issued'", (job_id,))])

    def rounds(self, job_id: str) -> list[RoundRow]:
        """The job's rounds in order."""
        return [RoundRow(*r) for r in self._all(
            "SELECT round, kind, status, opened, closed, contributors, total_samples, message"
            " FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))]

    def add_task(self, task_id: str, job_id: str, round_: int, site: str, kind: str, nonce: bytes) -> None:
        """Record a task granted to a site, issued now."""
        self._tx([("INSERT INTO tasks (task_id, job_id, round, site, kind, nonce, status, issued)"
                   " VALUES (?, ?, ?, ?, ?, ?, 'issued', ?)",
                   (task_id, job_id, round_, site, kind, nonce, self.clock()))])

    def task(self, task_id: str) -> TaskRow | None:
        """The task `task_id`, or None if there is none."""
        rows = self._all("SELECT task_id, job_id, round, site, kind, nonce, status FROM tasks WHERE task_id = ?",
                         (task_id,))
        return TaskRow(*rows[0]) if rows else None

    def finish_task(self, task_id: str, status: str, reason: str = "", *, job_id: str = "", round_: int = 0,
                    site: str = "", metrics: Mapping[tuple[int, str, str], float] | None = None,
                    code: Reason | None = None, staleness: int | None = None) -> None:
        """Record a task's outcome, its metrics and an event, atomically. The event is attributed to the site
        for outcomes it reported, else to the coordinator; `code` says why a rejected update was refused;
        `staleness`, an asynchronous update's τ."""
        statements = [("UPDATE tasks SET status = ?, reason = ?, finished = ? WHERE task_id = ?",
                       (status, reason, self.clock(), task_id))]
        for (round_key, kind, name), value in (metrics or {}).items():
            statements.append(("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?, ?)",
                               (job_id, round_key, site, kind, name, float(value))))
        self._tx(statements, Event(job_id, f"site_{status}", round_, site, reason,
                                   actor=outcome_actor(status, site), reason=code, staleness=staleness))

    def record_metrics(self, job_id: str, metrics: Mapping[tuple[int, str, str, str], float]) -> None:
        """Job-level metrics (site "" for the federation as a whole), e.g. the privacy ledger's ε."""
        self._tx([("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?, ?)",
                   (job_id, round_, site, kind, name, float(value)))
                  for (round_, site, kind, name), value in metrics.items()])

    def job_sites(self, job_id: str) -> set[str]:
        """Every site that was given a task of the job, whatever became of it."""
        return {site for (site,) in self._all("SELECT DISTINCT site FROM tasks WHERE job_id = ?", (job_id,))}

    def site_events(self, job_id: str) -> list[SiteEventRow]:
        """The outcomes of the job's tasks (not those still issued or void), by round and site."""
        return [SiteEventRow(*r) for r in self._all(
            "SELECT site, status, round, reason FROM tasks WHERE job_id = ?"
            " AND status NOT IN ('issued', 'stale') ORDER BY round, site", (job_id,))]

    def decline(self, job_id: str, site: str, reason: str) -> None:
        """Record that a site's policy declines the job (replacing an earlier reason)."""
        self._tx([("INSERT OR REPLACE INTO declines VALUES (?, ?, ?, ?)", (job_id, site, reason, self.clock()))])

    def declines(self, job_id: str) -> dict[str, str]:
        """site -> why it declines the job."""
        return dict(self._all("SELECT site, reason FROM declines WHERE job_id = ?", (job_id,)))

    def metrics(self, job_id: str) -> list[MetricRow]:
        """The job's metrics, by round, site, kind and name."""
        return [MetricRow(*r) for r in self._all(
            "SELECT round, site, kind, name, value FROM metrics WHERE job_id = ?"
            " ORDER BY round, site, kind, name", (job_id,))]

    # sites and events --------------------------------------------------------------------
    def site_seen(self, name: str, **info) -> None:
        """Note that a site was seen now; at a Join, `info` (agent_version, policy_digest, models, datasets)
        replaces what it reported before."""
        now = self.clock()
        with self._lock:
            self._db.execute("INSERT INTO sites (name, first_seen, last_seen) VALUES (?, ?, ?)"
                             " ON CONFLICT(name) DO UPDATE SET last_seen = excluded.last_seen", (name, now, now))
            if info:
                self._db.execute(
                    "UPDATE sites SET agent_version = ?, policy_digest = ?, models = ?, datasets = ? WHERE name = ?",
                    (info["agent_version"], info["policy_digest"], json.dumps(info["models"]),
                     json.dumps(info["datasets"]), name))

    def site_joined(self, name: str, *, serial: int | None, dataset_rows: Mapping[str, int],
                    children: Sequence[str] | None = None) -> None:
        """Record the certificate serial (None: unknown) and training rows per dataset of a site's Join,
        replacing those of its last one; `children`: a relay's (None: a site)."""
        rows = json.dumps(dict(dataset_rows), sort_keys=True)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO site_joins (name, serial, dataset_rows) VALUES (?, ?, ?)",
                             (name, "" if serial is None else str(serial), rows))
            if children is None:
                self._db.execute("DELETE FROM relay_joins WHERE name = ?", (name,))
            else:
                self._db.execute("INSERT OR REPLACE INTO relay_joins (name, children) VALUES (?, ?)",
                                 (name, json.dumps(sorted(children))))

    def sites(self) -> list[SiteRow]:
        """Every site that ever joined, by name."""
        return [SiteRow(*r) for r in self._all(
            "SELECT s.name, s.last_seen, s.agent_version, s.policy_digest, s.models, s.datasets,"
            " COALESCE(j.serial, ''), COALESCE(j.dataset_rows, '{}'), COALESCE(r.children, '')"
            " FROM sites s LEFT JOIN site_joins j ON j.name = s.name LEFT JOIN relay_joins r ON r.name = s.name"
            " ORDER BY s.name")]

    def event(self, job_id: str, kind: str, round_: int = 0, site: str = "", message: str = "", *,
              actor: str = COORDINATOR) -> None:
        """Record a job event on its own, attributed to `actor`, and publish it."""
        self._tx([], Event(job_id, kind, round_, site, message, actor=actor))

    def events_after(self, job_id: str, after_id: int) -> list[EventRow]:
        """The job's events with an id above `after_id`, in order (0: all of them)."""
        return [EventRow(*r) for r in self._all(
            "SELECT id, at, kind, round, site, message FROM events WHERE job_id = ? AND id > ? ORDER BY id",
            (job_id, after_id))]

    def _event_sql(self, event: Event) -> tuple[str, tuple]:
        return ("INSERT INTO events (job_id, at, kind, round, site, message) VALUES (?, ?, ?, ?, ?, ?)",
                (event.job_id, self.clock(), event.kind, event.round, event.site, event.message))

    # checkpoints -------------------------------------------------------------------------
    def checkpoint_path(self, job_id: str, round_: int) -> Path:
        """Where the model after round `round_` is (or would be) saved."""
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
        """Where the strategy's state after round `round_` is (or would be) saved."""
        return self.checkpoints / job_id / f"{round_}.strategy.safetensors"

    def save_strategy_state(self, job_id: str, round_: int, arrays: Mapping[str, np.ndarray], meta: dict) -> Path:
        """The strategy's state after a round (server optimizer moments, control variates, schedule),
        written before the round is marked closed so a restart resumes the strategy exactly."""
        layout, blob = encode({k: np.asarray(v) for k, v in arrays.items()})
        return self._write_safetensors(self.strategy_state_path(job_id, round_), layout, blob,
                                       {"job": job_id, "round": str(round_), "strategy": json.dumps(meta)})

    def load_strategy_state(self, job_id: str, round_: int) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, meta) that save_strategy_state wrote, checksummed; NotFound if there are none."""
        path = self.strategy_state_path(job_id, round_)
        if not path.exists():
            raise NotFound(f"job {job_id} has no strategy state for round {round_} ({path} is missing); "
                           "the job cannot resume its strategy exactly")
        layout, start, _, metadata = _read_header(path)
        self._verify(path, layout, start, metadata)
        with _readable(path), safe_open(str(path), framework="numpy") as fh:
            meta = json.loads((fh.metadata() or {}).get("strategy", "{}"))
            arrays = {name: fh.get_tensor(name) for name in fh.keys()}
        return arrays, meta

    def _write_safetensors(self, path: Path, layout: Layout, blob, metadata: dict[str, str]) -> Path:
        """Write the file, its SHA-256 (_digest) computed as the data goes by and patched into the header at
        the end, and record the same checksum in the database; the file is whole before the row names it."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        header = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.nbytes]}
                  for t in layout.tensors}
        header["__metadata__"] = {**metadata, "sha256": _NO_DIGEST}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)   # safetensors pads the header to 8-byte alignment
        at = 8 + text.rindex(f'"sha256":"{_NO_DIGEST}"'.encode()) + len('"sha256":"')   # the metadata comes last
        digest = _digest(layout)

        kept = blob.kept if isinstance(blob, Blocks) else 1   # blocks that may be hashed behind the writes
        hashed = fed_beside(Blocks(_exactly(blob, layout.total_bytes, path), kept), digest.update)

        def finish(fh) -> None:
            fh.seek(at)
            fh.write(digest.hexdigest().encode())

        write_atomically(path, len(text).to_bytes(8, "little"), text, hashed, mode=0o600, finish=finish)
        self._tx([("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                   (self._name(path), metadata["job"], int(metadata["round"]), digest.hexdigest(), self.clock()))])
        return path

    def _name(self, path: Path) -> str:
        return path.relative_to(self.state_dir).as_posix()

    def _verify(self, path: Path, layout: Layout, start: int, metadata: dict, data=None) -> None:
        """Refuse a file whose bytes are not the ones written: its SHA-256 against the one in its header and
        the one in the database. Streamed from the file unless `data` is its data section, already read.
        A checkpoint from before checksums (neither) passes; its size and values are still checked."""
        rows = self._all("SELECT sha256 FROM checkpoints WHERE file = ?", (self._name(path),))
        expected = {"its header": metadata.get("sha256"), "the database": rows[0][0] if rows else None}
        if not any(expected.values()):
            return
        digest = _digest(layout)
        if data is not None:
            digest.update(data)
        else:
            with open(path, "rb") as fh:
                fh.seek(start)
                while block := fh.read(READ_BYTES):
                    digest.update(block)
        found = digest.hexdigest()
        wrong = [f"{where} records {value or 'none'}" for where, value in expected.items()
                 if value != found and (value is not None or where == "its header")]
        if wrong:
            raise IntegrityError(f"checkpoint {path} is damaged: its SHA-256 is {found}, but {' and '.join(wrong)}; "
                                 f"{RESTORE}")

    def _checkpoint_header(self, job_id: str, round_: int) -> tuple[Layout, Path, int, bool, dict]:
        """(layout, file, data offset, whether the data section is in wire order, metadata) of a checkpoint."""
        path = self.checkpoint_path(job_id, round_)
        if not path.exists():
            raise NotFound(f"job {job_id} has no checkpoint for round {round_}"
                           + (" (removed by checkpoints.keep_last/keep_every)" if self.retention.keep_last else ""))
        layout, start, ours, metadata = _read_header(path)
        return layout, path, start, ours, metadata

    def checkpoint_source(self, job_id: str, round_: int, *, verify: bool = True) -> tuple[Layout, Path, int]:
        """(layout, file, data offset) of a checkpoint this store wrote: its data section is the wire blob,
        so it can be streamed from the file (and the page cache) without holding the model in memory.
        verify=False skips reading it through for its checksum: for a file just written or just verified."""
        layout, path, start, ours, metadata = self._checkpoint_header(job_id, round_)
        if not ours:
            raise NotFound(f"checkpoint {path} is not laid out in wire order")
        if verify:
            self._verify(path, layout, start, metadata)
        return layout, path, start

    def checkpoint_blob(self, job_id: str, round_: int) -> tuple[Layout, bytearray]:
        """(layout, blob) of a checkpoint, reading the file once; checksummed, and validated like any wire input."""
        layout, path, start, ours, metadata = self._checkpoint_header(job_id, round_)
        if not ours:
            return encode(self.load_checkpoint(job_id, round_))   # laid out by another writer
        blob = bytearray(layout.total_bytes)
        with open(path, "rb") as fh:
            fh.seek(start)
            if fh.readinto(blob) != layout.total_bytes or fh.read(1):
                raise IntegrityError(f"checkpoint {path} does not hold exactly the bytes its header describes")
        self._verify(path, layout, start, metadata, blob)
        receiver = Receiver(layout)   # size and finiteness, as for any model on the wire; no copy
        try:
            if blob:   # a model of only empty tensors has no bytes to feed
                receiver.feed(0, blob)
            receiver.finish()
        except IntegrityError as exc:
            raise IntegrityError(f"checkpoint {path}: {exc}; {RESTORE}") from None
        return layout, blob

    def load_checkpoint(self, job_id: str, round_: int) -> dict[str, np.ndarray]:
        """The model after round `round_` as arrays, checksummed; NotFound if it is not (or no longer) kept."""
        layout, path, start, _, metadata = self._checkpoint_header(job_id, round_)
        self._verify(path, layout, start, metadata)
        with _readable(path):
            return load_file(str(path))

    # retention ---------------------------------------------------------------------------
    @contextmanager
    def reading(self, job_id: str, round_: int) -> Iterator[None]:
        """Keep a checkpoint from retention while a download streams it."""
        with self._lock:
            self._reading[(job_id, round_)] += 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[(job_id, round_)] -= 1
                if not self._reading[(job_id, round_)]:
                    del self._reading[(job_id, round_)]

    def prune_checkpoints(self, job_id: str, latest: int) -> list[int]:
        """Apply `checkpoints` retention to a job whose round `latest` has just closed; the rounds removed.

        The latest round's model and strategy state are always kept (a resume needs them), and so is a
        checkpoint a download is streaming. Best effort: a file that cannot be removed now (a failing disk)
        is logged and tried again after the next round.
        """
        keep_last, keep_every = self.retention.keep_last, self.retention.keep_every
        if keep_last is None:
            return []
        removed = set()
        with self._lock:
            for path in sorted((self.checkpoints / job_id).glob("*.safetensors")):
                round_text = path.name.split(".", 1)[0]
                if not round_text.isdigit():
                    continue
                round_ = int(round_text)
                if round_ > latest - keep_last or (keep_every and round_ % keep_every == 0) \
                        or self._reading[(job_id, round_)]:
                    continue
                try:
                    self._tx([("DELETE FROM checkpoints WHERE file = ?", (self._name(path),))])
                    path.unlink(missing_ok=True)
                except (OSError, sqlite3.Error) as exc:
                    log.warning("could not remove %s under checkpoints retention: %s", path, exc)
                    continue
                removed.add(round_)
        if removed:
            log.info("job %s: removed the checkpoints of round(s) %s (checkpoints.keep_last=%d%s)", job_id,
                     ", ".join(map(str, sorted(removed))), keep_last,
                     f", keep_every={keep_every}" if keep_every else "")
        return sorted(removed)


def _check_not_lost(db: Path, checkpoints: Path) -> None:
    """Refuse to start a new, empty database in a state dir that held one: its write-ahead log, a checkpoint
    or the audit log is there and the database is not. SQLite would make a new one without a word, and every
    job would be gone."""
    if db.exists():
        return
    left = [p for p in (db.with_name(db.name + "-wal"), db.with_name("audit.db")) if p.exists()]
    left += [p for p in sorted(checkpoints.glob("*/*.safetensors"))[:1]]
    if left:
        raise IntegrityError(f"{db} is missing, but {', '.join(str(p) for p in left)} "
                             f"{'is' if len(left) == 1 else 'are'} still there: the state dir held a database, and "
                             f"a new one would hold none of its jobs; {RESTORE}")


def _check_wal(db: Path) -> None:
    """Refuse a database whose write-ahead log was lost. SQLite itself would open it without a word, at an
    older state: the last transactions gone. The shared-memory index (-shm) a crashed or running process
    leaves behind says how many frames the log held (the wal-index header's mxFrame, native byte order);
    a missing or shorter -wal cannot be the log it indexes."""
    wal, shm = db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")
    if not db.exists() or not shm.exists():
        return
    with open(shm, "rb") as fh:
        index = fh.read(48)
    if len(index) < 48 or not index[12]:   # isInit: an index never filled in holds no frames
        return
    page, frames = struct.unpack_from("=HI", index, 14)
    needed = 32 + frames * (24 + (65536 if page == 1 else page))   # the log's header, then (frame header + page)s
    have = wal.stat().st_size if wal.exists() else 0
    if frames and have < needed:
        raise IntegrityError(f"{wal} is {'missing' if not wal.exists() else f'only {have} bytes'}, but {shm} "
                             f"indexes {frames} committed page(s) in it: the database's last transactions are lost; "
                             f"{RESTORE} (if you restored {db.name} alone on purpose, remove {shm.name} too)")


def _digest(layout: Layout):
    """A running SHA-256 of what a checkpoint means: its tensors' names, dtypes and shapes, then (fed by
    the caller) its data section. Covers the header's substance, though it is stored in the header."""
    return hashlib.sha256(json.dumps([[t.name, t.dtype, list(t.shape)] for t in layout.tensors]).encode())


def _read_header(path: Path) -> tuple[Layout, int, bool, dict]:
    """(layout, data offset, whether the data section is in wire order, metadata) of a safetensors file;
    a header no writer could have produced, or a file shorter or longer than it describes, is damage."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if size < 8 or 8 + header_len > size:
                raise ValueError(f"the header claims {header_len} bytes of a {size}-byte file")
            header = json.loads(fh.read(header_len))
        metadata = header.pop("__metadata__", None) or {}
        layout = Layout.build([(name, t["dtype"], tuple(t["shape"])) for name, t in header.items()])
        ours = all(header[t.name]["data_offsets"] == [t.offset, t.offset + t.nbytes] for t in layout.tensors)
        if not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("its metadata is not a string map")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:   # JSON, UTF-8, dtype, shape, structure
        raise IntegrityError(f"checkpoint {path} is damaged: unreadable header ({exc}); {RESTORE}") from None
    if ours and size != 8 + header_len + layout.total_bytes:
        raise IntegrityError(f"checkpoint {path} is damaged: {size} bytes, but its header describes "
                             f"{8 + header_len + layout.total_bytes} (truncated or appended to); {RESTORE}")
    return layout, 8 + header_len, ours, metadata


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """safetensors' own errors on a file _read_header accepted, as the IntegrityError they are."""
    try:
        yield
    except SafetensorError as exc:
        raise IntegrityError(f"checkpoint {path} is damaged ({exc}); {RESTORE}") from None


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
