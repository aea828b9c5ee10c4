"""The engine: one job at a time, its life run by a driver (coordinator/drivers/).

Concurrency: every public method takes the engine's lock. The background thread (and admin watches)
wait on one condition over it; each site's NextTask long-polls wait on that site's own condition,
woken only when a task for that site appears (a round or secure phase opens for it) or the engine
stops, so idle sites cost nothing between their poll timeouts. The background thread takes up the
next job and asks its driver to move it on; durable effects go through the Store.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path

import numpy as np

from coordinator.drivers import Context, Driver
from coordinator.drivers.async_ import AsyncRounds
from coordinator.drivers.split import Session, SplitRounds
from coordinator.drivers.sync import SyncRounds, strategy_at
from coordinator.events import admin_actor
from coordinator.model_worker import ModelLimits, ModelWorker, shared_worker
from coordinator.served import Held, ServedModel
from coordinator.store import EventRow, JobRow, Store, rows_by_dataset
from coordinator.strategies import make_strategy
from coordinator.tasks import (
    Binding,
    JoinInfo,
    Presence,
    SecaggAnswer,
    TaskGrant,
    TaskResult,
    UpdateHeader,
    check_binding,
    owned_task,
)
from plexus.config import MAX_ROUND_CONFIG_BYTES, RoundConfig, dump_round_config, ensemble_members, parse_round_config
from plexus.errors import (
    ConfigError,
    FailedPrecondition,
    IntegrityError,
    NotFound,
    PlexusError,
    Reason,
    RoundClosed,
    Unavailable,
    out_of_space,
    storage_failure,
    storage_text,
)
from plexus.text import bounded
from plexus.vocab import TERMINAL, JobStatus, TaskKind, TaskStatus
from plexus.wire import FLOAT_DTYPES, Layout

log = logging.getLogger("plexus.coordinator")

STORAGE_RETRY_S = 5.0
STORAGE_RETRY_CAP_S = 300.0   # the longest wait between tries after storage failures in a row
ROOM_BYTES = 64 << 20         # after a full disk: the free space (beyond the model twice over) a rerun waits for
_SECAGG_KIND = {"advert": TaskKind.SECAGG_ADVERTISE, "shares": TaskKind.SECAGG_SHARE,
                "reveal": TaskKind.SECAGG_UNMASK}


REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_NOT_RESUMABLE = {JobStatus.QUEUED: "it has not started yet", JobStatus.RUNNING: "it is running",
                  JobStatus.COMPLETED: "it has ended; submit it again to train more",
                  JobStatus.BUDGET_REACHED: "it spent its privacy budget (dp.target_epsilon)",
                  JobStatus.ABORTED: "an aborted job stays aborted; submit it again"}


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
    strategy = make_strategy(cfg)   # refuses unknown strategies, bad args and combinations that cannot work
    try:
        split = {"variant": cfg.split.variant, "cuts": list(cfg.split.cuts)} if cfg.mode == "split" else None
        state = (models or shared_worker()).build(cfg.model.name, dict(cfg.model.args), seed=cfg.seed, out=build,
                                                  members=ensemble_members(cfg), split=split, limits=limits)
    except ConfigError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith("split: ") else f"model: {text}") from None
    state = strategy.rule.initial_model(state)
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
    """The coordinator's core: the job queue, the sites' presence and tasks, and one background thread.

    The active job's life (rounds, phases, aggregation) belongs to its driver; the engine takes up jobs
    in order, hands the driver each site call under the lock, and survives a failing state dir by
    dropping the job's in-memory state and taking it up again from its checkpoint once the disk works.
    """

    def __init__(self, store: Store, *, federation: str = "", poll_timeout_s: float = 20.0,
                 rejoin_grace_s: float = 0.0, clock=time.time, monotonic=time.monotonic, on_death=lambda: None,
                 models: ModelWorker | None = None, model_limits: ModelLimits = ModelLimits(),
                 take_up: Callable[[Context, JobRow], Driver | None] | None = None, refuse_jobs: str = ""):
        """take_up: what runs each job (default: SyncRounds or AsyncRounds by its config; a relay's tier gives
        its own); refuse_jobs: why submissions are refused here ('' takes them)."""
        self.store = store
        self._take_up = take_up
        self.refuse_jobs = refuse_jobs
        self.models = models or shared_worker()   # builds initial models, never under the lock
        self.model_limits = model_limits
        self.federation = federation
        self.poll_timeout_s = poll_timeout_s
        online_window_s = 2 * poll_timeout_s + 10
        self.rejoin_grace_s = rejoin_grace_s
        self._clock, self._mono = clock, monotonic
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)   # the round loop and admin watches wait here
        self._presence = Presence(self._lock, online_window_s=online_window_s, monotonic=monotonic)
        self._wakeups = 0                            # long-polls woken before their timeout
        self._driver: Driver | None = None
        self._submitting: dict[tuple[str, str], str] = {}   # (admin, request id) -> config SHA-256, being built
        self._stopping = False
        self.on_death = on_death            # called if the engine thread ever ends other than by stop()
        self.storage_retry_s = STORAGE_RETRY_S
        self._storage_trouble = ""          # the state dir's failure last logged, until a round is saved again
        self._retry_at = 0.0                # monotonic: no tick before this, after a storage failure
        self._storage_failures = 0          # in a row, since a round was last saved: each doubles the wait
        self._free_wanted = 0               # after a full disk: free bytes the state dir must have to go on
        self.tier_rows_cap: int | None = None   # a relay's tier: the most rows of a dataset its sites report in all
        self._thread = threading.Thread(target=self._run, name="plexus-engine", daemon=True)

    @property
    def online_window_s(self) -> float:
        """A site not seen for longer than this (and holding no task) is offline; tests shorten it."""
        return self._presence.online_window_s

    @online_window_s.setter
    def online_window_s(self, seconds: float) -> None:
        with self._lock:
            self._presence.online_window_s = seconds

    # read-only views, for tests and benchmarks -----------------------------------------------
    @property
    def driver(self) -> Driver | None:
        """The active job's driver, or None when no job is active."""
        return self._driver

    @property
    def poll_wakeups(self) -> int:
        """Long-polls woken before their timeout (a task for their site appeared, or the engine stopped)."""
        with self._lock:
            return self._wakeups

    @property
    def polling_sites(self) -> int:
        """Sites that have long-polled at least once. Read under the lock: when it counts a site, that site's
        first poll is waiting (it registers and waits without releasing the lock in between)."""
        with self._lock:
            return self._presence.polling

    def nudge(self) -> None:
        """Wake the background thread now (it looks again at once rather than at its next timeout)."""
        with self._cv:
            self._cv.notify_all()

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Mark rounds left open by a previous run interrupted, and start the background thread."""
        self.store.interrupt_open_rounds()
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread and release every waiting long-poll."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            self._presence.wake()
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
            driver = self._driver   # read without the lock: at worst it prepares for a job just set aside
            if driver is not None:
                driver.prepare()
            with self._cv:
                if self._stopping:
                    return
                if (wait := self._retry_at - self._mono()) > 0:
                    self._cv.wait(wait)
                    continue
                if self._free_wanted and not self._room_again():
                    continue
                try:
                    try:
                        timeout = self.tick()
                    except Exception as exc:  # the loop must survive; the job is failed with the reason
                        if storage_failure(exc):
                            raise
                        log.exception("round engine error")
                        self._fail_active("internal error in the round engine; see the coordinator log")
                        timeout = 0.5
                except Exception as exc:   # also while failing a job: that needs the disk as well
                    if not storage_failure(exc):
                        raise
                    self._storage_failed(exc)
                    continue
                self._cv.wait(timeout)

    def tick(self) -> float:
        """One pass of the engine loop: take up the next queued job if none is active, let its driver act; the
        seconds until the loop should look again. It takes the engine lock (re-entrant: the engine thread
        already holds it), so a caller driving an engine that was never started may call it too."""
        with self._cv:
            if self._driver is None and not self._activate_next():
                return 1.0
            driver = self._driver
            timeout = driver.tick(self._mono())
            if driver.ended:
                self._driver = None
            return timeout

    def _activate_next(self) -> bool:
        pending = [j for j in self.store.jobs() if j.status in (JobStatus.QUEUED, JobStatus.RUNNING)]
        if not pending:
            return False
        row = next((j for j in pending if j.status == JobStatus.RUNNING), pending[0])
        if self._take_up is not None:
            self._driver = self._take_up(self._context(), row)
            return self._driver is not None
        try:
            cfg = parse_round_config(row.config_yaml, source=f"job {row.id}")
            kind = SplitRounds if cfg.mode == "split" else AsyncRounds if cfg.asynchronous is not None else SyncRounds
        except ConfigError:
            kind = SyncRounds   # SyncRounds.take_up fails the job with the config's error
        self._driver = kind.take_up(self._context(), row)
        return self._driver is not None

    def _context(self) -> Context:
        return Context(store=self.store, presence=self._presence, clock=self._clock, monotonic=self._mono,
                       notify=self._cv.notify_all, models=self.models, model_limits=self.model_limits,
                       rejoin_grace_s=self.rejoin_grace_s, saved=self._saved)

    def retire(self, keep_job: str, message: str) -> None:
        """End the active job unless it is `keep_job` (a relay's tier, when its parent moved on to another job)."""
        with self._cv:
            driver = self._driver
            if driver is not None and driver.job_id != keep_job and hasattr(driver, "end"):
                driver.end(message)
                self._driver = None
            self._cv.notify_all()

    def _saved(self, round_: int) -> None:
        if self._storage_trouble:
            log.info("job %s round %d saved: the state dir takes writes again", self._driver.job_id, round_)
            self._storage_trouble = ""
        self._storage_failures = 0

    def _storage_failed(self, exc: Exception) -> None:
        """The state dir cannot be written (a full disk) or read: fail nothing. The round in progress is
        dropped with the job's in-memory state, and the job, still running at its last closed round, is
        taken up again from its checkpoint once the store may work: the round reruns. Each rerun has the sites
        train again (and spend DP-SGD budget), so reruns are rare: after a full disk, not before the state dir
        has ROOM_BYTES free and the job's model twice over; and the wait between tries (storage_retry_s)
        doubles with each failure in a row, up to STORAGE_RETRY_CAP_S."""
        text = f"{type(exc).__name__}: {exc}"
        if text != self._storage_trouble:   # once per distinct failure, not once per retry
            log.error("cannot use the state dir %s (%s); the round in progress is dropped and the job resumes "
                      "from its last checkpoint once it can", self.store.state_dir, text, exc_info=exc)
            self._storage_trouble = text
        self._storage_failures += 1
        self._retry_at = self._mono() + min(STORAGE_RETRY_CAP_S,
                                            self.storage_retry_s * 2 ** min(self._storage_failures - 1, 30))
        driver, self._driver = self._driver, None
        if out_of_space(exc):
            self._free_wanted = ROOM_BYTES + 2 * (self._model_bytes(driver.job_id) if driver is not None else 0)
        if driver is None:
            return
        message = f"{text}; the round runs again once the coordinator can write its state dir"
        with suppress(OSError, sqlite3.Error):   # the disk may refuse this too; the log has it
            driver.stop(message, dropped=True)
            self.store.interrupt_open_rounds()
        self._cv.notify_all()

    def _room_again(self) -> bool:
        """Whether the state dir has the room a full disk's rerun waits for; if not, look again later."""
        free = _free_bytes(self.store.state_dir)
        if free >= self._free_wanted:
            log.info("the state dir %s has %d bytes free again: the job is taken up again", self.store.state_dir,
                     free)
            self._free_wanted = 0
            return True
        trouble = f"waiting for room: {free} of {self._free_wanted} bytes free"
        if trouble != self._storage_trouble:
            log.error("the state dir %s is full (%d bytes free); its job is taken up again once %d bytes are "
                      "free, without its sites training in the meantime: free space under it",
                      self.store.state_dir, free, self._free_wanted)
            self._storage_trouble = trouble
        self._retry_at = self._mono() + self.storage_retry_s
        return False

    def _model_bytes(self, job_id: str) -> int:
        """The size of the job's latest checkpoint (0 if it cannot be told)."""
        with suppress(OSError, sqlite3.Error, NotFound):
            return self.store.checkpoint_path(job_id, self.store.job(job_id).current_round).stat().st_size
        return 0

    def _fail_active(self, message: str) -> None:
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.stop(f"job {driver.job_id} failed: {message}")
            self.store.set_job(driver.job_id, status=JobStatus.FAILED, message=message,
                               event=("job_failed", 0, "", message))
            self.store.interrupt_open_rounds()

    # admin side --------------------------------------------------------------------------
    def submit(self, config_yaml: str, who: str, request_id: str = "") -> str:
        """Validate a round config, build its model and queue the job; its id.

        With a request_id, the submission is idempotent per admin: a repeat (a client's retry after
        its deadline passed) returns the job the first one created, also while that one is still
        building its model, and a repeat with another config is refused.
        """
        if self.refuse_jobs:
            raise FailedPrecondition(self.refuse_jobs)
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

    def resume(self, job_id: str, who: str) -> JobRow:
        """Run a failed job again from its last closed round; refused unless that can work. The job's row as
        the resume left it (the engine thread may take the job up and change its message right after)."""
        row = self.store.job(job_id)
        self._check_resumable(row)   # reads the checkpoint through: not under the engine lock
        with self._cv:
            row = self.store.job(job_id)
            self._check_resumable(row, verify=False)   # still failed: no one resumed or removed it meanwhile
            message = f"resumed by {who} after round {row.current_round}"
            self.store.set_job(job_id, status=JobStatus.RUNNING, message=message,
                               event=("job_resume_requested", row.current_round, "", f"{message} (it had failed: "
                                      f"{bounded(row.message)})"), actor=admin_actor(who))
            self._cv.notify_all()
            return self.store.job(job_id)

    def _check_resumable(self, row: JobRow, *, verify: bool = True) -> None:
        if row.status != JobStatus.FAILED:
            raise FailedPrecondition(f"job {row.id} is {row.status}; only a failed job can be resumed "
                                     f"({_NOT_RESUMABLE.get(row.status, 'it has not failed')})")
        if not verify:
            return
        try:
            cfg = parse_round_config(row.config_yaml, source=f"job {row.id}")
            strategy_at(self.store, cfg, row.id, row.current_round)
            self.store.checkpoint_blob(row.id, row.current_round)
        except (ConfigError, NotFound, IntegrityError) as exc:
            raise FailedPrecondition(f"job {row.id} cannot be resumed: {exc}") from None

    def abort(self, job_id: str, who: str) -> None:
        """Abort a queued or running job: its open round ends now, uploads in flight are cut."""
        with self._cv:
            row = self.store.job(job_id)
            if row.status in TERMINAL:
                raise FailedPrecondition(f"job {job_id} is already {row.status}; only queued or running jobs can be "
                                         "aborted")
            self.store.set_job(job_id, status=JobStatus.ABORTED, message=f"aborted by {who}",
                               event=("job_aborted", row.current_round, "", f"aborted by {who}"),
                               actor=admin_actor(who))
            if self._driver is not None and self._driver.job_id == job_id:
                self._driver.stop(f"job {job_id} was aborted by {who}")
                self._driver = None
                self.store.interrupt_open_rounds()
            self._cv.notify_all()

    def wait_events(self, job_id: str, after_id: int, timeout: float) -> list[EventRow]:
        """A job's events after `after_id`, waiting up to `timeout` seconds for one if there is none yet."""
        with self._cv:
            events = self.store.events_after(job_id, after_id)
            if not events:
                self._cv.wait(timeout)
                events = self.store.events_after(job_id, after_id)
            return events

    def online_sites(self) -> set[str]:
        """Sites online now: seen (any call) within the online window, or holding a task they have not
        answered yet: a site training for longer than the window is busy, not gone."""
        with self._cv:
            return self._present()

    # site side ---------------------------------------------------------------------------
    def join(self, site: str, info: JoinInfo) -> None:
        """A site (re)joins: it is online, and the training rows it reports bound its updates' weight."""
        with self._cv:
            if self.tier_rows_cap is not None:
                self._check_tier_rows(site, info.dataset_rows)
            self._presence.joined(site, info.dataset_rows)
            self.store.site_seen(site, agent_version=info.agent_version, models=list(info.models),
                                 datasets=list(info.datasets), policy_digest=info.policy_digest)
            self.store.site_joined(site, serial=info.serial, dataset_rows=info.dataset_rows,
                                   children=info.children if info.relay else None)
            self._cv.notify_all()

    def _check_tier_rows(self, site: str, rows: dict[str, int]) -> None:
        """A relay's tier: refuse a child whose rows would take its sites' total of a dataset past what the relay
        may report to its parent at Join (the parent would refuse the whole relay, and every sibling with it)."""
        siblings = rows_by_dataset(self.store.sites(), without=site)
        for dataset, n in rows.items():
            others = siblings.get(dataset, 0)
            if others + n > self.tier_rows_cap:
                raise IntegrityError(f"Join refused: with {n} training rows of {dataset[:64]!r} this relay's sites "
                                     f"would report {others + n} in all, past the {self.tier_rows_cap} its parent "
                                     "takes from one relay; report the rows this site really has",
                                     reason=Reason.NUM_SAMPLES)

    def next_task(self, site: str, wait_s: float, valid: Callable[[], None] = lambda: None) -> TaskGrant | None:
        """The site's task, waiting up to wait_s (at most poll_timeout_s) for one to appear. `valid()` raises once
        the caller's certificate is revoked: checked before anything is granted, and again on every wake-up
        (`revoked` wakes every poll), so a site revoked while it waits is refused at once and is offline."""
        end = self._mono() + max(0.0, min(wait_s, self.poll_timeout_s))
        with self._cv:
            self.store.site_seen(site)
            if self._presence.touch(site):
                self._cv.notify_all()   # back online: the round loop may now have its quorum
            polls = self._presence.poll(site)
            while True:
                try:
                    valid()
                except PlexusError:
                    self._presence.leave(site)   # no round counts on it from now on
                    raise
                grant = self._driver.grant(site) if self._driver is not None else None
                remaining = end - self._mono()
                if grant or remaining <= 0 or self._stopping:
                    self._presence.seen(site)
                    return grant
                if polls.wait(remaining):
                    self._wakeups += 1

    def revoked(self, sites: Iterable[str]) -> None:
        """Certificates were revoked (`sites`: the sites whose last Join was with one of them). Each of these
        sites is offline, and a task it holds is failed now, so its round waits for it no longer; every waiting
        long-poll checks its caller's certificate again (next_task's `valid`)."""
        with self._cv:
            driver = self._driver
            busy = set(driver.busy()) if driver is not None else set()
            for site in sorted(set(sites)):
                self._presence.leave(site)
                if site not in busy:
                    continue
                grant = driver.grant(site)   # the task it holds
                if grant is None:
                    continue
                result = TaskResult(task=Binding(grant.task_id, grant.job_id, grant.round, grant.nonce),
                                    status=TaskStatus.FAILED, reason="the site's certificate has been revoked")
                try:
                    driver.answered(site, grant, result)
                except PlexusError as exc:   # e.g. answered already: the round has what it needs of it
                    log.info("site %s, revoked: its task %s stays as it is (%s)", site, grant.task_id, exc)
            self._presence.wake()
            self._cv.notify_all()

    def model_for(self, site: str, task_id: str, held: Held | None = None, *, zero_base: bool = False
                  ) -> tuple[ServedModel, str, int]:
        """The model a task needs (`held`: the model the site holds, which a delta may apply to; `zero_base`:
        whether it decodes a delta from zeros), the job's id and the model's round."""
        with self._cv:
            self._presence.touch(site)
            driver, grant = self._current(site, task_id)
            return driver.served(grant, held, zero_base=zero_base), grant.job_id, grant.model_round

    def submit_update(self, site: str, header: UpdateHeader, chunks: Iterable[tuple[int, bytes]],
                      cut: Callable[[BaseException], None] = lambda exc: None, *,
                      replay: Callable[[], Iterable] | None = None) -> str:
        """Receive one site's update as (offset, data) chunks, validated and folded as they arrive; the reply.

        `cut(exc)` makes `chunks` raise exc: the driver calls it when the round closes while the update is
        still arriving. The chunks stream without the engine lock. `replay`: for a stream held in memory whole,
        its chunks' bytes again, which then stand for the upload's journal (Upload.receive).
        """
        with self._cv:
            self._presence.touch(site)
            driver, grant = self._current(site, header.task.task_id)
            masked = grant.kind == TaskKind.SECAGG_MASK
            _bind(grant, header.task, TaskKind.SECAGG_MASK if masked else TaskKind.TRAIN)
            if header.partial is not None and (masked or not isinstance(driver, SyncRounds)):
                raise IntegrityError("a relay's partial sum answers a synchronous training task only; this job "
                                     "is asynchronous or in a secure-aggregation phase: connect its sites directly")
            upload = driver.upload(site, grant, header, cut)
        try:
            try:
                upload.receive(chunks, replay=replay)
            except BaseException as exc:
                with self._cv:
                    if storage_failure(exc):   # the coordinator's disk, not the site's update: the round waits
                        if self._driver is driver:
                            self._storage_failed(exc)
                        raise Unavailable(f"the coordinator cannot store updates now ({storage_text(exc)}); the "
                                          "round runs again once its state dir has room") from None
                    driver.refused(site, grant, upload, exc)
                raise
            with self._cv:
                return driver.accepted(site, grant, header, upload)
        finally:
            with self._cv:
                driver.ended_upload(site, upload)
                self._presence.touch(site)   # an upload longer than the online window is presence, not absence

    def secagg(self, site: str, answer: SecaggAnswer) -> str:
        """One secure-aggregation answer: an advert, the encrypted shares, or the unmasking reveals."""
        with self._cv:
            self._presence.touch(site)
            driver, grant = self._current(site, answer.task.task_id)
            _bind(grant, answer.task, _SECAGG_KIND[answer.body])
            return driver.answered(site, grant, answer)

    def split_session(self, site: str, task: Binding, batches: int, cut: Callable[[BaseException], None]) -> Session:
        """A site opens the Split session of its split task (bound to job, epoch and nonce): the session its
        messages go through, without the engine lock."""
        with self._cv:
            self._presence.touch(site)
            driver, grant = self._current(site, task.task_id)
            _bind(grant, task, None)   # either split kind: the driver tells them apart
            if not isinstance(driver, SplitRounds):
                raise FailedPrecondition(f"job {grant.job_id} is not a split-learning job; its tasks take no Split "
                                         "session")
            return driver.session(site, grant, batches, cut, self._cv)

    def split_ended(self, site: str, valid: Callable[[], None] = lambda: None) -> None:
        """A Split session's end counts as the site's presence, unless `valid()` raises: its certificate was
        revoked meanwhile (the site is offline for good, Engine.revoked)."""
        with self._cv:
            try:
                valid()
            except PlexusError:
                return
            self._presence.touch(site)

    def report(self, site: str, result: TaskResult) -> str:
        """A task's result without an update: evaluated, declined or failed."""
        with self._cv:
            self._presence.touch(site)
            driver, grant = self._current(site, result.task.task_id)
            _bind(grant, result.task, None)
            return driver.answered(site, grant, result)

    # internals ---------------------------------------------------------------------------
    def _current(self, site: str, task_id: str) -> tuple[Driver, TaskGrant]:
        """The driver and grant a site's task id answers: its own, current and not answered yet."""
        job_id, round_, status = owned_task(self.store, site, task_id)
        driver = self._driver
        if driver is None or driver.job_id != job_id:
            raise RoundClosed(f"task {task_id} is no longer current: round {round_} of job {job_id} has closed or "
                              "moved to its next phase")
        return driver, driver.current(site, task_id, round_, status)

    def _present(self) -> set[str]:
        online = self._presence.online()
        if self._driver is not None:
            online.update(self._driver.busy())
        return online


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _bind(grant: TaskGrant, task, kind: TaskKind | None) -> None:
    check_binding(grant, task.job_id, task.round, task.nonce, kind)


