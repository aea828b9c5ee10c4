"""Task bookkeeping: what a site is granted, how its answer is bound to the grant, and who is present.

No round logic here: a driver decides which tasks exist; this module hands them out, checks that an
answer is the current, unreplayed answer to its own task, and keeps the sites' presence (seen times,
the online window, long-poll wake-ups, the training rows each site reported at Join).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from plexus.errors import FailedPrecondition, IntegrityError, NotFound, PermissionDenied, RoundClosed
from plexus.vocab import TaskKind, TaskStatus
from plexus.wire import Layout


@dataclass(frozen=True)
class TaskGrant:
    """What NextTask hands a site."""

    kind: TaskKind
    task_id: str
    job_id: str
    round: int
    model_round: int
    config_yaml: str
    nonce: bytes
    deadline_unix_s: float
    seed: int
    payload: dict | None = None   # secure aggregation phases: what the phase hands this site
    local_steps: int = 0          # 0: as the round config's train section says


def site_seed(job_seed: int, round_: int, site: str) -> int:
    """A per-site, per-round training seed: reproducible, different for every site and round."""
    digest = hashlib.sha256(f"plexus/v1/site-seed/{job_seed}/{round_}/{site}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def new_grant(*, kind: TaskKind, job_id: str, round_: int, model_round: int, config_yaml: str, deadline_unix_s: float,
              seed: int, payload: dict | None = None, local_steps: int = 0) -> TaskGrant:
    """A fresh task: a random task id and a random 16-byte nonce the answer must carry back."""
    return TaskGrant(kind=kind, task_id=uuid.uuid4().hex, job_id=job_id, round=round_, model_round=model_round,
                     config_yaml=config_yaml, nonce=secrets.token_bytes(16), deadline_unix_s=deadline_unix_s,
                     seed=seed, payload=payload, local_steps=local_steps)


def owned_task(store, site: str, task_id: str) -> tuple[str, int, str]:
    """(job id, round, status) of a task the store issued to `site`; NotFound or PermissionDenied otherwise."""
    row = store.task(task_id)
    if row is None:
        raise NotFound(f"no task {task_id!r}; ask for a new task with NextTask")
    _, job_id, round_, owner, _, _, status = row
    if owner != site:
        raise PermissionDenied(f"task {task_id} was issued to another site; a site may only answer its own tasks")
    return job_id, round_, status


def check_current(grant: TaskGrant | None, task_id: str, job_id: str, round_: int) -> TaskGrant:
    """The grant a task id answers, refused if its round has closed or moved to its next phase."""
    if grant is None or grant.task_id != task_id:
        raise RoundClosed(f"task {task_id} is no longer current: round {round_} of job {job_id} has closed or "
                          "moved to its next phase")
    return grant


def check_unanswered(task_id: str, status: str, answered: bool) -> None:
    """Refuse a replay: an answer to a task already answered."""
    if status != TaskStatus.ISSUED or answered:
        raise FailedPrecondition(f"task {task_id} was already answered ({status}); replays are refused")


def check_binding(grant: TaskGrant, job_id: str, round_: int, nonce: bytes, kind: TaskKind | None) -> None:
    """Refuse an answer whose (job, round, nonce) is not its task's, or that answers another kind of task."""
    if (job_id, round_) != (grant.job_id, grant.round) or not secrets.compare_digest(nonce, grant.nonce):
        raise IntegrityError("the submission's (job, round, nonce) does not match the task it answers")
    if kind and grant.kind != kind:
        raise FailedPrecondition(f"task {grant.task_id} is a {grant.kind} task, not a {kind} task")


class Presence:
    """Which sites are online, and their long-polls. Every method is called with the engine lock held
    (`lock`, the one each site's poll condition is built on)."""

    def __init__(self, lock: threading.RLock, *, online_window_s: float, monotonic: Callable[[], float]):
        self._lock, self.online_window_s, self._mono = lock, online_window_s, monotonic
        self._seen: dict[str, float] = {}
        self._rows: dict[str, dict[str, int]] = {}   # site -> dataset -> training rows, as reported at Join
        self._polls: dict[str, threading.Condition] = {}   # site -> its long-polls' condition, on the same lock

    def joined(self, site: str, dataset_rows: dict[str, int]) -> None:
        self._seen[site] = self._mono()
        self._rows[site] = dict(dataset_rows)

    def touch(self, site: str) -> bool:
        """The site is present now; True if it was not online until now."""
        now, last = self._mono(), self._seen.get(site)
        self._seen[site] = now
        return last is None or now - last > self.online_window_s

    def seen(self, site: str) -> None:
        self._seen[site] = self._mono()

    def leave(self, site: str) -> None:
        """The site is offline from now on (its certificate was revoked), whenever it was last seen."""
        self._seen.pop(site, None)

    def online(self) -> set[str]:
        """Sites seen (any call) within the online window."""
        now = self._mono()
        return {s for s, t in self._seen.items() if now - t <= self.online_window_s}

    def poll(self, site: str) -> threading.Condition:
        """The condition this site's long-polls wait on."""
        return self._polls.setdefault(site, threading.Condition(self._lock))

    @property
    def polling(self) -> int:
        """How many sites have long-polled at least once."""
        return len(self._polls)

    def wake(self, sites: Iterable[str] | None = None) -> None:
        """Wake the long-polls of these sites only (every site's when None): a task for them may have appeared."""
        for site in (list(self._polls) if sites is None else sites):
            polls = self._polls.get(site)
            if polls is not None:
                polls.notify_all()

    def rows(self, dataset: str) -> dict[str, int]:
        """Training rows per site for a dataset, as the sites reported them when they joined."""
        return {site: rows[dataset] for site, rows in self._rows.items() if dataset in rows}


# What sites send, as the service hands it to the engine (no protobuf past the service).
@dataclass(frozen=True)
class JoinInfo:
    """A site's Join: what it runs, which data it maps, and the serial of the certificate it joined with
    (None where unknown, e.g. a test's engine)."""

    agent_version: str = ""
    models: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    policy_digest: str = ""
    dataset_rows: dict[str, int] = field(default_factory=dict)   # training rows per mapped dataset
    serial: int | None = None
    relay: bool = False                          # a relay's certificate joined (it sends partial sums)
    children: tuple[str, ...] = ()               # a relay's children at its Join


@dataclass(frozen=True)
class Binding:
    """What ties an answer to its task: the task id, its job and round, and the task's nonce."""

    task_id: str
    job_id: str
    round: int
    nonce: bytes


@dataclass(frozen=True)
class Partial:
    """A relay's update is its children's exact partial sum: how many updates are in it, and whose."""

    updates: int
    contributors: tuple[str, ...] = ()


@dataclass
class UpdateHeader:
    """The header of an update stream (or of a masked input under secure aggregation)."""

    task: Binding
    num_samples: int
    layout: Layout | None                     # None when the manifest could not be read: `problem` says why
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    problem: IntegrityError | None = None
    partial: Partial | None = None            # from a relay: its children's exact sum (service-checked)

    def require_layout(self) -> Layout:
        if self.layout is None:
            raise self.problem or IntegrityError("the update header carries no manifest")
        return self.layout


@dataclass(frozen=True)
class SecaggAnswer:
    """One secure-aggregation answer: `body` "advert" (value: Advert), "shares" (recipient -> ciphertext)
    or "reveal" (peer -> (kind, x, y))."""

    task: Binding
    body: str
    value: object
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskResult:
    """A task answered without an update: evaluated, declined or failed."""

    task: Binding
    status: TaskStatus
    reason: str = ""
    eval_metrics: dict[str, float] = field(default_factory=dict)
