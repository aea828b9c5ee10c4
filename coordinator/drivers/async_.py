"""AsyncRounds: asynchronous, staleness-aware training (FedBuff, Nguyen et al. 2022; FedAsync, Xie et al. 2019).

The coordinator keeps a model version v. Every idle site is given a task on the newest version; its update
streams into the buffer of version v+1, weighted by s(τ)·n (τ = v − the version it trained from; n its
samples, 1 under DP). Once `buffer` (K) updates are in, the buffer is flushed: the server rule takes one step
from the staleness-weighted mean delta, version v+1 is checkpointed, and training goes on. An update more
than `max_staleness` versions old is refused, and its site is given the newest model.

Exactness: each update x is folded into an exact fixed-point sum at its weight w as it streams; at the flush
the bases it trained from are taken off (Σ_v W_v·x_v over the distinct base versions, W_v the sum of their
updates' weights, in version order), so Δ̄ = (Σ wᵢxᵢ − Σ_v W_v x_v) / Σ nᵢ. The weights are multiples of
2^−16 (plexus.staleness), so every sum of them is exact: the flush is the same whatever order the updates
arrived in. An upload still streaming at a flush moves into the next buffer at its new staleness
(Upload.move); one that breaks off is taken out of its buffer exactly (Upload.withdraw).

Durability: a version is written (checkpoint, strategy state, then the round row that names its tasks) in
that order, so a SIGKILL resumes from the last written version; the updates then in the unflushed buffer
are recorded as discarded (events and audit log) and their sites are simply given new tasks: no update is
ever counted twice.

The coordinator keeps the model versions updates may still be based on (at most max_staleness + 1), as
checkpoint files and, where it must read them (the flush, the DP clip check), decoded in memory.

Under privacy.secure_aggregation no update reaches the coordinator in the clear: each buffer is a secure
cohort (coordinator/drivers/cohort.py). A site answers its training task `trained` and keeps its update;
once K sites are waiting (or cohort_timeout_s has passed with enough of them), they run the masked-sum
protocol at the current version, each weighing its own update by s(τ)·n before masking, and the unmasked
weighted mean is flushed through the same version write as a plain buffer.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from coordinator.aggregate import WeightedSum
from coordinator.drivers import Context
from coordinator.drivers.cohort import Cohort, Trained, advert_samples, cohort_size
from coordinator.drivers.rounds import Action, RoundView, decide
from coordinator.drivers.sync import check_rows, kept_metrics, save_strategy, site_metrics, strategy_at, weight_caps
from coordinator.intake import Upload
from coordinator.secure_round import SecureRound
from coordinator.served import Held, ServedModel
from coordinator.store import JobRow
from coordinator.strategies.base import cast, is_float
from coordinator.tasks import SecaggAnswer, TaskGrant, TaskResult, UpdateHeader, check_unanswered, new_grant, site_seed
from plexus import staleness
from plexus.accounting import client_epsilon, load_client_accountant
from plexus.config import MIN_SECURE_COHORT, RoundConfig, parse_round_config
from plexus.dp import NOT_PRIVATE, Distance, add_noise, central_std, check_clipped, noise_key
from plexus.errors import (
    ConfigError,
    FailedPrecondition,
    IntegrityError,
    NotFound,
    PlexusError,
    Reason,
    RoundClosed,
    Stale,
    TimedOut,
)
from plexus.text import bounded
from plexus.vocab import JobStatus, SecaggPhase, TaskKind, TaskStatus
from plexus.wire import Layout, decode, encode

log = logging.getLogger("plexus.coordinator")

FAIL_BACKOFF_S, FAIL_BACKOFF_MAX_S = 2.0, 60.0   # a site's wait after a failed training task (doubling in a row)
COHORT_KINDS = (TaskKind.SECAGG_ADVERTISE, TaskKind.SECAGG_SHARE, TaskKind.SECAGG_MASK, TaskKind.SECAGG_UNMASK)


@dataclass(frozen=True)
class Member:
    """One update taken into a buffer."""

    site: str
    task_id: str
    base: int          # the version it trained from
    tau: int           # its staleness when it was taken in
    samples: int       # n (1 under DP): the flush divides by Σ n
    weight: float      # s(τ)·n, what it was folded with


@dataclass
class Buffer:
    """The updates that will make version `version`."""

    version: int
    total: WeightedSum | None            # None under secure aggregation: its cohort sums masked inputs
    members: list[Member] = field(default_factory=list)
    refused_stale: Counter = field(default_factory=Counter)   # site -> updates refused as stale meanwhile

    def count(self, site: str) -> int:
        return sum(1 for m in self.members if m.site == site)


@dataclass
class Arriving:
    """An update streaming in now."""

    grant: TaskGrant
    upload: Upload
    samples: int
    cut: Callable[[BaseException], None]


@dataclass
class Evaluation:
    """The idle sites' evaluation of one version (every `evaluate_every`, and the final model)."""

    version: int
    round: int                       # the task round (the version; the final evaluation's is version + 1)
    sites: set[str]                  # asked: the sites online when it began
    deadline: float                  # monotonic
    results: dict[str, dict[str, float]] = field(default_factory=dict)   # site -> eval metrics

    @property
    def complete(self) -> bool:
        return self.sites <= set(self.results)


class AsyncRounds:
    """One asynchronous job's life on the engine (see the module docstring). Built by `take_up`."""

    def __init__(self, ctx: Context, row: JobRow, cfg: RoundConfig, strategy, layout: Layout, blob):
        self.ctx, self.row, self.cfg, self.strategy = ctx, row, cfg, strategy
        self.spec = cfg.asynchronous
        self.job_id = row.id
        self.ended = False
        self.version = row.current_round
        self.outstanding: dict[str, TaskGrant] = {}     # at most one task per site
        self.arriving: dict[str, Arriving] = {}
        self.evaluation: Evaluation | None = None
        self.finishing = ""                             # why training ended (the final evaluation is running)
        self.budget_stop = ""
        self.started = False
        self.last_answer = ctx.monotonic()   # a site's last answer (an upload, result or phase message)
        self._benched: dict[str, tuple[float, int]] = {}   # site -> (monotonic until, failures in a row)
        self.epsilons: dict[int, float] = {}
        self._bases: dict[int, dict[str, np.ndarray]] = {}
        self._spare: WeightedSum | None = None
        self._issued = Counter(ctx.store.task_counts(row.id))
        self._declined = set(ctx.store.declines(row.id))
        self.secure = cfg.privacy.secure_aggregation
        self.forming: list[Trained] = []                # secure: sites whose kept updates wait for a cohort
        self.cohort: Cohort | None = None               # secure: the cohort running its phases
        # Cohort round ids: above every version and final-evaluation round, and above every id the job used.
        used = ctx.store.last_task_round(row.id, COHORT_KINDS)
        self._cohort_round = max(cfg.rounds + 1, used or 0)
        self._set_model(layout, blob)
        self.buffer = self._new_buffer(self.version + 1)

    @classmethod
    def take_up(cls, ctx: Context, row: JobRow) -> AsyncRounds | None:
        """Start a queued job, or take up a running one again from its last written version (discarding what
        an unflushed buffer held); None (and the job failed in the store) if it cannot be."""
        store = ctx.store
        try:
            cfg = parse_round_config(row.config_yaml, source=f"job {row.id}")
            strategy = strategy_at(store, cfg, row.id, row.current_round)
            layout, blob = store.checkpoint_blob(row.id, row.current_round)
            spec = cfg.asynchronous
            if row.status == JobStatus.QUEUED:
                store.set_job(row.id, status=JobStatus.RUNNING, current_round=0, event=(
                    "job_started", 0, "", f"{cfg.rounds} versions of {cfg.strategy.name}, asynchronously (buffer "
                    f"{spec.buffer}, max staleness {spec.max_staleness}, staleness {spec.staleness.fn}"
                    + (", secure aggregation in cohorts" if cfg.privacy.secure_aggregation else "") + ")"))
                if cfg.privacy.dp is not None and cfg.privacy.dp.reproducible_noise:
                    store.event(row.id, "dp_not_private", 0, "", NOT_PRIVATE)
            else:
                discarded = store.unflushed(row.id)
                version = row.current_round
                for task in discarded:
                    store.finish_task(task.task_id, TaskStatus.DISCARDED, _unflushed(task, version),
                                      job_id=row.id, round_=task.round, site=task.site)
                store.void_issued(row.id)
                what = ("update(s) waiting for or in an unflushed cohort" if cfg.privacy.secure_aggregation
                        else "buffered update(s)")
                store.event(row.id, "job_resumed", version, "",
                            f"resuming asynchronously from version {version}; {len(discarded)} {what} discarded and "
                            "requested again")
            row = store.job(row.id)
        except (ConfigError, NotFound, IntegrityError) as exc:   # e.g. a damaged checkpoint: fail, never retry
            store.set_job(row.id, status=JobStatus.FAILED, message=str(exc), event=("job_failed", 0, "", str(exc)))
            return None
        log.info("job %s active at version %d (asynchronous)", row.id, row.current_round)
        return cls(ctx, row, cfg, strategy, layout, blob)

    # outside the lock ---------------------------------------------------------------------
    def prepare(self) -> None:
        if self.cfg.privacy.dp is not None:
            load_client_accountant()

    # the engine's questions ---------------------------------------------------------------
    def tick(self, now: float) -> float:
        if self.ended:
            return 1.0
        self._expire()
        if self.finishing:
            return self._finish_tick(now)
        if not self.started:
            online = self._online()
            if len(online) < self.cfg.sites.min:
                self._waiting(f"waiting for sites: {len(online)} of {self.cfg.sites.min} needed are online")
                return 0.5
            self.started, self.last_answer = True, now
            self.training_since = self._training_since()
            self._set_message("")
            self._check_budget()
            self.ctx.presence.wake()
            self.ctx.notify()
        idle = now - self.last_answer
        if idle > self.spec.idle_timeout_s:
            self._fail(f"no site has answered for {idle:.0f} s (asynchronous.idle_timeout_s = "
                       f"{self.spec.idle_timeout_s:g}); the model is at version {self.version}; once sites are "
                       "back, `plexus job resume` continues from there")
            return 0.0
        budget = self.spec.time_budget_s
        if budget is not None and self.ctx.clock() - self.training_since >= budget:
            self._finish(f"time budget of {self.spec.time_budget_s:g} s reached at version {self.version}")
            return 0.0
        ev = self.evaluation
        if ev is not None and ev.round == ev.version and now >= ev.deadline:
            self._judge(ev)
        if self.secure and not self.finishing:
            return self._cohort_tick(now)
        return 0.5

    def busy(self) -> Iterable[str]:
        """Sites holding a task, and under secure aggregation those waiting for or in a cohort."""
        sites = set(self.outstanding) | {t.site for t in self.forming}
        if self.cohort is not None:
            sites.update(self.cohort.participants)
        return sorted(sites)

    def grant(self, site: str) -> TaskGrant | None:
        if self.ended or site in self._declined:
            return None
        if site in self.outstanding:
            return self.outstanding[site]   # a site that restarted mid-task gets the same task back
        if self._in_cohort(site):
            return None   # its update waits for its cohort, or its cohort is between phases
        ev = self.evaluation
        if ev is not None and site in ev.sites and site not in ev.results:
            return self._issue(site, TaskKind.EVALUATE, ev.round, ev.version)
        if self.finishing or not self.started:
            return None
        if self.buffer.count(site) >= self._cap():
            return None   # it has its share of this buffer; the flush wakes it
        if site in self._benched and self.ctx.monotonic() < self._benched[site][0]:
            return None   # its last training task failed or was refused: it waits before the next
        return self._issue(site, TaskKind.TRAIN, self.version, self.version)

    def current(self, site: str, task_id: str, round_: int, status: str) -> TaskGrant:
        grant = self.outstanding.get(site)
        if grant is None or grant.task_id != task_id:
            raise RoundClosed(f"task {task_id} is no longer current: job {self.job_id} has moved on (the task was "
                              "answered, refused as stale, past its deadline, or training ended); ask for a new "
                              "task")
        check_unanswered(task_id, status, False)
        return grant

    def served(self, grant: TaskGrant, held: Held | None = None, *, zero_base: bool = False) -> ServedModel:
        if grant.model_round == self.version:
            return self.served_model
        layout, path, start = self.ctx.store.checkpoint_source(self.job_id, grant.model_round, verify=False)
        return ServedModel.from_file(layout, path, start)

    def upload(self, site: str, grant: TaskGrant, header: UpdateHeader,
               cut: Callable[[BaseException], None]) -> Upload:
        if grant.kind == TaskKind.SECAGG_MASK:
            return self._masked_upload(site, grant, header, cut)
        if self.secure:
            raise FailedPrecondition(f"task {grant.task_id}: under secure aggregation an update never leaves its "
                                     "site in the clear; a training task is answered `trained` (ReportResult)")
        if grant.kind != TaskKind.TRAIN:
            raise FailedPrecondition(f"task {grant.task_id} is a {grant.kind} task; it is answered with "
                                     "ReportResult, not an update")
        if site in self.arriving:
            raise FailedPrecondition(f"an update for task {grant.task_id} is already being received")
        buffer, dp = self.buffer, self.cfg.privacy.dp
        try:
            tau = self._check_fresh(site, grant)
            samples = self._samples(site, header.num_samples)
            metrics = kept_metrics(self, site_metrics(self._round_view(buffer.version, grant.model_round), site,
                                                      header.eval_metrics, header.metrics, samples))
            self.layout.require_same(header.require_layout(), what="update")
            fold = buffer.total.begin(staleness.weight(self.spec.staleness, tau, samples))
            upload = Upload(self.layout, self.ctx.store.spool / f"{grant.task_id}.part", fold=fold,
                            distance=Distance(self.layout, self._base(grant.model_round)) if dp else None,
                            owner=buffer, weight=fold.weight, metrics=metrics)
        except IntegrityError as exc:   # Stale is a RoundClosed: recorded by _check_fresh
            self._refuse(site, grant, TaskStatus.REJECTED, str(exc), exc.reason)
            raise
        self.arriving[site] = Arriving(grant, upload, samples, cut)
        return upload

    def accepted(self, site: str, grant: TaskGrant, header: UpdateHeader, upload: Upload) -> str:
        if grant.kind == TaskKind.SECAGG_MASK:
            return self._masked_accepted(site, grant, upload)
        arriving = self.arriving.pop(site, None)
        if self.ended or self.finishing or arriving is None or self.outstanding.get(site) is not grant:
            raise RoundClosed(f"job {self.job_id} ended training before the update was complete")
        buffer = upload.owner
        tau = self._check_fresh(site, grant)
        try:
            if self.cfg.privacy.dp is not None:   # every update within clip_norm of the model it trained from
                check_clipped(upload.norm, self.cfg.privacy.dp.clip_norm)
            upload.accept()
        except IntegrityError as exc:
            self._refuse(site, grant, TaskStatus.REJECTED, str(exc), exc.reason)
            raise
        member = Member(site, grant.task_id, grant.model_round, tau, arriving.samples, upload.weight)
        buffer.members.append(member)
        del self.outstanding[site]
        self._benched.pop(site, None)
        self.last_answer = self.ctx.monotonic()
        self.ctx.store.finish_task(grant.task_id, TaskStatus.BUFFERED,
                                   f"in the buffer of version {buffer.version}: staleness {tau}, weight "
                                   f"{upload.weight:g}", job_id=self.job_id, round_=grant.round, site=site,
                                   metrics=upload.metrics, staleness=tau)
        reply = (f"update accepted into the buffer of version {buffer.version} ({len(buffer.members)} of "
                 f"{self.spec.buffer}; staleness {tau}, weight {upload.weight:g})")
        if len(buffer.members) >= self.spec.buffer:
            self._flush()
        self.ctx.notify()
        return reply

    def refused(self, site: str, grant: TaskGrant, upload: Upload, exc: BaseException) -> None:
        """The stream failed part-way: a stale cut at a flush or an invalid chunk (rejected), a stall (late), or
        a broken stream (nothing recorded: the site may send it again while it holds the task)."""
        if grant.kind == TaskKind.SECAGG_MASK:
            return self._masked_refused(site, grant, upload, exc)
        self.arriving.pop(site, None)
        if self.outstanding.get(site) is not grant:
            return
        if isinstance(exc, Stale):
            self._stale(site, grant, str(exc))
        elif isinstance(exc, IntegrityError):
            self._refuse(site, grant, TaskStatus.REJECTED, str(exc), exc.reason)
        elif isinstance(exc, TimedOut):
            self._refuse(site, grant, TaskStatus.LATE, str(exc), None)

    def ended_upload(self, site: str, upload: Upload) -> None:
        if site in self.arriving and self.arriving[site].upload is upload:
            del self.arriving[site]
        owner = upload.owner
        if isinstance(owner, Cohort) and owner.receiving.get(site, (None,))[0] is upload:
            del owner.receiving[site]
        upload.withdraw()
        upload.discard()

    def answered(self, site: str, grant: TaskGrant, answer: SecaggAnswer | TaskResult) -> str:
        if isinstance(answer, SecaggAnswer):
            return self._cohort_answer(site, grant, answer)
        if answer.status != TaskStatus.FAILED:   # failures alone do not keep a job from its idle_timeout_s
            self.last_answer = self.ctx.monotonic()
        reason = bounded(answer.reason)
        cohort = self._cohort_of(site, grant)
        if answer.status == TaskStatus.DECLINED:
            self.ctx.store.decline(self.job_id, site, reason or "declined by site policy")
            self._declined.add(site)
            if cohort is not None:
                self._cohort_record(cohort, site, grant, TaskStatus.DECLINED, reason or "declined by site policy")
            else:
                self._refuse(site, grant, TaskStatus.DECLINED, reason or "declined by site policy", None)
            if self.evaluation is not None:
                self.evaluation.sites.discard(site)
            return "decline recorded; this site will not be asked again for this job"
        if answer.status == TaskStatus.FAILED:
            if cohort is not None:
                self._cohort_record(cohort, site, grant, TaskStatus.FAILED, reason or "the site reported a failure")
                return "failure recorded; this site drops out of its cohort"
            self._refuse(site, grant, TaskStatus.FAILED, reason or "the site reported a failure", None)
            if self.evaluation is not None and grant.kind == TaskKind.EVALUATE:
                self.evaluation.sites.discard(site)
            return "failure recorded"
        if answer.status == TaskStatus.TRAINED:
            return self._trained(site, grant)
        if grant.kind != TaskKind.EVALUATE:
            raise FailedPrecondition("a training task is answered with SubmitUpdate, not an evaluation result")
        ev = self.evaluation
        metrics = kept_metrics(self, site_metrics(self._round_view(grant.round, grant.model_round), site,
                                                  answer.eval_metrics))
        del self.outstanding[site]
        self.ctx.store.finish_task(grant.task_id, TaskStatus.EVALUATED, "", job_id=self.job_id, round_=grant.round,
                                   site=site, metrics=metrics)
        if ev is not None and ev.round == grant.round:
            ev.results[site] = {name: value for (_, _, name), value in metrics.items()}
            if ev.complete and ev.round == ev.version:
                self._judge(ev)
        self.ctx.notify()
        return "evaluation recorded"

    def stop(self, why: str, *, dropped: bool = False) -> None:
        """Dropped (the state dir failed): what is unflushed stays recorded so, and the resume discards it."""
        self.ended = True
        self._cut_all(why)
        if not dropped:   # aborted or failed: the buffer will never be flushed (a dropped one is, on resume)
            self._discard(f"the job stopped ({why})")
        if dropped:
            self.ctx.store.close_round(self.job_id, self.version + 1, status="failed", message=why,
                                       contributors=[m.site for m in self.buffer.members], total_samples=0)

    # tasks -------------------------------------------------------------------------------
    def _issue(self, site: str, kind: TaskKind, round_: int, model_round: int, *, payload: dict | None = None,
               deadline_s: float | None = None) -> TaskGrant:
        steps = self.strategy.schedule.local_steps(site, self._rows()) if kind == TaskKind.TRAIN else 0
        count = self._issued[site]
        self._issued[site] += 1
        grant = new_grant(kind=kind, job_id=self.job_id, round_=round_, model_round=model_round,
                          config_yaml=self.row.config_yaml,
                          deadline_unix_s=self.ctx.clock() + (deadline_s or self.cfg.sites.deadline_s),
                          seed=site_seed(self.cfg.seed, count, site), payload=payload, local_steps=steps)
        self.ctx.store.add_task(grant.task_id, self.job_id, round_, site, kind, grant.nonce)
        self.outstanding[site] = grant
        return grant

    def _expire(self) -> None:
        """Tasks past their deadline are late: their sites are given new ones when they ask. (A cohort's phase
        tasks end with their phase, at its own deadline.)"""
        now = self.ctx.clock()
        for site, grant in list(self.outstanding.items()):
            if now > grant.deadline_unix_s and site not in self.arriving and grant.kind not in COHORT_KINDS:
                self._refuse(site, grant, TaskStatus.LATE,
                             f"no answer within sites.deadline_s ({self.cfg.sites.deadline_s:g} s)", None)

    def _refuse(self, site: str, grant: TaskGrant, status: TaskStatus, reason: str, code: Reason | None) -> None:
        """End a site's task with an outcome other than a buffered update; it can be given a new one."""
        if self.outstanding.get(site) is grant:
            del self.outstanding[site]
        if grant.kind == TaskKind.TRAIN and (status == TaskStatus.FAILED
                                             or status == TaskStatus.REJECTED and code != Reason.STALE):
            # Its next task waits FAIL_BACKOFF_S, doubling with each failure in a row up to FAIL_BACKOFF_MAX_S: a
            # site failing every task at once cannot have the state dir record hundreds of tasks a second. (A stale
            # update is no fault of its site's: the new model goes out at once.)
            _, row = self._benched.get(site, (0.0, 0))
            wait = min(FAIL_BACKOFF_S * 2 ** min(row, 8), FAIL_BACKOFF_MAX_S)
            self._benched[site] = (self.ctx.monotonic() + wait, row + 1)
        self.ctx.store.finish_task(grant.task_id, status, bounded(reason), job_id=self.job_id, round_=grant.round,
                                   site=site, code=code)
        log.info("job %s site %s: %s (%s)", self.job_id, site, status, reason)
        self.ctx.presence.wake([site])
        self.ctx.notify()

    def _check_fresh(self, site: str, grant: TaskGrant) -> int:
        """τ of an update trained from grant.model_round, into the next version; Stale (recorded) if τ > S."""
        tau = self.version - grant.model_round
        if tau > self.spec.max_staleness:
            why = (f"the update was computed from version {grant.model_round}, {tau} versions old; "
                   f"asynchronous.max_staleness is {self.spec.max_staleness}; the site is given version "
                   f"{self.version}")
            self._stale(site, grant, why)
            raise Stale(why)
        return tau

    def _stale(self, site: str, grant: TaskGrant, why: str) -> None:
        self.buffer.refused_stale[site] += 1
        self._refuse(site, grant, TaskStatus.REJECTED, why, Reason.STALE)

    def _samples(self, site: str, num_samples: int) -> int:
        """n for an update: 1 under DP (DP-FedAvg weighs sites equally), else its num_samples, refused beyond
        the rows its site reported at Join and capped at sites.max_weight_share of all sites' rows."""
        if not 1 <= num_samples <= 2 ** 31:
            raise IntegrityError(f"num_samples must be between 1 and 2**31; got {num_samples}",
                                 reason=Reason.NUM_SAMPLES)
        rows = self._rows()
        check_rows(num_samples, rows.get(site, 0))
        if self.cfg.privacy.dp is not None:
            return 1
        return min(num_samples, weight_caps(rows, self.cfg.sites.max_weight_share)[site])

    def _cap(self) -> int:
        """A site's most updates in one buffer (1 under DP)."""
        if self.spec.max_per_buffer is not None:
            return self.spec.max_per_buffer
        return 1 if self.cfg.privacy.dp is not None else self.spec.buffer

    # the buffer --------------------------------------------------------------------------
    def _new_buffer(self, version: int, *, open_round: bool = True) -> Buffer:
        total, self._spare = self._spare, None
        sites = self.spec.buffer + len(self._rows())   # each update's part of the exact range
        if self.secure:
            total = None
        elif total is None or total.layout != self.layout:
            total = WeightedSum(self.layout, sites=sites)
        else:
            total.reset(sites=sites)
        if open_round:
            self.ctx.store.open_round(self.job_id, version, TaskKind.TRAIN)
        return Buffer(version, total)

    def _flush(self) -> None:
        """The buffer is full: the next version from its staleness-weighted mean delta, written, then served."""
        buffer = self.buffer
        version = buffer.version
        following = self._new_buffer(version + 1, open_round=False)   # its round opens once this one closes
        for site, arriving in list(self.arriving.items()):   # still streaming: into the next buffer, or stale
            tau = version - arriving.grant.model_round
            if tau > self.spec.max_staleness:
                arriving.upload.withdraw()
                arriving.cut(Stale(f"version {version} was made while the update streamed; it was computed from "
                                   f"version {arriving.grant.model_round}, {tau} versions old (asynchronous."
                                   f"max_staleness {self.spec.max_staleness}); the site is given the new version"))
                continue
            fold = following.total.begin(staleness.weight(self.spec.staleness, tau, arriving.samples))
            arriving.upload.move(fold)
            arriving.upload.owner, arriving.upload.weight = following, fold.weight
        self._write_version(self._step(self._mean(buffer)), following, flushed=[m.task_id for m in buffer.members])

    def _step(self, mean: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The server rule's step from the buffer's mean (the current model plus its mean delta)."""
        contributors = sorted({m.site for m in self.buffer.members})
        return self.strategy.rule.step(self.buffer.version, self.state, mean, contributors,
                                       population=len(self._rows()))

    def _write_version(self, state: dict[str, np.ndarray], following: Buffer, *, flushed: list[str],
                       note: str = "", ledger: dict | None = None) -> None:
        """Version `buffer.version` is `state`: checkpoint, strategy state, then the round row that turns the
        tasks in `flushed` submitted (one transaction), its ledger; then it is served and training goes on."""
        buffer, store, cfg = self.buffer, self.ctx.store, self.cfg
        version = buffer.version
        layout, blob = encode(state)
        store.save_checkpoint_blob(self.job_id, version, layout, blob)
        save_strategy(store, self.job_id, version, self.strategy)
        taus = [m.tau for m in buffer.members]
        samples = sum(m.samples for m in buffer.members)
        message = (f"{len(buffer.members)} update(s), {samples} samples, staleness "
                   + ", ".join(f"{m.site}={m.tau}" for m in buffer.members) + note)
        store.close_round(self.job_id, version, status="closed", contributors=[m.site for m in buffer.members],
                          total_samples=samples, message=message, job_update={"current_round": version},
                          flushed=flushed, metrics=self._ledger(buffer, taus) | (ledger or {}))
        store.prune_checkpoints(self.job_id, version - self.spec.max_staleness)
        self.ctx.saved(version)
        self.row = store.job(self.job_id)
        store.open_round(self.job_id, version + 1, TaskKind.TRAIN)
        self._spare = buffer.total
        self.version = version
        self._set_model(layout, blob)
        self.buffer = following
        log.info("job %s version %d: %s", self.job_id, version, message)
        if self.version >= cfg.rounds:
            self._finish(f"{cfg.rounds} versions made")
        elif self._check_budget():
            pass
        elif self.spec.evaluate_every and self.version % self.spec.evaluate_every == 0:
            self._evaluate(self.version, self.version)
        self.ctx.presence.wake()

    def _mean(self, buffer: Buffer) -> dict[str, np.ndarray]:
        """The current model plus the buffer's staleness-weighted mean delta (FedAsync: times its mixing rate)."""
        sums = buffer.total.sums()
        bases: dict[int, float] = defaultdict(float)
        for m in buffer.members:   # FedAsync mixes against the current model, FedBuff against each base
            bases[self.version if self.spec.mixing is not None else m.base] += m.weight
        for base in sorted(bases):
            model = self._base(base)
            for name in sums:
                sums[name] -= bases[base] * model[name].astype(np.float64)
        divisor = sum(m.samples for m in buffer.members)
        return self._moved({name: s / divisor * (self.spec.mixing or 1.0) for name, s in sums.items()})

    def _moved(self, delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The current model moved by the buffer's mean delta, plus central DP noise where configured."""
        buffer, dp = self.buffer, self.cfg.privacy.dp
        if dp is not None and dp.mode == "central":
            # Σ s(τ)·Δ over ≤ one clipped update per site (s ≤ 1): sensitivity clip_norm, so N(0, (zS)²) on the
            # sum is std zS/m on the mean, as in the synchronous rounds.
            std = central_std(dp.noise_multiplier, dp.clip_norm, len(buffer.members))
            seed = self.cfg.seed if dp.reproducible_noise else None
            delta = add_noise(delta, std, noise_key(seed, self.cfg.name, buffer.version, "coordinator"))
        out = {}
        for name, x in self.state.items():
            moved = x.astype(np.float64) + delta[name]
            out[name] = moved.astype(x.dtype) if is_float(x.dtype) else cast(moved, x.dtype)
        return out

    def _ledger(self, buffer: Buffer, taus: list[int]) -> dict:
        """A version's metrics: its staleness histogram, each site's contributions, stale refusals, and ε."""
        v = buffer.version
        out = {(v, "", "async", "updates"): float(len(taus)),
               (v, "", "async", "staleness_mean"): float(np.mean(taus)),
               (v, "", "async", "refused_stale"): float(sum(buffer.refused_stale.values()))}
        for site, count in buffer.refused_stale.items():
            out[(v, site, "async", "refused_stale")] = float(count)
        for tau, count in Counter(taus).items():
            out[(v, "", "async", f"staleness_{tau}")] = float(count)
        for site, count in Counter(m.site for m in buffer.members).items():
            out[(v, site, "async", "contributions")] = float(count)
        dp = self.cfg.privacy.dp
        if dp is not None:
            out[(v, "", "privacy", "epsilon")] = self._epsilon(v)
            out[(v, "", "privacy", "delta")] = dp.delta
            out[(v, "", "privacy", "sampling_rate")] = 1.0
            if dp.reproducible_noise:
                out[(v, "", "privacy", "noise_reproducible")] = 1.0
        return out

    def _epsilon(self, flushes: int) -> float:
        """ε after `flushes` flushes. Asynchronous participation is not a random sample (a site's speed decides
        when it contributes), so no amplification by sampling is claimed: each flush is a Gaussian mechanism at
        q = 1 (Kairouz et al. 2021, "Practical and private (deep) learning without sampling or shuffling")."""
        if flushes not in self.epsilons:
            dp = self.cfg.privacy.dp
            self.epsilons[flushes] = client_epsilon(dp.noise_multiplier, [1.0] * flushes, dp.delta)
        return self.epsilons[flushes]

    def _check_budget(self) -> bool:
        """Under dp.target_epsilon: end training if the next flush would exceed it."""
        dp = self.cfg.privacy.dp
        if dp is None or dp.target_epsilon is None or self.finishing:
            return False
        after = self._epsilon(self.version + 1)
        if after <= dp.target_epsilon:
            return False
        self.budget_stop = (f"privacy budget reached: version {self.version + 1} would bring ε to {after:.3f} > "
                            f"target {dp.target_epsilon} (δ={dp.delta}); stopped at version {self.version}")
        self.ctx.store.event(self.job_id, "privacy_budget_reached", self.version, "", self.budget_stop)
        self._finish(self.budget_stop)
        return True

    # evaluation and the end ---------------------------------------------------------------
    def _evaluate(self, version: int, round_: int) -> None:
        """Ask every online site to evaluate `version` when it next asks for a task (idle sites first)."""
        ev = self.evaluation
        if ev is not None and ev.round == ev.version and not ev.complete:
            self._judge(ev)   # a newer version is up: judge the older one on what came in
        self.evaluation = Evaluation(version, round_, self._online(), self.ctx.monotonic() + self.cfg.sites.deadline_s)

    def _judge(self, ev: Evaluation) -> None:
        """An evaluation is in: record it, and end training if it meets asynchronous.target."""
        if self.evaluation is ev:
            self.evaluation = None
        target = self.spec.target
        if target is None or self.finishing:
            return
        values = [(r[target.metric], r.get("num_samples", 1.0)) for r in ev.results.values() if target.metric in r]
        if not values:
            return
        mean = sum(v * w for v, w in values) / sum(w for _, w in values)
        self.ctx.store.event(self.job_id, "async_evaluated", ev.version, "",
                             f"version {ev.version}: {target.metric} {mean:.4f} over {len(values)} site(s)")
        if (mean >= target.value) if target.higher_is_better else (mean <= target.value):
            self._finish(f"target reached: {target.metric} {mean:.4f} at version {ev.version} "
                         f"({'≥' if target.higher_is_better else '≤'} {target.value:g})")

    def _finish(self, why: str) -> None:
        """Training ends: updates still arriving are cut, the unflushed buffer is discarded, and every online
        site evaluates the final model."""
        self.finishing = why
        self._cut_all(f"job {self.job_id} ended training ({why})")
        self._discard(f"training ended ({why})")
        for site, grant in list(self.outstanding.items()):
            if grant.kind == TaskKind.TRAIN:
                self._refuse(site, grant, TaskStatus.STALE, f"training ended ({why})", None)
        self.ctx.store.event(self.job_id, "async_training_ended", self.version, "", why)
        self.ctx.store.open_round(self.job_id, self.version + 1, TaskKind.EVALUATE)
        self.evaluation = Evaluation(self.version, self.version + 1, self._online(),
                                     self.ctx.monotonic() + self.cfg.sites.deadline_s)
        self.ctx.presence.wake()
        self.ctx.notify()

    def _finish_tick(self, now: float) -> float:
        ev = self.evaluation
        if not ev.complete and now < ev.deadline:
            return min(0.5, ev.deadline - now)
        evaluated = sorted(ev.results)
        message = f"{self.finishing}; final model (version {self.version}) evaluated by {len(evaluated)} site(s)"
        status = JobStatus.BUDGET_REACHED if self.budget_stop else JobStatus.COMPLETED
        self.ctx.store.close_round(self.job_id, ev.round, status="closed", contributors=evaluated, total_samples=0,
                                   message=message, job_update={"status": status, "message": message},
                                   event=("job_completed", message), late=f"by the final evaluation's deadline "
                                   f"({self.cfg.sites.deadline_s:g} s)")
        self.ended = True
        self.ctx.notify()
        return 0.0

    def _discard(self, why: str) -> None:
        """The unflushed buffer's updates will never be in a model: recorded as discarded, with why."""
        for m in self.buffer.members:
            self.ctx.store.finish_task(m.task_id, TaskStatus.DISCARDED,
                                       f"{why} before the buffer of version {self.buffer.version} filled; the "
                                       "update is in no model", job_id=self.job_id, round_=m.base, site=m.site)
        self.buffer.members.clear()
        if self.cohort is not None:
            self._drop_cohort(self.cohort, f"{why} while cohort {self.cohort.round} ran")
        for t in self.forming:
            self.ctx.store.finish_task(t.task_id, TaskStatus.DISCARDED,
                                       f"{why} before its cohort started; the update, kept at the site, is in no "
                                       "model", job_id=self.job_id, round_=t.base, site=t.site)
        self.forming.clear()

    def _fail(self, message: str) -> None:
        self._cut_all(message)
        self._discard(f"the job failed ({message})")
        self.ctx.store.close_round(self.job_id, self.buffer.version, status="failed", message=message,
                                   contributors=[m.site for m in self.buffer.members], total_samples=0,
                                   job_update={"status": JobStatus.FAILED, "message": message},
                                   event=("job_failed", message))
        self.ended = True
        self.ctx.notify()

    def _cut_all(self, why: str) -> None:
        for arriving in list(self.arriving.values()):
            arriving.cut(RoundClosed(why))
        if self.cohort is not None:
            for _, cut in list(self.cohort.receiving.values()):
                cut(RoundClosed(why))

    # secure aggregation: cohorts (coordinator/drivers/cohort.py) --------------------------------
    def _in_cohort(self, site: str) -> bool:
        """The site's kept update waits in the forming cohort, or it is in the running cohort's current phase."""
        return any(t.site == site for t in self.forming) or (
            self.cohort is not None and site in self.cohort.participants)

    def _cohort_of(self, site: str, grant: TaskGrant) -> Cohort | None:
        """The running cohort, if `grant` is one of its current phase's tasks."""
        cohort = self.cohort
        return cohort if cohort is not None and cohort.grants.get(site) is grant else None

    def _floor(self) -> int:
        """The fewest members a cohort starts with, and the fewest contributors it may end with."""
        return max(MIN_SECURE_COHORT, self.cfg.sites.min)

    def _trained(self, site: str, grant: TaskGrant) -> str:
        """A training task answered `trained`: the update stays at its site, which joins the forming cohort."""
        if not self.secure or grant.kind != TaskKind.TRAIN:
            raise FailedPrecondition(f"task {grant.task_id} is a {grant.kind} task; `trained` answers a training "
                                     "task of an asynchronous job under secure aggregation")
        tau = self._check_fresh(site, grant)   # Stale (recorded) if versions moved on too far meanwhile
        del self.outstanding[site]
        now = self.ctx.monotonic()
        self.forming.append(Trained(site, grant.task_id, grant.model_round, now))
        self.ctx.store.finish_task(grant.task_id, TaskStatus.TRAINED,
                                   f"trained from version {grant.model_round}; the update stays at the site until "
                                   f"its cohort masks it ({len(self.forming)} of {self.spec.buffer} waiting)",
                                   job_id=self.job_id, round_=grant.round, site=site, staleness=tau)
        waiting = len(self.forming)
        self._start_cohort(now)
        self.ctx.notify()
        return (f"training recorded; the update stays at this site until its cohort starts ({waiting} of "
                f"{self.spec.buffer} waiting)")

    def _cohort_tick(self, now: float) -> float:
        """Close the running cohort's phase once every member answered or its deadline passed; start the next
        cohort once one can."""
        cohort = self.cohort
        if cohort is not None:
            decision = decide(RoundView(kind="train", participants=cohort.participants, outcomes=cohort.outcomes,
                                        receiving=bool(cohort.receiving), deadline=cohort.deadline, secure=True), now)
            if decision.action == Action.WAIT:
                return min(0.5, decision.wait_s)
            self._advance(cohort, now)
        if self.cohort is None and not self.finishing:
            self._start_cohort(now)
        return 0.5

    def _start_cohort(self, now: float) -> None:
        """Start a cohort from the forming one at the current version, if it has filled or waited long enough."""
        if self.cohort is not None or self.finishing or self.ended or not self.forming:
            return
        for t in list(self.forming):   # made stale by the versions flushed while it waited
            tau = self.version - t.base
            if tau > self.spec.max_staleness:
                self.forming.remove(t)
                self.buffer.refused_stale[t.site] += 1
                self.ctx.store.finish_task(t.task_id, TaskStatus.REJECTED,
                                           f"its update, kept at the site, was computed from version {t.base}, {tau} "
                                           f"versions old by the time a cohort could take it (asynchronous."
                                           f"max_staleness {self.spec.max_staleness}); the site is given version "
                                           f"{self.version}", job_id=self.job_id, round_=t.base, site=t.site,
                                           code=Reason.STALE)
                self.ctx.presence.wake([t.site])
        count = cohort_size([t.joined for t in self.forming], now, buffer=self.spec.buffer,
                            timeout_s=self.spec.cohort_timeout_s, floor=self._floor())
        if not count:
            return
        members, self.forming = self.forming[:count], self.forming[count:]
        self._cohort_round += 1
        secure = SecureRound(self.job_id, self._cohort_round, self.layout, self.cfg.privacy.secagg, self._floor(),
                             max_weight=staleness.MAX_FIXED_WEIGHT)
        cohort = Cohort(self._cohort_round, self.version, {t.site: t for t in members}, secure, now)
        self.cohort = cohort
        why = ("full" if count == self.spec.buffer else
               f"{count} of {self.spec.buffer} after asynchronous.cohort_timeout_s ({self.spec.cohort_timeout_s:g} s)")
        self.ctx.store.event(self.job_id, "cohort_started", cohort.round, "",
                             f"cohort {cohort.round} for version {self.version + 1} ({why}): "
                             + ", ".join(f"{t.site} (τ {self.version - t.base})" for t in members))
        self._open_phase(cohort, sorted(cohort.members), now)

    def _open_phase(self, cohort: Cohort, participants: list[str], now: float) -> None:
        """Give each of the phase's sites its task: the phase's payload, and the cohort's version."""
        sec, timeout = cohort.secure, self.cfg.privacy.secagg.phase_timeout_s
        cohort.participants, cohort.grants, cohort.outcomes = participants, {}, {}
        cohort.deadline = now + timeout
        for site in participants:
            cohort.grants[site] = self._issue(site, sec.task_kind, cohort.round, cohort.members[site].base,
                                              payload=sec.payload(site) | {"version": cohort.version},
                                              deadline_s=timeout)
        self.ctx.store.event(self.job_id, f"secagg_{sec.phase}", cohort.round, "",
                             f"cohort {cohort.round}: {len(participants)} site(s): " + ", ".join(participants))
        self.ctx.presence.wake(participants)
        self.ctx.notify()

    def _cohort_answer(self, site: str, grant: TaskGrant, answer: SecaggAnswer) -> str:
        """An advert (its weight checked against the member's τ and rows), shares, or a reveal."""
        cohort = self._cohort_of(site, grant)
        if cohort is None or site in cohort.outcomes:
            raise RoundClosed(f"task {grant.task_id} is no longer current: cohort {grant.round} of job "
                              f"{self.job_id} has moved to its next phase or ended")
        sec, value, metrics = cohort.secure, answer.value, None
        try:
            if answer.body == "advert":
                tau = cohort.tau(site)
                n = advert_samples(self.spec.staleness, tau, value.num_samples, self._rows().get(site, 0),
                                   dp=self.cfg.privacy.dp is not None)
                sec.on_advert(site, value)
                cohort.samples[site] = n
                metrics = kept_metrics(self, site_metrics(
                    self._round_view(cohort.version + 1, cohort.members[site].base), site, answer.eval_metrics,
                    answer.metrics, n))
            elif answer.body == "shares":
                sec.on_shares(site, value)
            else:
                sec.on_reveal(site, value)
        except IntegrityError as exc:
            self._cohort_record(cohort, site, grant, TaskStatus.REJECTED, str(exc), code=exc.reason)
            raise
        self.last_answer = self.ctx.monotonic()
        self._cohort_record(cohort, site, grant, TaskStatus.SUBMITTED,
                            f"{answer.body} in cohort {cohort.round} (version {cohort.version + 1})", metrics)
        return f"{answer.body} for cohort {cohort.round} accepted"

    def _masked_upload(self, site: str, grant: TaskGrant, header: UpdateHeader,
                       cut: Callable[[BaseException], None]) -> Upload:
        cohort = self._cohort_of(site, grant)
        if cohort is None or site in cohort.outcomes:
            raise RoundClosed(f"task {grant.task_id} is no longer current: cohort {grant.round} of job "
                              f"{self.job_id} has moved to its next phase or ended")
        if site in cohort.receiving:
            raise FailedPrecondition(f"a masked input for task {grant.task_id} is already being received")
        sec = cohort.secure
        try:
            sec.masked_layout.require_same(header.require_layout(), what="masked input")
            upload = Upload(sec.masked_layout, self.ctx.store.spool / f"{grant.task_id}.part",
                            fold=sec.masked.begin(), owner=cohort)
        except IntegrityError as exc:
            self._cohort_record(cohort, site, grant, TaskStatus.REJECTED, str(exc), code=exc.reason)
            raise
        cohort.receiving[site] = (upload, cut)
        return upload

    def _masked_accepted(self, site: str, grant: TaskGrant, upload: Upload) -> str:
        cohort = upload.owner
        cohort.receiving.pop(site, None)
        if self.ended or self.cohort is not cohort or cohort.grants.get(site) is not grant or site in cohort.outcomes:
            raise RoundClosed(f"cohort {grant.round} of job {self.job_id} moved on before the masked input was "
                              "complete")
        upload.accept()
        self.last_answer = self.ctx.monotonic()
        self._cohort_record(cohort, site, grant, TaskStatus.SUBMITTED,
                            f"masked input in cohort {cohort.round} (version {cohort.version + 1})")
        return f"masked input for cohort {cohort.round} accepted"

    def _masked_refused(self, site: str, grant: TaskGrant, upload: Upload, exc: BaseException) -> None:
        cohort = upload.owner
        if cohort.receiving.get(site, (None,))[0] is upload:
            del cohort.receiving[site]
        status = TaskStatus.REJECTED if isinstance(exc, IntegrityError) else \
            TaskStatus.LATE if isinstance(exc, TimedOut) else None
        if status is not None and self.cohort is cohort and cohort.grants.get(site) is grant \
                and site not in cohort.outcomes:
            self._cohort_record(cohort, site, grant, status, str(exc), code=getattr(exc, "reason", None))

    def _cohort_record(self, cohort: Cohort, site: str, grant: TaskGrant, status: TaskStatus, reason: str,
                       metrics: dict | None = None, *, code: Reason | None = None) -> None:
        """A member's answer (or its absence) in the current phase. The answers are recorded as a synchronous
        round's phases are (submitted, late, ...); what becomes of the update they carry is recorded on the
        member's training task (trained, then submitted or discarded)."""
        cohort.outcomes[site] = status
        if self.outstanding.get(site) is grant:
            del self.outstanding[site]
        # An update's outcome is evented at the version it trained from, as `job watch` reads it.
        event_round = cohort.members[site].base if status == TaskStatus.REJECTED else grant.round
        self.ctx.store.finish_task(grant.task_id, status, bounded(reason), job_id=self.job_id, round_=event_round,
                                   site=site, metrics=metrics, code=code)
        if status != TaskStatus.SUBMITTED:
            log.info("job %s cohort %d site %s: %s (%s)", self.job_id, cohort.round, site, status, reason)
        self.ctx.notify()

    def _advance(self, cohort: Cohort, now: float) -> None:
        """Close the current phase with the members that answered; open the next, or make the version."""
        sec = cohort.secure
        for site in cohort.participants:
            if site not in cohort.outcomes:
                self._cohort_record(cohort, site, cohort.grants[site], TaskStatus.LATE,
                                    f"no answer in the {sec.phase} phase of cohort {cohort.round} within "
                                    f"secagg.phase_timeout_s ({self.cfg.privacy.secagg.phase_timeout_s:g} s)")
        for site, (upload, cut) in list(cohort.receiving.items()):   # masked inputs still arriving: out of the sum
            cut(RoundClosed(f"the mask phase of cohort {cohort.round} ended before the masked input was complete"))
            upload.withdraw()
        answered = sorted(s for s, o in cohort.outcomes.items() if o == TaskStatus.SUBMITTED)
        try:
            following = sec.advance(answered, cohort.participants)
            # Σ_{U3} w·Δ / Σ_{U3} w, and Σ_{U3} w in 2^-16 units (w = quanta(τ)·n)
            unmasked = sec.result() if sec.phase == SecaggPhase.DONE else None
        except PlexusError as exc:   # too few members answered a phase, or too few honest shares
            self._drop_cohort(cohort, f"cohort {cohort.round} failed: {exc}")
            return
        if unmasked is not None:
            self._cohort_done(cohort, *unmasked, now)
        else:
            self._open_phase(cohort, following, now)

    def _cohort_done(self, cohort: Cohort, delta: dict[str, np.ndarray], weight: int, now: float) -> None:
        """The survivors' weighted mean `delta` (of total weight `weight`), renormalised to FedBuff's
        Σ s·n·Δ / Σ n, becomes the next version by the same write as a plain buffer's flush."""
        sec, store = cohort.secure, self.ctx.store
        for site, reason in sorted(sec.rejected.items()):   # their masked inputs are in the sum all the same
            store.finish_task(cohort.grants[site].task_id, TaskStatus.REJECTED, bounded(reason), job_id=self.job_id,
                              round_=cohort.members[site].base, site=site)
            log.warning("job %s cohort %d site %s: rejected (%s)", self.job_id, cohort.round, site, reason)
        survivors = list(sec.u3)
        buffer = self.buffer
        for site in survivors:
            t, tau, n = cohort.members[site], cohort.tau(site), cohort.samples[site]
            weight_n = staleness.weight(self.spec.staleness, tau, n)
            buffer.members.append(Member(site, t.task_id, t.base, tau, n, weight_n))
        dropped = sorted(set(cohort.members) - set(survivors))
        for site in dropped:
            t = cohort.members[site]
            store.finish_task(t.task_id, TaskStatus.DISCARDED,
                              f"dropped out of cohort {cohort.round} before its masked input was in; the update, "
                              "kept at the site, is in no model", job_id=self.job_id, round_=t.base, site=site)
        samples = sum(m.samples for m in buffer.members)
        scale = weight * staleness.QUANTUM / samples   # Σ w·2^-16 = Σ s·n over the survivors (no mixing: K ≥ 3)
        state = self._step(self._moved({name: d * scale for name, d in delta.items()}))
        self.cohort = None
        following = self._new_buffer(buffer.version + 1, open_round=False)
        note = (f"; secure cohort {cohort.round} of {len(cohort.members)} in {now - cohort.started:.1f} s"
                + (f", dropped: {', '.join(dropped)}" if dropped else ""))
        v = buffer.version
        self._write_version(state, following, note=note,
                            flushed=[m.task_id for m in buffer.members],
                            ledger={(v, "", "async", "cohort_round"): float(cohort.round),
                                    (v, "", "async", "cohort_dropped"): float(len(dropped))})

    def _drop_cohort(self, cohort: Cohort, why: str) -> None:
        """A cohort that makes no version: its members' updates are discarded, with why (its unanswered tasks
        turn stale), and the members are given new training tasks."""
        store = self.ctx.store
        self.cohort = None
        for _, cut in list(cohort.receiving.values()):
            cut(RoundClosed(why))
        for site, grant in cohort.grants.items():
            if self.outstanding.get(site) is grant:
                del self.outstanding[site]
                store.finish_task(grant.task_id, TaskStatus.STALE, bounded(why), job_id=self.job_id,
                                  round_=grant.round, site=site)
        for site, t in cohort.members.items():
            store.finish_task(t.task_id, TaskStatus.DISCARDED,
                              bounded(f"{why}; the update, kept at the site, is in no model, and the site is given "
                                      "a new training task"), job_id=self.job_id, round_=t.base, site=site)
        store.event(self.job_id, "cohort_failed", cohort.round, "", bounded(why))
        log.warning("job %s: %s", self.job_id, why)
        self.ctx.presence.wake(list(cohort.members))
        self.ctx.notify()

    # the model ---------------------------------------------------------------------------
    def _set_model(self, layout: Layout, blob) -> None:
        self.layout, self.blob = layout, blob
        self.state = decode(layout, blob)
        self.served_model = ServedModel.in_memory(layout, blob)
        self._bases[self.version] = self.state
        for old in [v for v in self._bases if v < self.version - self.spec.max_staleness]:
            del self._bases[old]

    def _base(self, version: int) -> dict[str, np.ndarray]:
        """Model version `version`, decoded (read from its checkpoint the first time)."""
        if version not in self._bases:
            self._bases[version] = decode(*self.ctx.store.checkpoint_blob(self.job_id, version))
        return self._bases[version]

    def _training_since(self) -> float:
        """When training first started, on the driver's wall clock, kept in the job's metrics: time_budget_s
        counts from there through restarts and resumes, not from a wait for sites.min."""
        key = (0, "", "timing", "training_started_unix_s")   # not "async": that kind is per version
        since = next((m.value for m in self.ctx.store.metrics(self.job_id)
                      if (m.round, m.site, m.kind, m.name) == key), None)
        if since is None:
            since = self.ctx.clock()
            self.ctx.store.record_metrics(self.job_id, {key: since})
        return since

    # small things ------------------------------------------------------------------------
    def _rows(self) -> dict[str, int]:
        return self.ctx.presence.rows(self.cfg.data.dataset)

    def _online(self) -> set[str]:
        return (self.ctx.presence.online() | set(self.busy())) - self._declined

    def _round_view(self, round_: int, model_round: int) -> SimpleNamespace:
        """What site_metrics reads of a round: where train and eval metrics go, and the eval weights' caps."""
        rows = self._rows()
        return SimpleNamespace(round=round_, model_round=model_round,
                               eval_caps=weight_caps(rows, self.cfg.sites.max_weight_share) if rows else {})

    def _waiting(self, message: str) -> None:
        if self.row.message != message:
            self._set_message(message)

    def _set_message(self, message: str) -> None:
        if self.row.message != message:
            self.ctx.store.set_job(self.job_id, message=message)
            self.row = self.ctx.store.job(self.job_id)


def _unflushed(task, version: int) -> str:
    """Why a task that no version took in is discarded when the job is taken up again."""
    if task.status == TaskStatus.TRAINED:
        return ("its update, kept at the site, was waiting for or in a cohort that had not made a version when the "
                "job stopped; it is in no model, and the site is given a new task")
    return (f"its update was in the unflushed buffer of version {version + 1} when the job stopped; it is in no "
            "model, and the site is given a new task")
