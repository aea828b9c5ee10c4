"""The site's own audit trail (<state_dir>/audit.db): what it ran, on which data, what it sent, what it declined."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Callable

from plexus.audit import AuditLog
from plexus.errors import FailedPrecondition

AUDIT_FILE = "audit.db"


class AuditWriteFailed(FailedPrecondition):
    """The site's audit log cannot be written (a full disk, a failing device): nothing may go unrecorded."""


class SiteAudit:
    """Thin, typed front of the site's AuditLog; `plexus site audit --config site.yaml` prints it."""

    def __init__(self, state_dir: Path, *, actor: str = "site", clock: Callable[[], float] = time.time) -> None:
        path = Path(state_dir) / AUDIT_FILE
        try:
            self.log = AuditLog(path, clock=clock)
        except (sqlite3.Error, OSError) as exc:
            raise AuditWriteFailed(f"cannot open the site's audit log {path} ({exc}); state_dir must be a writable "
                                   "folder with free space") from exc
        self.actor = actor

    def close(self) -> None:
        self.log.close()

    def ran(self, job_id: str, round_: int, dataset: str, model: str, kind: str) -> None:
        """A task ran on local data (kind: train, evaluate, ...)."""
        self._append("ran", job_id, {"round": round_, "dataset": dataset, "model": model, "kind": kind})

    def sent(self, job_id: str, round_: int, sha256: str, num_samples: int) -> None:
        """An update left the site; sha256 is of the exact bytes sent."""
        self._append("sent", job_id, {"round": round_, "sha256": sha256, "num_samples": num_samples})

    def declined(self, job_id: str, reason: str) -> None:
        self._append("declined", job_id, {"reason": reason})

    def _append(self, action: str, job_id: str, details: dict) -> None:
        try:
            self.log.append(self.actor, action, f"job:{job_id}", details)
        except (sqlite3.Error, OSError) as exc:
            # Said without the path: the coordinator hears this reason, and no local path goes to it.
            raise AuditWriteFailed(f"the site cannot write its audit log ({exc}); its operator must free space in "
                                   "the site's state_dir") from exc
