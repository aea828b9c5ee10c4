"""Drivers: what runs one job's life on the engine.

The engine owns the lock, its thread, the job queue and the public calls; it hands the active job to a
driver and asks it, under the engine lock, what to do. `SyncRounds` (drivers/sync.py) is the synchronous
round cycle; `AsyncRounds` (drivers/async_.py) makes model versions from staleness-weighted buffers of
updates, its tasks not tied to a round. The protocol is kept small so that other drivers (a
split-learning session) fit behind it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from coordinator.intake import Upload
from coordinator.model_worker import ModelLimits, ModelWorker
from coordinator.served import Held, ServedModel
from coordinator.store import Store
from coordinator.tasks import Presence, SecaggAnswer, TaskGrant, TaskResult, UpdateHeader


@dataclass
class Context:
    """What the engine lends its driver: the store, the sites' presence, the clocks, and ways to wake
    the engine's waiters (`notify`: the round loop and admin watches; `presence.wake`: sites' polls)."""

    store: Store
    presence: Presence
    clock: Callable[[], float]          # wall time, for deadlines sites see
    monotonic: Callable[[], float]
    notify: Callable[[], None]
    models: ModelWorker
    model_limits: ModelLimits
    rejoin_grace_s: float = 0.0
    saved: Callable[[int], None] = lambda round_: None   # a round's checkpoint is written (storage is back)


class Driver(Protocol):
    """One job's life on the engine. Every method but `prepare` is called with the engine lock held and
    must not block; `ended` turns True once the job needs nothing more (completed, failed, budget spent)."""

    job_id: str
    ended: bool

    def prepare(self) -> None:
        """Slow work the next step needs (e.g. ε for the next round), called outside the engine lock."""

    def tick(self, now: float) -> float:
        """Move the job on at monotonic time `now`; seconds until the driver wants to be asked again."""

    def grant(self, site: str) -> TaskGrant | None:
        """The task this site should do now (the same one again if it already holds it), or None."""

    def busy(self) -> Iterable[str]:
        """Sites holding a task they have not answered: present, even if silent for a while."""

    def current(self, site: str, task_id: str, round_: int, status: str) -> TaskGrant:
        """The grant `task_id` (of `round_`, stored with `status`) answers; RoundClosed if it is no longer
        current, FailedPrecondition if it was answered already (a replay)."""

    def served(self, grant: TaskGrant, held: Held | None = None, *, zero_base: bool = False) -> ServedModel:
        """The model a task's site fetches; `held` is the model the site says it holds (a delta's base), and
        `zero_base` whether it decodes a delta from zeros (ModelHeader.zero_base)."""

    def upload(self, site: str, grant: TaskGrant, header: UpdateHeader,
               cut: Callable[[BaseException], None]) -> Upload:
        """An update about to stream in for `grant`: header checked, its fold begun. `cut(exc)` ends the
        stream (the driver calls it should the round close under it). The engine streams the chunks into
        the Upload without its lock, then calls exactly one of accepted/refused, and always ended_upload."""

    def accepted(self, site: str, grant: TaskGrant, header: UpdateHeader, upload: Upload) -> str:
        """The upload arrived whole and valid: count it (or refuse it, raising); returns the reply."""

    def refused(self, site: str, grant: TaskGrant, upload: Upload, exc: BaseException) -> None:
        """The upload's stream failed part-way with exc (an invalid chunk, a stall, a broken stream)."""

    def ended_upload(self, site: str, upload: Upload) -> None:
        """After every upload: whatever of it is in a sum and was not accepted comes out again."""

    def answered(self, site: str, grant: TaskGrant, answer: SecaggAnswer | TaskResult) -> str:
        """An answer without an update stream (a secure-aggregation message, an evaluation, a decline or a
        failure); returns the reply."""

    def stop(self, why: str, *, dropped: bool = False) -> None:
        """The job is set aside (aborted, failed, the state dir failed): cut uploads, drop what is held.
        `dropped`: the state dir failed; the open round is also closed in the store as failed, with `why`."""
