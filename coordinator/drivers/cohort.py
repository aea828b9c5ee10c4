"""Secure aggregation with asynchronous buffers: the cohort a buffer becomes, as state and decisions, no I/O.

Under `privacy.secure_aggregation` an asynchronous job's update never leaves its site in the clear. A site
trains on version vᵢ, keeps Δ = trained − vᵢ, and answers its training task `trained`. It then waits in the
forming cohort. Once `asynchronous.buffer` (K) sites are in it, or `cohort_timeout_s` has passed since the
first one joined and at least max(3, sites.min) are, the cohort starts at the current version v and runs the
synchronous rounds' masked-sum protocol (`SecureRound`: adverts, shares, masked inputs, unmasking, with
dropout recovery), one phase task per member, each with `phase_timeout_s`. Each member computes its own
τ = v − vᵢ and advertises the integer weight quanta(τ)·n (plexus.staleness.fixed_weight; n its samples, 1
under DP); its masked input is then its update times own weight / total weight, so the staleness weights are
applied before masking. The coordinator checks every advert's weight against the τ it knows and the rows the
site reported, and flushes version v + 1 from the unmasked Σ_{U3} w·Δ / Σ_{U3} w, renormalised to FedBuff's
Σ s·n·Δ / Σ n. One cohort runs its phases at a time; sites that finish meanwhile form the next one.

A cohort's tasks carry a round id of their own (`Cohort.round`): the site's secure-aggregation session, its
keys' salt and its signed advert bind (job, round), so an id is never reused within a job. Ids start above
every round number a version or the final evaluation uses (rounds + 2) and count up from the highest id the
job's tasks already carry, so a failed cohort's successor, or a cohort after a restart, gets a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.intake import Upload
from coordinator.secure_round import SecureRound
from coordinator.tasks import TaskGrant
from plexus import staleness
from plexus.config import StalenessSpec
from plexus.errors import IntegrityError, Reason


@dataclass(frozen=True)
class Trained:
    """A site whose update is trained and kept at the site, waiting for a cohort."""

    site: str
    task_id: str      # its training task, recorded 'trained'
    base: int         # the version it trained from
    joined: float     # monotonic time it joined the forming cohort


@dataclass
class Cohort:
    """One running cohort: its members, the secure round its phases run, and the current phase's tasks."""

    round: int                         # the round id its tasks carry (unique within the job)
    version: int                       # v: each member's τ = v − its base
    members: dict[str, Trained]
    secure: SecureRound
    started: float                     # monotonic
    participants: list[str] = field(default_factory=list)      # the current phase's sites
    grants: dict[str, TaskGrant] = field(default_factory=dict)  # the current phase's tasks
    outcomes: dict[str, str] = field(default_factory=dict)      # the current phase's answers so far
    deadline: float = 0.0              # monotonic: the current phase ends
    samples: dict[str, int] = field(default_factory=dict)      # site -> n, read from its advert's weight
    receiving: dict[str, tuple[Upload, Callable[[BaseException], None]]] = field(default_factory=dict)

    def tau(self, site: str) -> int:
        return self.version - self.members[site].base


def cohort_size(joined: list[float], now: float, *, buffer: int, timeout_s: float, floor: int) -> int:
    """How many of the forming cohort's sites (joined: their join times, in order) start a cohort now: K once
    K are in; all of them (at least `floor`) once the first has waited timeout_s; else 0."""
    if len(joined) >= buffer:
        return buffer
    if joined and now - joined[0] >= timeout_s and len(joined) >= floor:
        return len(joined)
    return 0


def advert_samples(spec: StalenessSpec, tau: int, weight: int, rows: int, *, dp: bool) -> int:
    """n from a member's advertised weight, which must be quanta(τ)·n with 1 ≤ n ≤ the rows its site reported
    at Join (n = 1 under DP). A signed advert cannot be re-weighted, so any other weight is refused."""
    quanta = staleness.quanta(spec, tau)
    n, rest = divmod(weight, quanta)
    if rest or n < 1:
        raise IntegrityError(f"the advert's weight {weight} is not s(τ)·n for this member's staleness τ = {tau} "
                             f"(s(τ) = {quanta} / 2**16; any whole multiple of {quanta}); a site weighs its own "
                             "update by the τ it computes from the cohort's version", reason=Reason.NUM_SAMPLES)
    if dp and n != 1:
        raise IntegrityError(f"the advert's weight {weight} is {n} × s(τ) (τ = {tau}), but under privacy.dp every "
                             f"update weighs s(τ) × 1 = {quanta}: DP-FedAvg weighs sites equally",
                             reason=Reason.NUM_SAMPLES)
    if rows == 0:
        raise IntegrityError(f"the advert's weight {weight} is {n} samples × s(τ), but this site reported no "
                             "training rows for the job's dataset when it joined; check that the dataset loads "
                             "at the site, then restart its agent", reason=Reason.NUM_SAMPLES)
    if n > rows:
        raise IntegrityError(f"the advert's weight {weight} is {n} samples × s(τ) (τ = {tau}), beyond the {rows} "
                             "training rows this site reported for the job's dataset when it joined",
                             reason=Reason.NUM_SAMPLES)
    return n
