"""The words the coordinator, its store and the wire mapping share, one string enum per vocabulary.

Each value is exactly the string stored in the state dir's rows and events, so a member compares,
formats and stores as that string (`enum.StrEnum`).
"""

from __future__ import annotations

import enum


class TaskKind(enum.StrEnum):
    """What a task asks a site to do."""

    TRAIN = "train"
    EVALUATE = "evaluate"
    SECAGG_ADVERTISE = "secagg_advertise"
    SECAGG_SHARE = "secagg_share"
    SECAGG_MASK = "secagg_mask"
    SECAGG_UNMASK = "secagg_unmask"
    SPLIT_TRAIN = "split_train"           # split learning: one epoch of batches through a Split session
    SPLIT_EVALUATE = "split_evaluate"     # split learning: the joined model on the site's held-out rows


class TaskStatus(enum.StrEnum):
    """Where a task stands: issued, then one outcome (stale: its round ended with the coordinator)."""

    ISSUED = "issued"
    SUBMITTED = "submitted"
    EVALUATED = "evaluated"
    DECLINED = "declined"
    FAILED = "failed"
    REJECTED = "rejected"
    LATE = "late"
    STALE = "stale"
    BUFFERED = "buffered"     # asynchronous: accepted into the unflushed buffer (or cohort) of the next version
    TRAINED = "trained"       # asynchronous secure aggregation: trained; the update is kept at the site for a cohort
    DISCARDED = "discarded"   # asynchronous: was in a buffer that was never flushed (a restart, the job's end)


class JobStatus(enum.StrEnum):
    """A job's life: queued, running, then one terminal status."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    BUDGET_REACHED = "budget_reached"
    FAILED = "failed"
    ABORTED = "aborted"


# The statuses a job ends in: nothing moves it on from these.
TERMINAL = (JobStatus.COMPLETED, JobStatus.BUDGET_REACHED, JobStatus.FAILED, JobStatus.ABORTED)


class SecaggPhase(enum.StrEnum):
    """The phases of one secure-aggregation round, in order."""

    ADVERTISE = "advertise"
    SHARE = "share"
    MASK = "mask"
    UNMASK = "unmask"
    DONE = "done"
