"""What a committed job event tells its listeners (the audit trail, the metrics): who acted, for a
refused update why, and for an opened round its kind, as fields set where the event happens. Messages
are free text for people; nothing is ever parsed back out of them (a site could write "aborted by adam"
into its own failure message)."""

from __future__ import annotations

from dataclasses import dataclass

from plexus.errors import Reason

COORDINATOR = "coordinator"
# Task outcomes a site reports about itself; the others (rejected, late) are the coordinator's verdict.
SITE_REPORTED = frozenset({"submitted", "buffered", "trained", "declined", "evaluated", "failed"})


def site_actor(name: str) -> str:
    return f"site:{name}"


def admin_actor(name: str) -> str:
    return f"admin:{name}"


def outcome_actor(status: str, site: str) -> str:
    """Who a task outcome is attributed to: the site for what it reported, else the coordinator."""
    return site_actor(site) if status in SITE_REPORTED else COORDINATOR


@dataclass(frozen=True)
class Event:
    """One committed job event as the store's listeners see it."""

    job_id: str
    kind: str
    round: int = 0
    site: str = ""
    message: str = ""
    actor: str = COORDINATOR   # "coordinator", "site:NAME" or "admin:NAME"
    reason: Reason | None = None   # set for site_rejected: why the update was refused
    round_kind: str = ""   # set for round_opened: "train" or "evaluate"
    staleness: int | None = None   # set for site_buffered: τ of the asynchronous update taken into a buffer
