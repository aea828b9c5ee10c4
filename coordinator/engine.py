"""The one round loop: jobs run one at a time, rounds open, collect updates, close.

Concurrency: every public method takes the engine's lock. The background
thread (and admin watches) wait on one condition over it; each site's NextTask
long-polls wait on that site's own condition, woken only when a task for that
site appears (a round or secure phase opens for it) or the engine stops, so idle
sites cost nothing between their poll timeouts. The background thread opens
rounds once enough sites are online and closes them on quorum or deadline.
Durable effects go through the Store in one transaction each, checkpoint first,
so a SIGKILL at any point resumes from the last closed round.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import re
import secrets
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator.aggregate import Fold, WeightedSum
from coordinator.secure_round import SecureRound
from coordinator.store import TERMINAL, JobRow, Store
from coordinator.strategies import Update, make_strategy
from plexus.config import (MAX_ROUND_CONFIG_BYTES, RoundConfig, dump_round_config, ensemble_members,
                           parse_round_config)
from coordinator.events import admin_actor
from plexus.errors import (ConfigError, FailedPrecondition, IntegrityError, NotFound, PermissionDenied,
                           PlexusError, Reason, RoundClosed, TimedOut)
from coordinator.model_worker import ModelLimits, ModelWorker, shared_worker
from plexus.accounting import client_epsilon, load_client_accountant, round_sampling_rate
from plexus.dp import NOT_PRIVATE, add_noise, noise_key
from plexus.text import bounded
from plexus.wire import DTYPES, FLOAT_DTYPES, Layout, Receiver, decode, encode

log = logging.getLogger("plexus.coordinator")

MAX_METRICS = 64
SPOOL_READ_BYTES = 4 << 20
STORAGE_RETRY_S = 5.0
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


@dataclass(frozen=True)
class TaskGrant:
    """What NextTask hands a site."""

    kind: str                 # "train" | "evaluate"
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


@dataclass
class RoundState:
    round: int
    kind: str
    model_round: int
    participants: list[str]
    deadline: float                          # monotonic
    total: WeightedSum | None
    grants: dict[str, TaskGrant] = field(default_factory=dict)
    outcomes: dict[str, str] = field(default_factory=dict)
    # Sites whose update is arriving now -> what ends its stream (the round closing under it).
    receiving: dict[str, Callable[[BaseException], None]] = field(default_factory=dict)
    contributors: list[str] = field(default_factory=list)
    samples: int = 0
    secure: SecureRound | None = None        # set for secure-aggregation training rounds
    held: list[tuple[str, int, Path]] = field(default_factory=list)   # (site, samples, spool) for holds_updates
    folding: dict[str, tuple[Fold, Path]] = field(default_factory=dict)   # updates entering `total`, with journals
    # Sites that only evaluate the incoming model this round (sites.evaluate: all).
    evaluators: list[str] = field(default_factory=list)
    eval_grants: dict[str, TaskGrant] = field(default_factory=dict)
    eval_outcomes: dict[str, str] = field(default_factory=dict)
    # Weight bounds, fixed when the round opens: the job dataset's training rows each site reported at Join,
    # and the most a trainer's update (caps) or an evaluation result (eval_caps) may weigh.
    rows: dict[str, int] = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)
    eval_caps: dict[str, int] = field(default_factory=dict)
    late: str = "before the round closed"   # why a task still unanswered at the close is late

    def check_rows(self, site: str, num_samples: int) -> None:
        """Refuse a num_samples beyond the training rows the site reported at Join."""
        rows = self.rows.get(site, 0)
        if rows == 0:
            raise IntegrityError(f"num_samples {num_samples}: this site reported no training rows for the job's "
                                 "dataset when it joined, and an update weighs at most its site's reported rows; "
                                 "check that the dataset loads at the site, then restart its agent",
                                 reason=Reason.NUM_SAMPLES)
        if num_samples > rows:
            raise IntegrityError(f"num_samples {num_samples} exceeds the {rows} training rows this site reported "
                                 "for the job's dataset when it joined; an update weighs at most its site's rows",
                                 reason=Reason.NUM_SAMPLES)

    def weight(self, site: str, num_samples: int) -> int:
        """What a site's update weighs: its num_samples (refused beyond its rows), capped at its largest share."""
        self.check_rows(site, num_samples)
        return min(num_samples, self.caps.get(site, 1))

    def grant_of(self, site: str) -> TaskGrant | None:
        return self.grants.get(site) or self.eval_grants.get(site)

    def outcomes_for(self, site: str) -> dict[str, str]:
        """Where a site's answer is recorded: evaluate-only sites apart from the round's trainers."""
        return self.eval_outcomes if site in self.eval_grants else self.outcomes

    def drop_held(self) -> None:
        for _, _, path in self.held:
            path.unlink(missing_ok=True)
        self.held.clear()

    def end_uploads(self, why: str) -> None:
        """Cut every update still arriving: each frees its thread and transfer slot now, not when its sender
        finishes (or never does). Their outcomes are the closing round's to record."""
        for cut in self.receiving.values():
            cut(RoundClosed(why))


@dataclass
class ActiveJob:
    row: JobRow
    cfg: RoundConfig
    strategy: object
    layout: Layout
    state: dict[str, np.ndarray]
    blob: bytes
    model_round: int
    round: RoundState | None = None
    budget_stop: str = ""                    # set when the next round would exceed dp.target_epsilon
    source: tuple | None = None              # (path, data offset) of the checkpoint served when blob is None
    served_layout: Layout | None = None      # model + the strategy's served tensors (SCAFFOLD's c)
    served_blob: bytes | None = None
    update_layout: Layout | None = None      # model + the tensors every update adds (SCAFFOLD's Δc)
    activated: float = 0.0                   # monotonic time the engine took the job up
    opened_any: bool = False                 # a round has opened since then
    total: WeightedSum | None = None         # the running sum, kept from round to round (round_sum)
    retried: dict[int, int] = field(default_factory=dict)   # round -> times it was opened again (sites.retries)
    epsilons: dict[int, float] = field(default_factory=dict)   # DP: ε after round n, computed as it opened
    rates: dict[int, float] | None = None    # DP: round n's sampling rate q (read from the ledger once)

    @property
    def in_memory(self) -> bool:
        """Whether the engine itself reads the global model (else sites stream it from the checkpoint file)."""
        s = self.strategy
        return bool(s.uses_current or s.holds_updates or self.cfg.privacy.dp is not None
                    or self.cfg.privacy.secure_aggregation or self.update_layout != self.layout)

    def round_sum(self, sites: int) -> WeightedSum:
        """An empty running sum for the next round's `sites` sites: the job's one sum, zeroed in place.
        Faulting in a fresh model-sized array every round cost more than folding an update into it
        (docs/performance.md)."""
        if self.total is None or self.total.layout != self.update_layout:
            self.total = WeightedSum(self.update_layout, sites=sites)
        else:
            self.total.reset(sites=sites)
        return self.total

    def set_model(self, layout: Layout, blob) -> None:
        """The new global model; what sites fetch is it plus whatever the strategy serves with it."""
        self.layout, self.blob, self.source = layout, blob, None
        self.state = decode(layout, blob)
        extra = self.strategy.served(self.state)
        if extra:
            self.served_layout, self.served_blob = encode({**self.state, **extra})
        else:
            self.served_layout, self.served_blob = layout, blob
        self.update_layout = Layout.build(
            [(t.name, t.dtype, t.shape) for t in layout.tensors] + list(self.strategy.update_extras(layout)))


def site_seed(job_seed: int, round_: int, site: str) -> int:
    """A per-site, per-round training seed: reproducible, different for every site and round."""
    digest = hashlib.sha256(f"plexus/v1/site-seed/{job_seed}/{round_}/{site}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def weight_caps(rows: dict[str, int], max_share: float) -> dict[str, int]:
    """Each site's largest weight in a round of these sites (site -> training rows reported at Join):
    its own rows, and at most `max_share` of the round's total should every other site weigh in with all
    of its rows. Fixed from what every site reported, so a site claiming huge numbers cannot raise its own
    cap; a site alone in its round carries the whole weight whatever it is, and every cap is at least 1."""
    total = sum(rows.values())
    caps = {}
    for site, own in rows.items():
        cap = own
        if max_share < 1 and len(rows) > 1:
            cap = min(own, math.floor(max_share / (1 - max_share) * (total - own)))
        caps[site] = max(1, cap)
    return caps


REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_NOT_RESUMABLE = {"queued": "it has not started yet", "running": "it is running",
                  "completed": "it has ended; submit it again to train more",
                  "budget_reached": "it spent its privacy budget (dp.target_epsilon)",
                  "aborted": "an aborted job stays aborted; submit it again"}


def check_request_id(request_id: str) -> None:
    """A submission's request id: empty (no idempotency) or 1-128 characters of A-Z a-z 0-9 . _ -."""
    if request_id and not REQUEST_ID.fullmatch(request_id):
        shown = repr(request_id[:40]) + ("…" if len(request_id) > 40 else "")
        raise ConfigError(f"request_id {shown} ({len(request_id)} characters) is not valid: use 1-128 letters, "
                          "digits, '.', '_' or '-', one per submission and the same on its retries (`plexus job "
                          "submit` makes a random one)")


def _same_submission(request_id: str, recorded: str, digest: str, what: str) -> None:
    if recorded != digest:
        raise FailedPrecondition(f"request id {request_id!r} {what} with a different round config; a retry must "
                                 "send the same config, and a new submission needs a new request id (`plexus job "
                                 "submit` makes one per run)")


def validate_job(cfg: RoundConfig, *, build: Path, models: ModelWorker | None = None,
                 limits: ModelLimits = ModelLimits()) -> dict[str, np.ndarray]:
    """Everything the coordinator can check at submit time, with a message that says how to fix it.

    Builds the initial model (in the model worker process, within `limits`; the coordinator never
    imports torch) into the safetensors file `build` and returns its weights.
    """
    make_strategy(cfg)   # refuses unknown strategies, bad args and combinations that cannot work
    try:
        state = (models or shared_worker()).build(cfg.model.name, dict(cfg.model.args), seed=cfg.seed, out=build,
                                                  members=ensemble_members(cfg), limits=limits)
    except ConfigError as exc:
        raise ConfigError(f"model: {exc}") from None
    float_only = all(t.dtype in FLOAT_DTYPES for t in Layout.of(state).tensors)
    if cfg.privacy.secure_aggregation:   # make_strategy has refused strategies it cannot compute
        if not float_only:
            raise ConfigError("privacy.secure_aggregation: the model has integer tensors; secure aggregation "
                              "sums floating-point updates only")
    if cfg.privacy.dp is not None and not float_only:
        raise ConfigError("privacy.dp: the model has integer tensors; DP-FedAvg clips and noises floating-point "
                          "updates only")
    return state


class Engine:
    def __init__(self, store: Store, *, federation: str = "", poll_timeout_s: float = 20.0,
                 rejoin_grace_s: float = 0.0, clock=time.time, monotonic=time.monotonic, on_death=lambda: None,
                 models: ModelWorker | None = None, model_limits: ModelLimits = ModelLimits()):
        self.store = store
        self.models = models or shared_worker()   # builds initial models, never under the lock
        self.model_limits = model_limits
        self.federation = federation
        self.poll_timeout_s = poll_timeout_s
        self.online_window_s = 2 * poll_timeout_s + 10
        self.rejoin_grace_s = rejoin_grace_s
        self._clock, self._mono = clock, monotonic
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)   # the round loop and admin watches wait here
        self._polls: dict[str, threading.Condition] = {}   # site -> its long-polls' condition, on the same lock
        self.poll_wakeups = 0                        # long-polls woken before their timeout (a test hook)
        self._seen: dict[str, float] = {}
        self._rows: dict[str, dict[str, int]] = {}   # site -> dataset -> training rows, as reported at Join
        self._active: ActiveJob | None = None
        self._submitting: dict[tuple[str, str], str] = {}   # (admin, request id) -> config SHA-256, being built
        self._stopping = False
        self.on_death = on_death            # called if the engine thread ever ends other than by stop()
        self.storage_retry_s = STORAGE_RETRY_S
        self._storage_trouble = ""          # the state dir's failure last logged, until a round is saved again
        self._retry_at = 0.0                # monotonic: no tick before this, after a storage failure
        self._thread = threading.Thread(target=self._run, name="plexus-engine", daemon=True)

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.store.interrupt_open_rounds()
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            self._wake(self._polls)
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:   # never a silent death: the log says so and health turns NOT_SERVING
            log.critical("the round engine stopped; no job makes progress until the coordinator is restarted",
                         exc_info=True)
            self.on_death()

    def _loop(self) -> None:
        while True:
            self._account()
            with self._cv:
                if self._stopping:
                    return
                if (wait := self._retry_at - self._mono()) > 0:
                    self._cv.wait(wait)
                    continue
                try:
                    try:
                        timeout = self._tick()
                    except Exception as exc:  # the loop must survive; the job is failed with the reason
                        if _storage_failure(exc):
                            raise
                        log.exception("round engine error")
                        self._fail_active("internal error in the round engine; see the coordinator log")
                        timeout = 0.5
                except Exception as exc:   # also while failing a job: that needs the disk as well
                    if not _storage_failure(exc):
                        raise
                    self._storage_failed(exc)
                    continue
                self._cv.wait(timeout)

    def _account(self) -> None:
        """Load the ε accountant outside the engine lock while a DP job is active: the import (dp-accounting
        and scipy) is paid once per process, so the first ε, computed when a round opens, is milliseconds."""
        job = self._active   # read without the lock: at worst it is loaded for a job just set aside
        if job is not None and job.cfg.privacy.dp is not None:
            load_client_accountant()

    def _epsilon_if(self, job: ActiveJob, q: float) -> float:
        """ε after the job's next round if it runs at sampling rate q, kept (with q) for its ledger: every
        closed round's q (from the privacy ledger; 1 where none is recorded) composed with this one."""
        dp, n = job.cfg.privacy.dp, job.model_round + 1
        if job.rates is None:
            job.rates = {m.round: m.value for m in self.store.metrics(job.row.id)
                         if m.site == "" and m.kind == "privacy" and m.name == "sampling_rate"}
        if job.rates.get(n) != q or n not in job.epsilons:   # a round waiting for its quorum asks again
            rates = [job.rates.get(r, 1.0) for r in range(1, n)]
            job.rates[n], job.epsilons[n] = q, client_epsilon(dp.noise_multiplier, [*rates, q], dp.delta)
        return job.epsilons[n]

    def _storage_failed(self, exc: Exception) -> None:
        """The state dir cannot be written (a full disk) or read: fail nothing. The round in progress is
        dropped with the job's in-memory state, and the job, still running at its last closed round, is
        taken up again from its checkpoint every storage_retry_s until the store works: the round reruns."""
        text = f"{type(exc).__name__}: {exc}"
        if text != self._storage_trouble:   # once per distinct failure, not once per retry
            log.error("cannot use the state dir %s (%s); the round in progress is dropped and the job resumes "
                      "from its last checkpoint once it can", self.store.state_dir, text, exc_info=exc)
            self._storage_trouble = text
        self._retry_at = self._mono() + self.storage_retry_s
        job, self._active = self._active, None
        if job is None:
            return
        message = f"{text}; the round runs again once the coordinator can write its state dir"
        if job.round:
            job.round.end_uploads(f"round {job.round.round} was dropped: {message}")
        with contextlib.suppress(OSError, sqlite3.Error):   # the disk may refuse this too; the log has it
            if job.round:
                job.round.drop_held()
                self.store.close_round(job.row.id, job.round.round, status="failed", message=message,
                                       contributors=sorted(job.round.contributors), total_samples=job.round.samples)
            self.store.interrupt_open_rounds()
        self._cv.notify_all()

    # admin side --------------------------------------------------------------------------
    def submit(self, config_yaml: str, who: str, request_id: str = "") -> str:
        """Validate a round config, build its model and queue the job; its id.

        With a request_id, the submission is idempotent per admin: a repeat (a client's retry after
        its deadline passed) returns the job the first one created, also while that one is still
        building its model, and a repeat with another config is refused.
        """
        check_request_id(request_id)
        cfg = parse_round_config(config_yaml, source="submitted round config")
        canonical = dump_round_config(cfg)   # what every site parses, every default written out: it must fit too
        encoded = canonical.encode()
        if len(encoded) > MAX_ROUND_CONFIG_BYTES:
            raise ConfigError(f"submitted round config: written out with its defaults (as sites receive it) it is "
                              f"{len(encoded)} bytes, over the limit of {MAX_ROUND_CONFIG_BYTES}; "
                              "shorten its lists (features, categories, classes)")
        request = (request_id, hashlib.sha256(encoded).hexdigest()) if request_id else None
        if request is not None:
            with self._cv:
                known = self._submitted(who, *request)
                if known is not None:
                    log.info("job %s: %s repeated submission %s; no new job", known, who, request_id)
                    return known
                self._submitting[(who, request_id)] = request[1]
        try:
            job_id = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
            build = self.store.spool / f"{job_id}.initial.safetensors"
            try:
                initial = validate_job(cfg, build=build, models=self.models, limits=self.model_limits)
                self.store.save_checkpoint(job_id, 0, initial)   # the job's round 0, before it is visible
            finally:
                build.unlink(missing_ok=True)
            with self._cv:
                self.store.add_job(job_id, cfg.name, canonical, cfg.strategy.name, cfg.rounds, who, request=request)
                self._cv.notify_all()
            return job_id
        finally:
            if request is not None:
                with self._cv:
                    del self._submitting[(who, request_id)]
                    self._cv.notify_all()

    def _submitted(self, who: str, request_id: str, digest: str) -> str | None:
        """The job an earlier submission of `request_id` by `who` created, waiting for it while it is still
        being built (Engine.submit builds outside the lock); None if there was none or it failed. Call with
        the engine lock held."""
        if (who, request_id) in self._submitting:
            log.info("submission %s by %s repeated while the first is still building its model; it waits for it",
                     request_id, who)
        while (building := self._submitting.get((who, request_id))) is not None:
            _same_submission(request_id, building, digest, "is being submitted now")
            if self._stopping:
                raise FailedPrecondition("the coordinator is shutting down; submit again once it is back")
            self._cv.wait(1.0)
        known = self.store.submission(who, request_id)
        if known is None:
            return None
        job_id, recorded = known
        _same_submission(request_id, recorded, digest, f"already submitted job {job_id}")
        return job_id

    def resume(self, job_id: str, who: str) -> None:
        """Run a failed job again from its last closed round; refused unless that can work."""
        row = self.store.job(job_id)
        self._check_resumable(row)   # reads the checkpoint through: not under the engine lock
        with self._cv:
            row = self.store.job(job_id)
            self._check_resumable(row, verify=False)   # still failed: no one resumed or removed it meanwhile
            message = f"resumed by {who} after round {row.current_round}"
            self.store.set_job(job_id, status="running", message=message,
                               event=("job_resume_requested", row.current_round, "", f"{message} (it had failed: "
                                      f"{bounded(row.message)})"), actor=admin_actor(who))
            self._cv.notify_all()

    def _check_resumable(self, row: JobRow, *, verify: bool = True) -> None:
        if row.status != "failed":
            raise FailedPrecondition(f"job {row.id} is {row.status}; only a failed job can be resumed "
                                     f"({_NOT_RESUMABLE.get(row.status, 'it has not failed')})")
        if not verify:
            return
        try:
            self._strategy_at(parse_round_config(row.config_yaml, source=f"job {row.id}"), row.id, row.current_round)
            self.store.checkpoint_blob(row.id, row.current_round)
        except (ConfigError, NotFound, IntegrityError) as exc:
            raise FailedPrecondition(f"job {row.id} cannot be resumed: {exc}") from None

    def abort(self, job_id: str, who: str) -> None:
        with self._cv:
            row = self.store.job(job_id)
            if row.status in TERMINAL:
                raise FailedPrecondition(f"job {job_id} is already {row.status}; only queued or running jobs can be aborted")
            self.store.set_job(job_id, status="aborted", message=f"aborted by {who}",
                               event=("job_aborted", row.current_round, "", f"aborted by {who}"),
                               actor=admin_actor(who))
            if self._active and self._active.row.id == job_id:
                if self._active.round:
                    self._active.round.drop_held()
                    self._active.round.end_uploads(f"job {job_id} was aborted by {who}")
                self._active = None
                self.store.interrupt_open_rounds()
            self._cv.notify_all()

    def wait_events(self, job_id: str, after_id: int, timeout: float) -> list[tuple]:
        with self._cv:
            events = self.store.events_after(job_id, after_id)
            if not events:
                self._cv.wait(timeout)
                events = self.store.events_after(job_id, after_id)
            return events

    def online_sites(self) -> set[str]:
        with self._cv:
            return self._present()

    # site side ---------------------------------------------------------------------------
    def join(self, site: str, *, agent_version: str, models: list[str], datasets: list[str], policy_digest: str,
             dataset_rows: dict[str, int] | None = None) -> None:
        with self._cv:
            self._seen[site] = self._mono()
            self._rows[site] = dict(dataset_rows or {})
            self.store.site_seen(site, agent_version=agent_version, models=models, datasets=datasets,
                                 policy_digest=policy_digest)
            self._cv.notify_all()

    def next_task(self, site: str, wait_s: float) -> TaskGrant | None:
        end = self._mono() + max(0.0, min(wait_s, self.poll_timeout_s))
        with self._cv:
            self.store.site_seen(site)
            if self._touch(site):
                self._cv.notify_all()   # back online: the round loop may now have its quorum
            polls = self._polls.setdefault(site, threading.Condition(self._lock))
            while True:
                grant = self._grant(site)
                remaining = end - self._mono()
                if grant or remaining <= 0 or self._stopping:
                    self._seen[site] = self._mono()
                    return grant
                if polls.wait(remaining):
                    self.poll_wakeups += 1

    def model_for(self, site: str, task_id: str) -> tuple[Layout, object, str, int]:
        """The global model a task needs: its blob in memory, or (path, offset) of its checkpoint file."""
        with self._cv:
            self._touch(site)
            job, rs, grant = self._current_grant(site, task_id)
            if job.served_blob is not None:
                return job.served_layout, job.served_blob, job.row.id, rs.model_round
            return job.layout, job.source, job.row.id, rs.model_round

    def submit_update(self, site: str, header, chunks: Iterable,
                      cut: Callable[[BaseException], None] = lambda exc: None) -> str:
        """Receive one site's update, validating it chunk by chunk.

        A summed update (FedAvg and the other mean-based rules) is folded into the round's sum as its
        chunks arrive; its spool file is only the journal that takes it out again should it fail, be
        refused, or still be arriving when the round closes. Masked inputs and the updates of rules
        that hold them are spooled first and used once complete. `cut(exc)` makes `chunks` raise exc:
        the round calls it when it closes while the update is still arriving. A stream that stalls
        (`chunks` raises TimedOut) is recorded late.
        """
        with self._cv:
            self._touch(site)
            job, rs, grant = self._current_grant(site, header.task_id)
            masked = grant.kind == "secagg_mask"
            self._check_binding(grant, header.job_id, header.round, header.nonce,
                                "secagg_mask" if masked else "train")
            if site in rs.receiving:
                raise FailedPrecondition(f"an update for task {grant.task_id} is already being received")
            layout = rs.secure.masked_layout if masked else job.update_layout
            dp = job.cfg.privacy.dp
            try:
                if not masked and not 1 <= header.num_samples <= 2 ** 31:
                    raise IntegrityError(f"num_samples must be between 1 and 2**31; got {header.num_samples}",
                                         reason=Reason.NUM_SAMPLES)
                weight = header.num_samples if masked else rs.weight(site, header.num_samples)
                metrics = _kept(job, _site_metrics(rs, site, header.eval_metrics, header.metrics, weight))
                layout.require_same(Layout.from_proto(header.manifest),
                                    what="masked input" if masked else "update")
                spool = self.store.spool / f"{grant.task_id}.part"
                fold = None
                if not masked and rs.total is not None:
                    # DP-FedAvg and some strategies (SCAFFOLD) weigh each site the same
                    uniform = dp is not None or job.strategy.uniform_weights
                    fold = rs.total.begin(1 if uniform else weight)
                    rs.folding[site] = (fold, spool)
            except IntegrityError as exc:
                self._record(rs, grant, site, "rejected", str(exc), code=exc.reason)
                raise
            rs.receiving[site] = cut
        try:
            try:
                _receive_to(spool, layout, chunks, fold)
            except IntegrityError as exc:
                self._refuse(site, grant, "rejected", exc)
                raise
            except TimedOut as exc:   # a stalled upload frees its slot and the round waits for it no longer
                self._refuse(site, grant, "late", exc)
                raise
            except BaseException:
                with self._cv:
                    rs.receiving.pop(site, None)   # a broken stream may be retried while the round is open
                raise
            with self._cv:
                rs.receiving.pop(site, None)
                if self._active is not job or job.round is not rs or rs.grants.get(site) is not grant \
                        or site in rs.outcomes:
                    raise RoundClosed(f"round {grant.round} of job {grant.job_id} closed before the update was complete")
                if masked:
                    rs.secure.masked.fold(_read_blocks(spool), nbytes=spool.stat().st_size)
                    self._record(rs, grant, site, "submitted", "")
                    return f"masked input for round {grant.round} accepted"
                try:
                    if dp is not None:
                        _check_clipped(spool, layout, job.state, dp.clip_norm)
                    if job.strategy.holds_updates:   # robust rules and ensembles need every update at once
                        held = spool.with_suffix(".held")
                        spool.rename(held)
                        rs.held.append((site, weight, held))
                    else:
                        fold.finish()
                        del rs.folding[site]   # in for good
                except IntegrityError as exc:
                    self._record(rs, grant, site, "rejected", str(exc), code=exc.reason)
                    raise
                rs.contributors.append(site)
                rs.samples += 1 if dp is not None else weight   # under DP, no site's row count
                self._record(rs, grant, site, "submitted", "", metrics)
                capped = (f", weighted as {weight}: sites.max_weight_share caps one site's share"
                          if weight < header.num_samples else "")
                return f"update for round {grant.round} accepted ({header.num_samples} samples{capped})"
        finally:
            with self._cv:   # serialised with a closing round's withdrawals, so the journal outlives its reader
                self._withdraw(rs, site)
                self._touch(site)   # an upload longer than the online window is presence, not absence
            spool.unlink(missing_ok=True)

    @staticmethod
    def _withdraw(rs: RoundState, site: str) -> None:
        """Take a site's update back out of the round's sum if it is (partly) in and was not accepted.
        Call with the engine lock held."""
        entry = rs.folding.pop(site, None)
        if entry is not None:
            fold, journal = entry
            fold.undo(lambda: _read_blocks(journal))

    def secagg(self, site: str, message, body: str, value) -> str:
        """One secure-aggregation answer: an advert, the encrypted shares, or the unmasking reveals."""
        phase_kind = {"advert": "secagg_advertise", "shares": "secagg_share", "reveal": "secagg_unmask"}[body]
        with self._cv:
            self._touch(site)
            job, rs, grant = self._current_grant(site, message.task_id)
            self._check_binding(grant, message.job_id, message.round, message.nonce, phase_kind)
            try:
                if body == "advert":
                    rs.check_rows(site, value.num_samples)   # a signed advert cannot be re-weighted, only refused
                    rs.secure.on_advert(site, value)
                    metrics = _kept(job, _site_metrics(rs, site, message.eval_metrics, message.metrics,
                                                       value.num_samples))
                elif body == "shares":
                    rs.secure.on_shares(site, value)
                else:
                    rs.secure.on_reveal(site, value)
            except IntegrityError as exc:
                self._record(rs, grant, site, "rejected", str(exc), code=exc.reason)
                raise
            self._record(rs, grant, site, "submitted", "", metrics if body == "advert" else None)
            return f"{body} for round {grant.round} accepted"

    def report(self, site: str, result, status: str) -> str:
        with self._cv:
            self._touch(site)
            job, rs, grant = self._current_grant(site, result.task_id)
            self._check_binding(grant, result.job_id, result.round, result.nonce, None)
            reason = bounded(result.reason)   # the site's own words, stored and shown: 2 KiB at most
            if status == "declined":
                self.store.decline(job.row.id, site, reason or "declined by site policy")
                self._record(rs, grant, site, "declined", reason or "declined by site policy")
                return "decline recorded; this site will not be asked again for this job"
            if status == "failed":
                self._record(rs, grant, site, "failed", reason or "the site reported a failure")
                return "failure recorded"
            if grant.kind != "evaluate":
                raise FailedPrecondition("a training task is answered with SubmitUpdate, not an evaluation result")
            self._record(rs, grant, site, "evaluated", "", _kept(job, _site_metrics(rs, site, result.eval_metrics)))
            return "evaluation recorded"

    # internals ---------------------------------------------------------------------------
    def _record(self, rs: RoundState, grant: TaskGrant, site: str, status: str, reason: str,
                metrics: dict | None = None, *, code: Reason | None = None) -> None:
        """Record a site's task outcome; `code` says why a rejected update was refused (IntegrityError.reason)."""
        rs.outcomes_for(site)[site] = status
        reason = bounded(reason)
        self.store.finish_task(grant.task_id, status, reason, job_id=grant.job_id, round_=grant.round,
                               site=site, metrics=metrics, code=code)
        if reason:
            log.info("job %s round %d site %s: %s (%s)", grant.job_id, grant.round, site, status, reason)
        self._cv.notify_all()

    def _refuse(self, site: str, grant: TaskGrant, status: str, exc: PlexusError) -> None:
        """Record an update refused part-way (rejected, or late: it stalled), if its round is still open."""
        with self._cv:
            job = self._active
            if job and job.round and job.round.round == grant.round and job.row.id == grant.job_id:
                job.round.receiving.pop(site, None)
                if site not in job.round.outcomes:
                    self._record(job.round, grant, site, status, str(exc), code=getattr(exc, "reason", None))

    def _current_grant(self, site: str, task_id: str) -> tuple[ActiveJob, RoundState, TaskGrant]:
        row = self.store.task(task_id)
        if row is None:
            raise NotFound(f"no task {task_id!r}; ask for a new task with NextTask")
        _, job_id, round_, owner, _, _, status = row
        if owner != site:
            raise PermissionDenied(f"task {task_id} was issued to another site; a site may only answer its own tasks")
        job = self._active
        rs = job.round if job and job.row.id == job_id else None
        grant = rs.grant_of(site) if rs is not None and rs.round == round_ else None
        if grant is None or grant.task_id != task_id:
            raise RoundClosed(f"task {task_id} is no longer current: round {round_} of job {job_id} has closed or "
                              "moved to its next phase")
        if status != "issued" or site in rs.outcomes_for(site):
            raise FailedPrecondition(f"task {task_id} was already answered ({status}); replays are refused")
        return job, rs, grant

    @staticmethod
    def _check_binding(grant: TaskGrant, job_id: str, round_: int, nonce: bytes, kind: str | None) -> None:
        if (job_id, round_) != (grant.job_id, grant.round) or not secrets.compare_digest(nonce, grant.nonce):
            raise IntegrityError("the submission's (job, round, nonce) does not match the task it answers")
        if kind and grant.kind != kind:
            raise FailedPrecondition(f"task {grant.task_id} is a {grant.kind} task, not a {kind} task")

    def _grant(self, site: str) -> TaskGrant | None:
        job = self._active
        rs = job.round if job is not None else None
        if rs is None:
            return None
        if site in rs.participants and site not in rs.outcomes:
            grants, kind = rs.grants, rs.secure.task_kind if rs.secure else rs.kind
        elif site in rs.evaluators and site not in rs.eval_outcomes:
            grants, kind = rs.eval_grants, "evaluate"
        else:
            return None
        if site not in grants:
            remaining = rs.deadline - self._mono()
            steps = job.strategy.local_steps(site, self._sizes(job)) if kind in ("train", "secagg_advertise") else 0
            grant = TaskGrant(kind=kind, task_id=uuid.uuid4().hex, job_id=job.row.id, round=rs.round,
                              model_round=rs.model_round, config_yaml=job.row.config_yaml,
                              nonce=secrets.token_bytes(16), deadline_unix_s=self._clock() + remaining,
                              seed=site_seed(job.cfg.seed, rs.round, site),
                              payload=rs.secure.payload(site) if rs.secure and grants is rs.grants else None,
                              local_steps=steps)
            self.store.add_task(grant.task_id, job.row.id, rs.round, site, kind, grant.nonce)
            grants[site] = grant
        return grants[site]   # a site that restarted mid-task gets the same task back

    def _sizes(self, job: ActiveJob) -> dict[str, int]:
        """Training rows per site for this job's dataset, as the sites reported them when they joined."""
        name = job.cfg.data.dataset
        return {site: rows[name] for site, rows in self._rows.items() if name in rows}


    def _tick(self) -> float:
        if self._active is None and not self._activate_next():
            return 1.0
        job = self._active
        if job.round is None:
            return self._maybe_open_round(job)
        return self._maybe_close_round(job)

    def _activate_next(self) -> bool:
        pending = [j for j in self.store.jobs() if j.status in ("queued", "running")]
        if not pending:
            return False
        row = next((j for j in pending if j.status == "running"), pending[0])
        cfg = parse_round_config(row.config_yaml, source=f"job {row.id}")
        try:
            strategy = self._strategy_at(cfg, row.id, row.current_round)
            if row.status == "queued":
                layout, blob = self.store.checkpoint_blob(row.id, 0)   # built and saved at submit
                self.store.set_job(row.id, status="running", current_round=0,
                                   event=("job_started", 0, "", f"{cfg.rounds} rounds of {cfg.strategy.name}"))
                if _noise_is_reproducible(cfg):
                    self.store.event(row.id, "dp_not_private", 0, "", NOT_PRIVATE)
                row = self.store.job(row.id)
            else:
                layout, blob = self.store.checkpoint_blob(row.id, row.current_round)
                # A round cut short released nothing (its model is served only once closed), so the
                # re-run round's fresh central noise is that round's only draw: ε is unchanged.
                fresh = (", re-running the next round with fresh central DP noise"
                         if cfg.privacy.dp is not None and cfg.privacy.dp.mode == "central" else "")
                self.store.event(row.id, "job_resumed", row.current_round, "",
                                 f"resuming after round {row.current_round}{fresh}")
        except (ConfigError, NotFound, IntegrityError) as exc:   # e.g. a damaged checkpoint: fail, never retry
            self.store.set_job(row.id, status="failed", message=str(exc), event=("job_failed", 0, "", str(exc)))
            return False
        # The global model exists once: the wire blob; the state dict is views over it. A job
        # whose engine never reads the model (plain FedAvg) serves it from the checkpoint file.
        job = ActiveJob(row, cfg, strategy, layout, {}, blob, row.current_round, activated=self._mono())
        job.set_model(layout, blob)
        if not job.in_memory:
            self._serve_from_checkpoint(job, row.current_round)
        self._active = job
        log.info("job %s active at round %d", row.id, row.current_round)
        if _noise_is_reproducible(cfg):
            log.warning("job %s: %s", row.id, NOT_PRIVATE)
        return True

    def _strategy_at(self, cfg: RoundConfig, job_id: str, round_: int):
        """The job's strategy as it was when round `round_` closed (its checkpointed state; fresh at 0)."""
        strategy = make_strategy(cfg)
        if round_ > 0:
            strategy.load_state(*self.store.load_strategy_state(job_id, round_))
        return strategy

    def _touch(self, site: str) -> bool:
        """The site is present now; True if it was not online until now. Call with the engine lock held."""
        now, last = self._mono(), self._seen.get(site)
        self._seen[site] = now
        return last is None or now - last > self.online_window_s

    def _wake(self, sites: Iterable[str]) -> None:
        """Wake the long-polls of these sites only (a task for them may have appeared). Call with the lock held."""
        for site in sites:
            polls = self._polls.get(site)
            if polls is not None:
                polls.notify_all()

    def _present(self) -> set[str]:
        """Sites online now: seen (any call) within the online window, or holding a task of the open round that
        they have not answered yet: a site training for longer than the window is busy, not gone."""
        now = self._mono()
        online = {s for s, t in self._seen.items() if now - t <= self.online_window_s}
        rs = self._active.round if self._active is not None else None
        if rs is not None:
            online.update(s for s in rs.grants if s not in rs.outcomes)
            online.update(s for s in rs.eval_grants if s not in rs.eval_outcomes)
        return online

    def _eligible_online(self, declined: dict[str, str]) -> list[str]:
        return sorted(self._present() - set(declined))

    def _maybe_open_round(self, job: ActiveJob) -> float:
        """Open the next round if its sites are there; how long until the engine should look again."""
        cfg = job.cfg
        dp = cfg.privacy.dp
        evaluating = job.model_round >= cfg.rounds or bool(job.budget_stop) or job.strategy.done(job.model_round)
        declined = self.store.declines(job.row.id)
        online = self._eligible_online(declined)
        known = sorted({row[0] for row in self.store.sites()} - set(declined))   # registered, online or not
        # A job taken up (after a restart, say) waits for the sites that were in it, or for a new job every
        # registered site, until they are all back or the grace ends: a site reconnecting with backoff is
        # not left out of a round an uninterrupted run would have given it.
        expected = (self.store.job_sites(job.row.id) - set(declined)) or set(known)
        missing = sorted(expected - set(online))
        if missing and not job.opened_any and self._mono() - job.activated < self.rejoin_grace_s:
            self._waiting(job, f"waiting up to {self.rejoin_grace_s:g}s for the job's sites to connect: "
                               + ", ".join(missing))
            return 0.5
        if dp is not None and not job.budget_stop and job.model_round < cfg.rounds:
            # ε of the cohort drawn now, before the round opens: its q is known only once it is drawn.
            cohort = job.strategy.configure(job.model_round + 1, online, known)
            at_random = cfg.sites.fraction is not None or cfg.sites.count is not None
            q = round_sampling_rate(len(cohort), len(online), at_random=at_random)
            after = self._epsilon_if(job, q)
            if dp.target_epsilon is not None and after > dp.target_epsilon:
                job.budget_stop = (f"privacy budget reached: round {job.model_round + 1} would bring ε to "
                                   f"{after:.3f} > target {dp.target_epsilon} (δ={dp.delta}); stopped after "
                                   f"round {job.model_round}")
                self.store.event(job.row.id, "privacy_budget_reached", job.model_round, "", job.budget_stop)
                evaluating = True
        participants = online if evaluating else job.strategy.configure(job.model_round + 1, online, known)
        if len(participants) < (1 if evaluating else cfg.sites.min):
            self._waiting(job, f"waiting for sites: {len(participants)} of {cfg.sites.min} needed are online")
            return 0.5
        job.opened_any = True
        round_ = job.model_round + 1
        kind = "evaluate" if evaluating else "train"
        self.store.open_round(job.row.id, round_, kind)
        self.store.set_job(job.row.id, message="")
        job.row = self.store.job(job.row.id)
        secure = None
        if cfg.privacy.secure_aggregation and not evaluating:
            secure = SecureRound(job.row.id, round_, job.layout, cfg.privacy.secagg, cfg.sites.min)
        summing = not (evaluating or secure or job.strategy.holds_updates)
        evaluators = [] if evaluating or cfg.sites.evaluate != "all" else sorted(set(online) - set(participants))
        sizes, share = self._sizes(job), cfg.sites.max_weight_share
        rows = {s: sizes[s] for s in participants + evaluators if s in sizes}
        job.round = RoundState(round=round_, kind=kind, model_round=job.model_round, participants=participants,
                               deadline=self._mono() + cfg.sites.deadline_s,
                               total=job.round_sum(len(participants)) if summing else None, secure=secure,
                               evaluators=evaluators, rows=rows,
                               caps=weight_caps({s: rows.get(s, 0) for s in participants}, share),
                               eval_caps=weight_caps({s: rows.get(s, 0) for s in participants + evaluators}, share))
        if not evaluating:
            for note in job.strategy.opened(round_, participants, known):
                self.store.event(job.row.id, "strategy", round_, "", note)
        log.info("job %s round %d (%s) opened for %s%s", job.row.id, round_, kind, ", ".join(participants),
                 f"; evaluating: {', '.join(evaluators)}" if evaluators else "")
        self._cv.notify_all()
        self._wake(participants + evaluators)
        return 0.5

    def _waiting(self, job: ActiveJob, message: str) -> None:
        if job.row.message != message:
            self.store.set_job(job.row.id, message=message)
            job.row = self.store.job(job.row.id)

    def _maybe_close_round(self, job: ActiveJob) -> float:
        rs = job.round
        remaining = rs.deadline - self._mono()
        done = all(s in rs.outcomes for s in rs.participants) and not rs.receiving
        if not rs.secure:   # a secure round's phases do not wait for sites that only evaluate
            done = done and all(s in rs.eval_outcomes for s in rs.evaluators)
        if not done and remaining > 0:
            return min(remaining, 1.0)
        if not done:   # the deadline ended it: updates still arriving are cut, their sites late
            rs.late = f"by the round deadline ({job.cfg.sites.deadline_s:g} s)"
            rs.end_uploads(f"round {rs.round} of job {job.row.id} reached its deadline before the update was "
                           "complete (the site is recorded late)")
        if rs.secure:
            self._advance_secure(job, rs)
            self._cv.notify_all()
            return 0.0
        for site in rs.participants:
            if site not in rs.outcomes:
                rs.outcomes[site] = "late"
        for site in list(rs.folding):   # still arriving at the deadline: out of the sum before the mean
            self._withdraw(rs, site)
        if rs.kind == "evaluate":
            evaluated = sorted(s for s, o in rs.outcomes.items() if o == "evaluated")
            message = f"final model evaluated by {len(evaluated)} site(s)"
            status = "budget_reached" if job.budget_stop else "completed"
            if job.budget_stop:
                message = f"{job.budget_stop}; {message}"
            self.store.close_round(job.row.id, rs.round, status="closed", contributors=evaluated, total_samples=0,
                                   message=message, job_update={"status": status, "message": message},
                                   event=("job_completed", message), late=rs.late)
            self._active = None
        elif len(rs.contributors) >= (needed := max(job.cfg.sites.min, job.strategy.min_contributors)):
            try:
                if job.strategy.holds_updates:
                    updates = [Update(site, samples, decode(job.update_layout, np.memmap(path, mode="r")))
                               for site, samples, path in sorted(rs.held)]
                    state = job.strategy.aggregate_updates(rs.round, job.state, updates)
                    del updates
                    rs.drop_held()
                    self._close_training_round(job, rs, state)
                elif not job.in_memory and job.strategy.mean_is_model:
                    # Plain FedAvg: the mean goes block by block into the checkpoint sites then stream.
                    self._close_training_round(job, rs, None, rs.total.mean_blocks())
                else:
                    if not job.strategy.uses_current:
                        job.state = job.blob = job.served_blob = None   # the old model goes before the new one
                    blob = rs.total.mean_blob(release=True)
                    mean = self._central_noise(job, rs, decode(job.update_layout, blob))
                    state = job.strategy.aggregate(rs.round, job.state, mean, sorted(rs.contributors))
                    reuse = state is mean and job.cfg.privacy.dp is None
                    self._close_training_round(job, rs, state, blob if reuse else None)
            except IntegrityError as exc:
                self._fail_round(job, rs, str(exc))
        else:
            problems = ", ".join(f"{s}: {o}" for s, o in sorted(rs.outcomes.items()) if o != "submitted") or "none"
            floor = (f"sites.min={needed}" if needed == job.cfg.sites.min else
                     f"the {needed} updates {job.cfg.strategy.name} needs per round")
            self._fail_round(job, rs, f"{len(rs.contributors)} update(s), below {floor} (other sites — {problems})",
                             retry=True)
        self._cv.notify_all()
        return 0.0

    def _fail_round(self, job: ActiveJob, rs: RoundState, why: str, *, retry: bool = False) -> None:
        """End a round that produced no model: the job fails, unless `retry` (the round missed its quorum)
        and sites.retries allows opening the round again."""
        rs.drop_held()
        done = job.retried.get(rs.round, 0)
        if retry and done < job.cfg.sites.retries:
            try:   # opening the round committed schedule state (cwt's next site): back to the last closed round's
                job.strategy = self._strategy_at(job.cfg, job.row.id, job.model_round)
            except (NotFound, IntegrityError) as exc:
                why = f"{why}; it cannot be opened again: {exc}"
            else:
                self._retry_round(job, rs, why, done + 1)
                return
        message = f"round {rs.round} failed: {why}; the global model is unchanged at round {job.model_round}"
        if retry:
            message += "; once its sites are back, `plexus job resume` runs it again from there"
        self.store.close_round(job.row.id, rs.round, status="failed", contributors=sorted(rs.contributors),
                               total_samples=rs.samples, message=message,
                               job_update={"status": "failed", "message": message}, event=("job_failed", message),
                               late=rs.late)
        self._active = None

    def _retry_round(self, job: ActiveJob, rs: RoundState, why: str, retry: int) -> None:
        """Close the round that missed its quorum; the next tick opens it again once enough sites are online."""
        job.retried[rs.round] = retry
        message = f"round {rs.round} missed its quorum: {why}; opening it again (retry {retry} of " \
                  f"sites.retries={job.cfg.sites.retries})"
        self.store.close_round(job.row.id, rs.round, status="failed", contributors=sorted(rs.contributors),
                               total_samples=rs.samples, message=message, job_update={"message": message},
                               event=("round_retry", message), late=rs.late)
        log.warning("job %s: %s", job.row.id, message)
        job.round = None

    def _advance_secure(self, job: ActiveJob, rs: RoundState) -> None:
        """Close the current secure-aggregation phase; open the next one, or finish the round."""
        sec = rs.secure
        for site in rs.participants:
            if site not in rs.outcomes:
                rs.outcomes[site] = "late"
                if site in rs.grants:
                    self.store.finish_task(rs.grants[site].task_id, "late", f"no answer in the {sec.phase} phase",
                                           job_id=job.row.id, round_=rs.round, site=site)
        answered = sorted(s for s, o in rs.outcomes.items() if o == "submitted")
        try:
            following = sec.advance(answered, rs.participants)
            if sec.phase == "done":
                delta, weight = sec.result()
                for site, reason in sorted(sec.rejected.items()):   # their masked inputs are in the sum all the same
                    rs.outcomes[site] = "rejected"
                    self.store.finish_task(rs.grants[site].task_id, "rejected", reason, job_id=job.row.id,
                                           round_=rs.round, site=site)
                    log.warning("job %s round %d site %s: rejected (%s)", job.row.id, rs.round, site, reason)
                mean = {}
                for name, current in job.state.items():
                    mean[name] = (current.astype(np.float64) + delta[name]).astype(current.dtype)
                rs.contributors, rs.samples = list(sec.u3), weight
                self._close_training_round(job, rs, job.strategy.aggregate(rs.round, job.state, mean,
                                                                           sorted(rs.contributors)))
                return
        except PlexusError as exc:   # too few sites answered a phase, or too few honest shares
            self._fail_round(job, rs, str(exc), retry=True)
            return
        rs.participants, rs.grants, rs.outcomes = following, {}, {}
        rs.deadline = self._mono() + job.cfg.privacy.secagg.phase_timeout_s
        self._wake(following)
        self.store.event(job.row.id, f"secagg_{sec.phase}", rs.round, "", f"{len(following)} site(s): "
                         + ", ".join(following))

    def _central_noise(self, job: ActiveJob, rs: RoundState, mean: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Central DP-FedAvg: N(0, (zS)²) on the sum of clipped updates, i.e. std zS/m on their mean.

        Keyed from 32 fresh OS-random bytes that are never stored: the noise is not derivable
        from anything a config reader knows. Only dp.reproducible_noise keys it from the job
        seed and name (a reproducible run that is not private, and says so).
        """
        dp = job.cfg.privacy.dp
        if dp is None or dp.mode != "central":
            return mean
        std = dp.noise_multiplier * dp.clip_norm / len(rs.contributors)
        seed = job.cfg.seed if dp.reproducible_noise else None
        noisy = add_noise(mean, std, noise_key(seed, job.cfg.name, rs.round, "coordinator"))
        return {k: noisy[k].astype(mean[k].dtype) for k in mean}

    def _close_training_round(self, job: ActiveJob, rs: RoundState, state: dict[str, np.ndarray] | None,
                              state_blob=None) -> None:
        """state_blob, when given, is the new model's wire blob (`state` views it, or is None): a bytes-like
        blob, or an iterator of its blocks when the model is only ever served from the checkpoint."""
        if state_blob is not None:
            layout, blob = job.update_layout, state_blob
        else:
            layout, blob = encode(state)
        self.store.save_checkpoint_blob(job.row.id, rs.round, layout, blob)
        self.store.save_strategy_state(job.row.id, rs.round, job.strategy.state_arrays(), job.strategy.state_meta())
        message = f"{len(rs.contributors)} update(s), {rs.samples} samples"
        self.store.close_round(job.row.id, rs.round, status="closed", contributors=sorted(rs.contributors),
                               total_samples=rs.samples, message=message, job_update={"current_round": rs.round},
                               late=rs.late)
        self.store.prune_checkpoints(job.row.id, rs.round)
        if self._storage_trouble:
            log.info("job %s round %d saved: the state dir takes writes again", job.row.id, rs.round)
            self._storage_trouble = ""
        job.row = self.store.job(job.row.id)
        dp = job.cfg.privacy.dp
        if dp is not None:
            epsilon = job.epsilons[rs.round]   # computed for this round's cohort as it opened (_epsilon_if)
            ledger = {(rs.round, "", "privacy", "epsilon"): epsilon, (rs.round, "", "privacy", "delta"): dp.delta}
            if job.cfg.sites.fraction is not None or job.cfg.sites.count is not None:   # q < 1 possible
                ledger[(rs.round, "", "privacy", "sampling_rate")] = job.rates[rs.round]
            if dp.reproducible_noise:   # ε holds only against whoever cannot read the config: flag every round
                ledger[(rs.round, "", "privacy", "noise_reproducible")] = 1.0
            self.store.record_metrics(job.row.id, ledger)
        if state is not None:
            job.set_model(layout, blob)
        if not job.in_memory:
            self._serve_from_checkpoint(job, rs.round)   # sites stream it from the checkpoint just written
        job.model_round = rs.round
        job.round = None
        log.info("job %s round %d closed: %s", job.row.id, rs.round, message)

    def _serve_from_checkpoint(self, job: ActiveJob, round_: int) -> None:
        """Drop the in-memory model; FetchModel then streams the checkpoint file (shared page cache)."""
        # Not read through again for its checksum: it was just written, or just verified as it was read.
        layout, path, start = self.store.checkpoint_source(job.row.id, round_, verify=False)
        job.layout, job.source, job.state, job.blob = layout, (path, start), None, None
        job.served_layout, job.served_blob = layout, None

    def _fail_active(self, message: str) -> None:
        job = self._active
        self._active = None
        if job is not None:
            if job.round:
                job.round.drop_held()
                job.round.end_uploads(f"job {job.row.id} failed: {message}")
            self.store.set_job(job.row.id, status="failed", message=message, event=("job_failed", 0, "", message))
            self.store.interrupt_open_rounds()


def _storage_failure(exc: BaseException) -> bool:
    """A full or failing disk under the state dir: to be waited out, not a reason to fail a job."""
    if isinstance(exc, sqlite3.OperationalError):
        return exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN)
    return isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS


def _noise_is_reproducible(cfg: RoundConfig) -> bool:
    return cfg.privacy.dp is not None and cfg.privacy.dp.reproducible_noise


def _kept(job: ActiveJob, metrics: dict) -> dict:
    """The site metrics the store keeps: none under privacy.dp, where they would describe each site's data
    outside the accounted ε (sites withhold them; this covers a site that sends them anyway)."""
    return {} if job.cfg.privacy.dp is not None else metrics


def _site_metrics(rs: RoundState, site: str, eval_metrics, train_metrics=None,
                  num_samples: int | None = None) -> dict:
    """A site's reported metrics, validated, keyed for the store: (round, kind, name) -> value.

    Eval metrics describe the incoming global model (model_round); train metrics this round. Every
    reader averages eval metrics over sites weighted by their "num_samples", so that weight is bounded
    as training weights are (RoundState.eval_caps): a site claiming 1e300 rows cannot set the average.
    """
    out = {}
    for field_name, values, key in (("eval_metrics", eval_metrics, (rs.model_round, "eval")),
                                    ("metrics", train_metrics or {}, (rs.round, "train"))):
        if len(values) > MAX_METRICS:
            raise IntegrityError(f"{field_name} has {len(values)} entries; at most {MAX_METRICS} are allowed",
                                 reason=Reason.METRICS)
        for name, value in values.items():
            if not name or len(name) > 64 or not np.isfinite(value):
                raise IntegrityError(f"{field_name}[{name[:64]!r}] must have a 1-64 character name and a finite value",
                                     reason=Reason.METRICS)
            if key[1] == "eval" and name == "num_samples":
                if value < 1:
                    raise IntegrityError(f"eval_metrics['num_samples'] must be at least 1; got {value}",
                                         reason=Reason.METRICS)
                value = min(value, rs.eval_caps.get(site, 1))
            out[(*key, name)] = float(value)
    if num_samples is not None:
        out[(rs.round, "train", "num_samples")] = float(num_samples)
    return out


def _check_clipped(spool: Path, layout: Layout, current: dict[str, np.ndarray], clip_norm: float) -> None:
    """DP needs every update within clip_norm of the global model; sites clip, the coordinator checks."""
    blob = spool.read_bytes()
    squared = 0.0
    for t in layout.tensors:
        x = np.frombuffer(blob, dtype=DTYPES[t.dtype], count=t.numel, offset=t.offset).astype(np.float64)
        squared += float(np.sum((x - current[t.name].reshape(-1)) ** 2))
    norm = squared ** 0.5
    if norm > clip_norm * (1 + 1e-6):
        raise IntegrityError(f"update is {norm:.6g} from the global model, beyond dp.clip_norm {clip_norm}; "
                             "differential privacy needs every site to clip its update", reason=Reason.NORM)


def _receive_to(spool: Path, layout: Layout, chunks: Iterable, fold: Fold | None = None) -> None:
    """Stream chunks through a Receiver into the spool file. With a fold, each validated chunk is added
    to the sum once it is in the file, so the file always holds what the fold may have to take out."""
    with open(spool, "wb") as fh:
        def sink(data) -> None:
            fh.write(data)
            if fold is not None:
                fh.flush()
                fold.add(data, receiver.max_abs)   # the running max, this chunk included
        receiver = Receiver(layout, sink=sink)
        for chunk in chunks:
            receiver.feed(chunk.offset, chunk.data)
        receiver.finish()


def _read_blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while block := fh.read(SPOOL_READ_BYTES):
            yield block
