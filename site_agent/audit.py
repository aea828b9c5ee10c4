"""The site's own audit trail (<state_dir>/audit.db): what it ran, on which data, what it sent, what it declined."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from plexus.audit import AuditLog

AUDIT_FILE = "audit.db"


class SiteAudit:
    """Thin, typed front of the site's AuditLog; `plexus site audit --config site.yaml` prints it."""

    def __init__(self, state_dir: Path, *, actor: str = "site", clock: Callable[[], float] = time.time) -> None:
        self.log = AuditLog(Path(state_dir) / AUDIT_FILE, clock=clock)
        self.actor = actor

    def close(self) -> None:
        self.log.close()

    def ran(self, job_id: str, round_: int, dataset: str, model: str, kind: str) -> None:
        """A task ran on local data (kind: train, evaluate, ...)."""
        self.log.append(self.actor, "ran", f"job:{job_id}",
                        {"round": round_, "dataset": dataset, "model": model, "kind": kind})

    def sent(self, job_id: str, round_: int, sha256: str, num_samples: int) -> None:
        """An update left the site; sha256 is of the exact bytes sent."""
        self.log.append(self.actor, "sent", f"job:{job_id}",
                        {"round": round_, "sha256": sha256, "num_samples": num_samples})

    def declined(self, job_id: str, reason: str) -> None:
        self.log.append(self.actor, "declined", f"job:{job_id}", {"reason": reason})
