"""The admin commands on a state dir no coordinator runs on: `plexus job show --state DIR` and the other reads.

A stopped coordinator's state dir, or the one `plexus simulate --state DIR` writes (in DIR/coordinator), is
read through the coordinator's own AdminService over its own Store, in this process (plexus.inproc), with an
engine that is never started: what is shown is what a coordinator on that dir would show. The admin CLI finds
`admin_client` through the `plexus.local_admin` entry point (the kernel never imports `coordinator`).
"""

from __future__ import annotations

import getpass
import os
import sqlite3
from pathlib import Path

from coordinator.engine import Engine
from coordinator.service import AdminService, job_event, job_summary
from coordinator.store import DB_FILE, LOCK_FILE, Store
from plexus.admin_client import AdminClient
from plexus.errors import ConfigError, FailedPrecondition
from plexus.identity import Identity, RevocationList
from plexus.inproc import LocalStub
from plexus.proto.plexus.v1 import admin_pb2
from plexus.rpc import CallLimit, SendWatchdog, guarded

CHUNK_BYTES = 1 << 20      # a download's chunks: the coordinator's default chunk_bytes
STREAM_IDLE_S = 30.0       # and its default stream_idle_timeout_s
LIVE_ONLY = ("--state reads a state dir, which no coordinator runs; to submit, abort or resume a job, or to read "
             "the audit log, call a running coordinator with --kit")


def admin_client(state_dir: Path) -> AdminClient:
    """An AdminClient that reads `state_dir`, a coordinator's state dir or a simulation dir whose coordinator/
    is one, without a coordinator. It holds the state dir's lock until closed: a coordinator cannot start on
    the dir meanwhile, and a dir a coordinator (or simulation) runs on is refused."""
    given = Path(state_dir)
    found = find_state_dir(given)
    store = open_store(found)
    try:
        engine = Engine(store)   # never started: no engine thread, and no model worker (started by a build)
        watchdog = SendWatchdog(STREAM_IDLE_S)   # its thread runs only while a download streams
        crl_dir = next((d for d in (given, found) if (d / "crl.pem").is_file() and (d / "ca.pem").is_file()), None)
        service = StateDirAdmin(engine, LocalAuth(crl_dir), chunk_bytes=CHUNK_BYTES, watchdog=watchdog)
        stub = LocalStub(service, admin_pb2.DESCRIPTOR.services_by_name["Admin"], b"")
    except BaseException:
        store.close()
        raise

    def close() -> None:
        watchdog.stop()
        store.close()

    return AdminClient.over(stub, close=close, address=f"state dir {found}")


def find_state_dir(path: Path) -> Path:
    """`path` if it is a coordinator state dir (it holds the store's database), or its coordinator/ if that is
    one (a `plexus simulate --state` dir); ConfigError otherwise. Checked before the Store opens it, which
    would make a state dir of any folder."""
    for candidate in (path, path / "coordinator"):
        if (candidate / DB_FILE).is_file():
            check_database(candidate / DB_FILE)
            return candidate
    what = "does not exist" if not path.exists() else f"holds no {DB_FILE} (nor coordinator/{DB_FILE})"
    raise ConfigError(f"--state {path} {what}: give a coordinator's state dir (its config's state_dir), or the "
                      "dir `plexus simulate --state DIR` wrote")


def check_database(path: Path) -> None:
    """Refuse a plexus.db that holds no coordinator's tables (an empty file, another program's database), read
    without writing: the Store would write its schema into it, and the reads would show an empty coordinator. A
    damaged database is the Store's to find (its quick_check names the fix)."""
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.OperationalError:   # cannot be opened read-only (a crashed run's WAL without its index): the
        return                          # Store opens it, and its checks name what is wrong
    except sqlite3.DatabaseError as exc:
        tables, damage = set(), f": {exc}"
    else:
        damage = ""
    if "jobs" not in tables:
        raise ConfigError(f"--state: {path} is not a coordinator's database ({path.stat().st_size} bytes, no jobs "
                          f"table{damage}); give the state dir a coordinator or `plexus simulate` wrote, or restore "
                          "its plexus.db from a backup (docs/backup-restore.md)")


def open_store(state_dir: Path) -> Store:
    """The Store on `state_dir`; a dir whose lock a coordinator or simulation holds is refused, naming it."""
    try:
        return Store(state_dir)
    except FailedPrecondition:   # the lock: the only FailedPrecondition a Store's opening raises
        try:
            holder = (state_dir / LOCK_FILE).read_text().strip()
        except OSError:
            holder = ""
        who = f"PID {holder}" if holder.isdigit() else "another process"
        raise FailedPrecondition(f"state dir {state_dir} is in use by a running coordinator or simulation ({who}); "
                                 "read it once that stops, or call the coordinator with --kit") from None


class LocalAuth:
    """The Authenticator of calls made in this process by whoever can read the state dir.

    Whoever has the state dir on disk has every job, metric and checkpoint in it already, so a certificate would
    prove nothing more: every call is theirs, as `local:USER`, with role operator (downloading a model needs it;
    the writes an operator could make are refused by StateDirAdmin). A site's `revoked` flag comes from
    `crl_dir`'s crl.pem, checked against the ca.pem beside it, when there is one (else no site is revoked)."""

    def __init__(self, crl_dir: Path | None = None):
        self.calls = CallLimit()
        self._crl_dir = crl_dir
        self._crl: RevocationList | None = None
        self._identity = Identity(name=f"local:{_user()}", kind="admin", role="operator", serial=0)

    def identify(self, context) -> Identity:
        return self._identity

    def still_valid(self, who: Identity) -> None:
        """The local user's calls stay theirs for as long as they run (no certificate to revoke)."""

    def revoked(self, serial: int) -> bool:
        if self._crl_dir is None:
            return False
        if self._crl is None:   # read on first use: an expired CRL fails `sites list`, not every command
            self._crl = RevocationList(self._crl_dir / "crl.pem", (self._crl_dir / "ca.pem").read_bytes())
        return self._crl.revoked(serial)


def _refused(name: str):
    def method(self, request, context, *, who):
        raise FailedPrecondition(LIVE_ONLY)
    method.__name__ = name
    return guarded(kind="admin")(method)


class StateDirAdmin(AdminService):
    """The AdminService of a state dir at rest: its reads as a coordinator answers them; no writes (nothing would
    carry a submitted job out, and the engine's model worker must not start); and a watch that ends once the
    job's recorded events are sent, since no engine adds more."""

    SubmitJob, AbortJob, ResumeJob, GetAudit = map(_refused, ("SubmitJob", "AbortJob", "ResumeJob", "GetAudit"))

    @guarded(kind="admin", min_role="viewer")
    def WatchJob(self, request, context, *, who):
        row = self.store.job(request.job_id)
        summary = job_summary(row)
        for event in self.store.events_after(row.id, 0):
            yield job_event(event, summary)


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):   # no login name in the environment and none in the password database
        return f"uid{os.getuid()}"
