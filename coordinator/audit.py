"""The coordinator's audit trail: every committed job event, plus joins and revocations, with who did it."""

from __future__ import annotations

import re

from plexus.audit import AuditLog

# Store events whose message names the admin who acted: "submitted by ann", "aborted by ann", "by ann".
_BY = re.compile(r"(?:submitted |aborted )?by (\S+)")
# Events the site itself caused; every other event is the coordinator's own doing.
_SITE_ACTS = {"site_submitted", "site_declined", "site_evaluated"}


class CoordinatorAudit:
    """Appends an audit entry for every event the store commits; construct once, next to the store."""

    def __init__(self, audit_log: AuditLog, store) -> None:
        self.log = audit_log
        store.subscribe(self.on_event)

    def on_event(self, event: tuple) -> None:
        """Store listener: event = (job_id, kind, round, site, message)."""
        job_id, kind, round_, site, message = event
        by = _BY.fullmatch(message or "")
        if by:
            actor = f"admin:{by.group(1)}"
        elif kind in _SITE_ACTS and site:
            actor = f"site:{site}"
        else:
            actor = "coordinator"
        details = {"round": round_}
        if site:
            details["site"] = site
        if message:
            details["message"] = message
        self.log.append(actor, kind, f"job:{job_id}", details)

    def site_joined(self, site: str, *, policy_digest: str, agent_version: str = "") -> None:
        self.log.append(f"site:{site}", "site_joined", f"site:{site}",
                        {"policy_digest": policy_digest, "agent_version": agent_version})

    def certificate_revoked(self, name: str, *, serial: int | str, by: str = "coordinator") -> None:
        self.log.append(by, "certificate_revoked", f"cert:{name}", {"serial": str(serial)})
