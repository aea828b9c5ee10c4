"""A relay's tier: one round among its children for each task its parent gives it.

`RelayRounds` is the synchronous round cycle (coordinator/drivers/sync.py) with two changes. A round opens
when the parent's task arrives (the upstream client posts it in the `Mailbox`), on the model the parent
served, with the parent's round number, so every child gets the task, the model and the seed
(`site_seed(job seed, round, child)`) a flat federation would give it. And at its close the round makes
no model: its exact fixed-point sum of the children's updates (the integers the parent would have folded
for each of them) goes back up, with the children's total weight, as the relay's one update.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from coordinator.drivers import Context
from coordinator.drivers.rounds import Action
from coordinator.drivers.sync import ActiveJob, RoundState, SyncRounds, partial_sum_problem, weight_caps
from coordinator.secure_round import SecureRound
from coordinator.served import ServedModel
from coordinator.store import JobRow
from coordinator.strategies import make_strategy
from plexus.compression import job_uplink
from plexus.config import RoundConfig, TierSpec, parse_round_config
from plexus.errors import ConfigError
from plexus.vocab import JobStatus, TaskKind, TaskStatus
from plexus.wire import Layout

log = logging.getLogger("plexus.relay")

# Rules that step from the mean of the updates (or take it as the model): a relay's exact partial sum stands
# in for its children's updates in that mean. The others need every update, pick sites one by one, or keep
# per-site state at the coordinator.
RELAYED = ("fedavg", "fedadagrad", "fedadam", "fedavgm", "fedprox", "fedyogi")


def relay_problem(cfg: RoundConfig) -> str:
    """Why a relay cannot stand for its children in this job ('' if it can)."""
    if cfg.strategy.name not in RELAYED:
        return f"strategy {cfg.strategy.name} does not run through relays yet (they run {', '.join(RELAYED)})"
    if cfg.compression is not None:
        return "its updates or model travel compressed (compression)"
    if cfg.privacy.secure_aggregation and cfg.privacy.dp is None and cfg.asynchronous is None:
        return ""   # masked within each tier: children towards the relay, the relay's mean towards its parent
    return partial_sum_problem(cfg, make_strategy(cfg), job_uplink(cfg))


@dataclass
class Offer:
    """A task from the parent, with the model it served: what the relay's next round runs."""

    task_id: str
    kind: TaskKind            # TRAIN or EVALUATE
    round: int
    model_round: int
    deadline: float           # monotonic: the relay answers its parent by then
    layout: Layout
    blob: bytes


@dataclass
class Answer:
    """What the relay tells its parent for one task."""

    task_id: str
    status: str               # "sum" (train), "delta" (secure train), "evaluated", "failed"
    reason: str = ""
    exact: np.ndarray | None = None      # the sum, fixed point, in `layout`'s order
    delta: dict[str, np.ndarray] | None = None   # secure aggregation: the survivors' mean Δ, unmasked here
    layout: Layout | None = None
    weight: int = 0
    updates: int = 0
    contributors: tuple[str, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)


class Mailbox:
    """Between the relay's upstream client and its tier's driver: offers down, answers up. Its lock is taken
    last (inside the engine lock, never around it)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._offers: dict[str, Offer] = {}
        self._answers: dict[str, Answer] = {}

    def post(self, job_id: str, offer: Offer) -> None:
        with self._cv:
            self._offers[job_id] = offer

    def take(self, job_id: str) -> Offer | None:
        with self._cv:
            return self._offers.pop(job_id, None)

    def answer(self, answer: Answer) -> None:
        with self._cv:
            self._answers[answer.task_id] = answer
            self._cv.notify_all()

    def wait_answer(self, task_id: str, timeout: float) -> Answer | None:
        with self._cv:
            self._cv.wait_for(lambda: task_id in self._answers, timeout)
            return self._answers.pop(task_id, None)


def weighted_means(values: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Per metric name, the mean over children weighted by each one's weight (num_samples kept as the sum)."""
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    for weight, metrics in values:
        for name, value in metrics.items():
            if name == "num_samples":
                continue
            totals[name] = totals.get(name, 0.0) + weight * value
            weights[name] = weights.get(name, 0.0) + weight
    out = {name: totals[name] / weights[name] for name in totals if weights[name] > 0}
    if values:
        out["num_samples"] = float(sum(weight for weight, _ in values))
    return out


class RelayRounds(SyncRounds):
    """The synchronous round cycle of a job the relay's parent runs, one round per task from the parent."""

    def __init__(self, ctx: Context, job: ActiveJob, mailbox: Mailbox, tier: TierSpec):
        super().__init__(ctx, job)
        self.mailbox, self.tier = mailbox, tier
        self.offer: Offer | None = None

    @classmethod
    def factory(cls, mailbox: Mailbox, tier: TierSpec):
        """What the relay's engine takes up each job with."""
        return lambda ctx, row: cls.take_up_relayed(ctx, row, mailbox, tier)

    @classmethod
    def take_up_relayed(cls, ctx: Context, row: JobRow, mailbox: Mailbox, tier: TierSpec) -> RelayRounds | None:
        store = ctx.store
        try:
            cfg = parse_round_config(row.config_yaml, source=f"job {row.id}")
            if problem := relay_problem(cfg):
                raise ConfigError(problem)
        except ConfigError as exc:
            store.set_job(row.id, status=JobStatus.FAILED, message=str(exc), event=("job_failed", 0, "", str(exc)))
            return None
        if row.status == JobStatus.QUEUED:
            store.set_job(row.id, status=JobStatus.RUNNING,
                          event=("job_started", 0, "", f"relaying {cfg.strategy.name} rounds of the parent's job"))
        else:
            store.event(row.id, "job_resumed", row.current_round, "", "the relay restarted; waiting for the parent's "
                        "task")
        job = ActiveJob(store.job(row.id), cfg, make_strategy(cfg), None, {}, None, row.current_round,
                        activated=ctx.monotonic())
        log.info("relaying job %s from round %d", row.id, row.current_round)
        return cls(ctx, job, mailbox, tier)

    # the round cycle ----------------------------------------------------------------------------
    def _maybe_open_round(self, now: float) -> float:
        job, store = self.job, self.ctx.store
        if self.offer is None:
            self.offer = self.mailbox.take(job.row.id)
            if self.offer is None:
                self._waiting("waiting for the parent's next task")
                return 0.5
            self._install(self.offer)
        offer = self.offer
        if now >= offer.deadline:
            self._answer_failed(f"no round could open at the relay before its parent's deadline: {job.row.message}")
            return 0.0
        declined = store.declines(job.row.id)
        online = sorted(self._present() - set(declined))
        known = sorted({row[0] for row in store.sites()} - set(declined))
        missing = sorted(set(known) - set(online))
        if missing and not job.opened_any and now - job.activated < self.ctx.rejoin_grace_s:
            self._waiting(f"waiting up to {self.ctx.rejoin_grace_s:g}s for the relay's children to connect: "
                          + ", ".join(missing))
            return 0.5
        evaluating = offer.kind == TaskKind.EVALUATE
        if len(online) < (1 if evaluating else self.tier.sites_min):
            self._waiting(f"waiting for children: {len(online)} of {self.tier.sites_min} needed (tier.sites_min) "
                          "are online")
            return 0.5
        job.opened_any = True
        kind = TaskKind.EVALUATE if evaluating else TaskKind.TRAIN
        store.open_round(job.row.id, offer.round, kind)
        store.set_job(job.row.id, message="")
        job.row = store.job(job.row.id)
        sizes = self._sizes()
        rows = {s: sizes[s] for s in online if s in sizes}
        deadline = min(now + self.tier.deadline_s, offer.deadline)
        secure = None
        if job.cfg.privacy.secure_aggregation and not evaluating:
            secure = SecureRound(job.row.id, offer.round, job.layout, job.cfg.privacy.secagg, self.tier.sites_min,
                                 seed=job.cfg.seed)
        self.round = RoundState(round=offer.round, kind=kind, model_round=offer.model_round, participants=online,
                                deadline=deadline, secure=secure,
                                total=None if evaluating or secure else job.round_sum(len(online)),
                                rows=rows, caps=weight_caps(rows, job.cfg.sites.max_weight_share),
                                eval_caps=weight_caps(rows, job.cfg.sites.max_weight_share))
        log.info("job %s round %d (%s) opened at the relay for %s", job.row.id, offer.round, kind, ", ".join(online))
        self.ctx.notify()
        self.ctx.presence.wake(online)
        return 0.5

    def _install(self, offer: Offer) -> None:
        """Serve the parent's model, as it came: sites fetch exactly the bytes a flat federation serves."""
        job = self.job
        job.layout = job.update_layout = offer.layout
        job.state, job.blob = {}, None
        job.served = ServedModel.in_memory(offer.layout, offer.blob)
        job.model_round = offer.model_round

    def _needed(self) -> int:
        return self.tier.sites_min if self.round is None or self.round.kind == TaskKind.TRAIN else 1

    def _late(self) -> str:
        return f"by the relay's round deadline (tier.deadline_s {self.tier.deadline_s:g} s, or the parent's)"

    def _decided(self, rs: RoundState, decision) -> None:
        """End the tier's round: its sum (or evaluation) goes to the parent, or the parent hears it failed."""
        if rs.kind == TaskKind.EVALUATE:
            evaluated = sorted(s for s, o in rs.outcomes.items() if o == TaskStatus.EVALUATED)
            if not evaluated:
                self._fail_round(rs, "no child evaluated the model")
            else:
                _, means = self._means(rs, evaluated)
                self._finish(rs, Answer(self.offer.task_id, "evaluated", eval_metrics=means), evaluated, 0,
                             f"{len(evaluated)} child(ren) evaluated the model; sent to the parent")
        elif decision.action == Action.CLOSE:
            contributors = sorted(rs.contributors)
            train, evaluation = self._means(rs, contributors)
            answer = Answer(self.offer.task_id, "sum", exact=rs.total.exact(), layout=rs.total.layout,
                            weight=rs.total.total_weight, updates=rs.total.count, contributors=tuple(contributors),
                            metrics=train, eval_metrics=evaluation)
            self._finish(rs, answer, contributors, rs.samples,
                         f"{len(contributors)} update(s), {rs.samples} samples: their exact sum sent to the parent")
        else:
            problems = ", ".join(f"{s}: {o}" for s, o in sorted(rs.outcomes.items()) if o != TaskStatus.SUBMITTED)
            self._fail_round(rs, f"{len(rs.contributors)} update(s), below tier.sites_min={self.tier.sites_min} (other "
                           f"children — {problems or 'none'})")

    def _means(self, rs: RoundState, sites: list[str]) -> tuple[dict[str, float], dict[str, float]]:
        """The children's train metrics of this round and eval metrics of the incoming model, each averaged over
        `sites` weighted by its num_samples: what the relay reports as its own."""
        train: dict[str, dict[str, float]] = {s: {} for s in sites}
        evaluation: dict[str, dict[str, float]] = {s: {} for s in sites}
        for r, s, k, n, v in self.ctx.store.metrics(self.job.row.id):
            if s in train and (r, k) in ((rs.round, "train"), (rs.model_round, "eval")):
                (train if k == "train" else evaluation)[s][n] = v
        return tuple(weighted_means([(m.get("num_samples", 1.0), m) for m in per.values()])
                     for per in (train, evaluation))

    def _finish(self, rs: RoundState, answer: Answer, contributors: list[str], samples: int, message: str) -> None:
        store = self.ctx.store
        store.close_round(self.job.row.id, rs.round, status="closed", contributors=contributors,
                          total_samples=samples, message=message, job_update={"current_round": rs.round},
                          late=rs.late)
        self.job.row = store.job(self.job.row.id)
        self.mailbox.answer(answer)
        log.info("job %s round %d at the relay: %s", self.job.row.id, rs.round, message)
        self.round, self.offer = None, None

    def _unmasked(self, rs: RoundState, delta: dict[str, np.ndarray]) -> None:
        """The tier's secure round is unmasked: its survivors' mean Δ goes up, to be masked towards the parent."""
        contributors = sorted(rs.contributors)
        train, evaluation = self._means(rs, contributors)
        answer = Answer(self.offer.task_id, "delta", delta=delta, layout=self.job.layout, weight=rs.samples,
                        updates=len(contributors), contributors=tuple(contributors), metrics=train,
                        eval_metrics=evaluation)
        self._finish(rs, answer, contributors, rs.samples, f"{len(contributors)} masked update(s), {rs.samples} "
                     "samples: their mean masked again towards the parent")

    def _fail_round(self, rs: RoundState, why: str, *, retry: bool = False) -> None:
        """The tier's round produced nothing: recorded here, and the parent told the task failed (it retries)."""
        rs.drop_held()
        message = f"round {rs.round} failed at the relay: {why}"
        self.ctx.store.close_round(self.job.row.id, rs.round, status="failed", contributors=sorted(rs.contributors),
                                   total_samples=rs.samples, message=message, job_update={"message": message},
                                   late=rs.late)
        self._answer_failed(message)

    def _answer_failed(self, message: str) -> None:
        self.mailbox.answer(Answer(self.offer.task_id, "failed", reason=message))
        log.warning("job %s: %s", self.job.row.id, message)
        self.round, self.offer = None, None

    def end(self, message: str) -> None:
        """The parent moved on (another job) or ended this one: the relayed job ends too."""
        self.ctx.store.set_job(self.job.row.id, status=JobStatus.COMPLETED, message=message,
                               event=("job_completed", self.job.model_round, "", message))
        if self.round is not None:
            self.round.end_uploads(message)
        self._end()
