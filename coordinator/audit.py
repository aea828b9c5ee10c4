"""The coordinator's audit trail: every committed job event, plus joins and revocations, with who did it."""

from __future__ import annotations

import threading

from coordinator.events import Event
from plexus.audit import AuditLog


class CoordinatorAudit:
    """Appends an audit entry for every event the store commits; construct once, next to the store."""

    def __init__(self, audit_log: AuditLog, store) -> None:
        self.log = audit_log
        self._joined: dict[str, tuple] = {}   # site -> what its last audited Join said
        self._lock = threading.Lock()
        store.subscribe(self.on_event)

    def on_event(self, event: Event) -> None:
        """Store listener: the actor is the event's own field, set where the event happened."""
        details = {"round": event.round}
        if event.site:
            details["site"] = event.site
        if event.message:
            details["message"] = event.message
        if event.reason is not None:
            details["reason"] = event.reason.value
        self.log.append(event.actor, event.kind, f"job:{event.job_id}", details)

    def site_joined(self, site: str, *, policy_digest: str, agent_version: str = "", serial: int | None = None) -> None:
        """Audit a Join that says something new of its site (its first since the coordinator started, or another
        policy, agent version or certificate): a site calling Join in a loop cannot grow the append-only log."""
        said = (policy_digest, agent_version, serial)
        with self._lock:
            if self._joined.get(site) == said:
                return
            self._joined[site] = said
        self.log.append(f"site:{site}", "site_joined", f"site:{site}",
                        {"policy_digest": policy_digest, "agent_version": agent_version})

    def certificate_revoked(self, name: str, *, serial: int | str, by: str = "coordinator") -> None:
        self.log.append(by, "certificate_revoked", f"cert:{name}", {"serial": str(serial)})
