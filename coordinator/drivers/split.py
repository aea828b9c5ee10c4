"""SplitRounds: split learning (Gupta & Raskar 2018; Vepakomma et al. 2018) as a driver with per-batch sessions.

Each of the job's `rounds` is one epoch. Its training phase runs the sites' Split sessions against the server part,
which computes in a compute worker process (coordinator/split_worker.py; this process never imports torch):
- `sequential`: the sites take turns, in name order; each fetches the site-side weights the previous one left and
  sends its own back at its session's end.
- `splitfed`: every site trains a copy of the same site-side weights at once; the server part takes their batches
  in a fixed order (batch t of every site, in name order, before batch t+1 of any: `Turns`), so a seeded run gives
  the same model bit for bit; the copies are averaged by rows at the end.
- `synchronous`: each server step takes every site's share of the turn's rows, and the sites step on the sum of
  their gradients, so their parts stay equal (coordinator/drivers/split_sync.py).
Then every site evaluates the joined model on its held-out rows (the site runs its parts, the server its part),
the joined model (the site's parts and the server's, under the model's own names) is checkpointed and the round
closes. A site that drops mid-epoch (its stream breaks, or no message within split.batch_timeout_s) is recorded
failed and the schedule goes on without it; a SIGKILL of the coordinator resumes from the last closed epoch.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from coordinator.drivers import Context
from coordinator.drivers.sync import check_rows, checked_metrics, weight_caps
from coordinator.served import Held, ServedModel
from coordinator.split_worker import SplitWorker
from coordinator.store import JobRow
from coordinator.tasks import (
    TaskGrant,
    TaskResult,
    UpdateHeader,
    check_current,
    check_unanswered,
    new_grant,
    site_seed,
)
from plexus.config import MAX_TURNS, RoundConfig, parse_round_config
from plexus.errors import ConfigError, FailedPrecondition, IntegrityError, NotFound, Reason, RoundClosed
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.split_wire import array_of, tensor_message, weights_of
from plexus.text import bounded
from plexus.vocab import JobStatus, TaskKind, TaskStatus
from plexus.wire import encode

log = logging.getLogger("plexus.coordinator")

MAX_EVAL_ROWS = 256   # rows per evaluation batch (a site's training batches are train.batch_size)


class Turns:
    """The order in which the server part takes the sites' training batches: batch t of every site still in the
    epoch, in `order`, before batch t+1 of any. A site's plan (its number of batches) is known once its session
    opens; until then a turn that is its waits for it (the driver drops a site that never opens)."""

    def __init__(self, order: list[str], monotonic: Callable[[], float]):
        self.order = list(order)
        self.plans: dict[str, int] = {}
        self.gone: set[str] = set()
        self._t, self._k = 0, 0
        self._mono = monotonic
        self.since = monotonic()          # when the current turn began
        self._cv = threading.Condition()

    def open(self, site: str, batches: int) -> None:
        with self._cv:
            self.plans[site] = batches
            self._settle()

    def leave(self, site: str) -> None:
        """The site is out of the epoch (dropped, or its session ended): no turn waits for it again."""
        with self._cv:
            self.gone.add(site)
            self._settle()

    def current(self) -> tuple[int, str] | None:
        with self._cv:
            return self._turn()

    def wait(self, site: str, seq: int, cut: Callable[[], BaseException | None]) -> None:
        """Block until batch `seq` of `site` is the server's; `cut()` returning an error ends the wait with it."""
        with self._cv:
            while self._turn() != (seq, site):
                if site in self.gone or self._turn() is None:
                    raise RoundClosed(f"batch {seq} of site {site} has no turn at the server this epoch")
                if (exc := cut()) is not None:
                    raise exc
                self._cv.wait(0.5)

    def done(self, site: str, seq: int) -> None:
        """Batch `seq` of `site` is through the server: the next turn."""
        with self._cv:
            if self._turn() == (seq, site):
                self._k += 1
                self._settle()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _turn(self) -> tuple[int, str] | None:
        """The current (batch, site), or None once every site's plan is through (or every site is gone)."""
        return (self._t, self.order[self._k]) if self._k < len(self.order) else None

    def _settle(self) -> None:
        """Move past turns that belong to no one (sites gone, or whose plan has fewer batches); wake the waiters."""
        while True:
            if self._k >= len(self.order):
                if not any(s not in self.gone and self.plans.get(s, self._t + 2) > self._t + 1 for s in self.order):
                    break   # no site has a batch t+1: every plan is through
                self._t, self._k = self._t + 1, 0
                continue
            site = self.order[self._k]
            if site not in self.gone and self.plans.get(site, self._t + 1) > self._t:
                break
            self._k += 1
        self.since = self._mono()
        self._cv.notify_all()


@dataclass
class Phase:
    """One epoch's phase: "train" (the sites' sessions) or "evaluate" (the joined model on held-out rows)."""

    kind: str
    round: int
    participants: list[str]
    opened: float                                   # monotonic
    grants: dict[str, TaskGrant] = field(default_factory=dict)
    outcomes: dict[str, str] = field(default_factory=dict)
    sessions: dict[str, Session] = field(default_factory=dict)
    turn: int = 0                                   # sequential: the participant whose turn it is
    turn_opened: float = 0.0
    turns: Turns | None = None                      # splitfed: the server's order over the sites' batches
    rendezvous: split_sync.Rendezvous | None = None   # synchronous: the epoch's turns across the sites
    trained: dict[str, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)   # splitfed: rows, parts
    server_s: float = 0.0                           # the worker's compute time this phase
    hop_s: float = 0.0                              # the hop's own time (call time less compute)
    batches: int = 0                                # training batches through the server (u-shaped: 2 calls each)


class SplitRounds:
    """One split-learning job's epochs (see the module docstring). Built by `take_up`; the compute worker starts
    in `prepare`, outside the engine lock."""

    def __init__(self, ctx: Context, row: JobRow, cfg: RoundConfig):
        self.ctx, self.row, self.cfg = ctx, row, cfg
        self.job_id = row.id
        self.model_round = row.current_round
        self.ended = False
        self.worker: SplitWorker | None = None
        self.site_names: list[str] = []
        self.site_state: dict[str, np.ndarray] = {}
        self.row_shape: tuple[int, ...] = ()
        self.out_shape: tuple[int, ...] = ()                 # u-shaped: one row of the server part's output
        self.site_params: dict[str, tuple[int, ...]] = {}    # the site parts' parameters (synchronous sums them)
        self.classes = 0
        self.phase: Phase | None = None
        self._served: ServedModel | None = None
        self._lock: threading.RLock | None = None    # the engine lock, lent with the first session
        self._failed = ""
        self._starting = threading.Lock()   # prepare's new worker against stop(): one of them closes it
        self._trained: tuple[list[str], int] = ([], 0)   # the last training phase's sites and rows

    @classmethod
    def take_up(cls, ctx: Context, row: JobRow) -> SplitRounds | None:
        store = ctx.store
        cfg = parse_round_config(row.config_yaml, source=f"job {row.id}")
        try:
            if row.status == JobStatus.QUEUED:
                store.set_job(row.id, status=JobStatus.RUNNING, current_round=0,
                              event=("job_started", 0, "", f"{cfg.rounds} epochs of {cfg.split.variant} split "
                                     f"learning, {cfg.split.schedule}"))
                row = store.job(row.id)
            else:
                store.checkpoint_blob(row.id, row.current_round)   # read through: a damaged one fails here
                store.event(row.id, "job_resumed", row.current_round, "", f"resuming after epoch {row.current_round}")
        except (ConfigError, NotFound, IntegrityError) as exc:
            store.set_job(row.id, status=JobStatus.FAILED, message=str(exc), event=("job_failed", 0, "", str(exc)))
            return None
        log.info("split job %s active at epoch %d", row.id, row.current_round)
        return cls(ctx, row, cfg)

    # outside the lock ---------------------------------------------------------------------
    def prepare(self) -> None:
        """Start the compute worker with the server part of the last closed epoch's model (once)."""
        if self.worker is not None or self.ended or self._failed:
            return
        cfg, spec = self.cfg, self.cfg.split
        worker = SplitWorker()
        most = cfg.train.batch_size + (split_sync.MAX_SITES if self.synchronous else 0)   # rows in one call
        try:
            header, _ = worker.call("load", model=cfg.model.name, args=dict(cfg.model.args), seed=cfg.seed,
                                    variant=spec.variant, cuts=list(spec.cuts), lr=cfg.train.optimizer.lr,
                                    momentum=cfg.train.optimizer.momentum,
                                    weight_decay=cfg.train.optimizer.weight_decay, device=spec.device,
                                    max_rows=max(most, MAX_EVAL_ROWS))
            state = self.ctx.store.load_checkpoint(self.job_id, self.model_round)
            worker.call("load_state", [state[n] for n in header["server"]], names=header["server"])
            if self.model_round > 0:   # the server optimizer's momentum, as the epoch left it
                buffers, _ = self.ctx.store.load_strategy_state(self.job_id, self.model_round)
                worker.call("load_optimizer", [buffers[n] for n in sorted(buffers)], names=sorted(buffers))
        except (ConfigError, IntegrityError, NotFound, KeyError) as exc:
            worker.close()
            self._failed = f"the server part cannot be loaded: {exc}"
            return
        self.site_names = header["site"]
        self.site_state = {n: state[n] for n in self.site_names}
        self.row_shape = tuple(header["row_shape"])
        self.out_shape = tuple(header["out_shape"] or ())
        self.site_params = {n: tuple(shape) for n, shape in header["site_params"].items()}
        self.classes = int(header["classes"])
        with self._starting:
            if not self.ended:
                self.worker, worker = worker, None
        if worker is not None:   # stopped while the worker started
            worker.close()

    # the engine's questions ---------------------------------------------------------------
    def tick(self, now: float) -> float:
        if self._failed:
            self._fail_job(self._failed)
            return 0.0
        if self.worker is None:
            return 0.2
        ph = self.phase
        if ph is None:
            return self._maybe_open(now)
        if ph.kind == "train":
            return self._train_tick(ph, now)
        return self._eval_tick(ph, now)

    def busy(self) -> Iterable[str]:
        ph = self.phase
        return [] if ph is None else [s for s in ph.grants if s not in ph.outcomes]

    def grant(self, site: str) -> TaskGrant | None:
        ph = self.phase
        if ph is None or site not in ph.participants or site in ph.outcomes:
            return None
        if ph.kind == "train" and self.cfg.split.schedule == "sequential" and ph.participants[ph.turn] != site:
            return None
        if site not in ph.grants:
            kind = TaskKind.SPLIT_TRAIN if ph.kind == "train" else TaskKind.SPLIT_EVALUATE
            grant = new_grant(kind=kind, job_id=self.job_id, round_=ph.round, model_round=self.model_round,
                              config_yaml=self.row.config_yaml,
                              deadline_unix_s=self.ctx.clock() + self.cfg.sites.deadline_s,
                              seed=site_seed(self.cfg.seed, ph.round, site),
                              local_steps=ph.rendezvous.turns if ph.rendezvous is not None else 0)
            self.ctx.store.add_task(grant.task_id, self.job_id, ph.round, site, kind, grant.nonce)
            ph.grants[site] = grant
        return ph.grants[site]

    def current(self, site: str, task_id: str, round_: int, status: str) -> TaskGrant:
        ph = self.phase
        grant = ph.grants.get(site) if ph is not None and ph.round == round_ else None
        grant = check_current(grant, task_id, self.job_id, round_)
        check_unanswered(task_id, status, site in ph.outcomes)
        return grant

    def served(self, grant: TaskGrant, held: Held | None = None, *, zero_base: bool = False) -> ServedModel:
        """The site's parts as they stand: left by the previous site (sequential), or the epoch's start."""
        if self._served is None:
            self._served = ServedModel.in_memory(*encode(self.site_state))
        return self._served

    def upload(self, site: str, grant: TaskGrant, header: UpdateHeader, cut) -> None:
        raise FailedPrecondition("a split job's sites send activations through the Split RPC, and their parts at "
                                 "its end; SubmitUpdate takes no update for it")

    def accepted(self, site, grant, header, upload) -> str:   # never reached: upload refuses
        raise FailedPrecondition("a split job takes no update")

    def refused(self, site, grant, upload, exc) -> None:
        pass

    def ended_upload(self, site, upload) -> None:
        pass

    def answered(self, site: str, grant: TaskGrant, answer) -> str:
        if not isinstance(answer, TaskResult):
            raise FailedPrecondition("a split job has no secure-aggregation phases")
        reason = bounded(answer.reason)
        if answer.status == TaskStatus.DECLINED:
            self.ctx.store.decline(self.job_id, site, reason or "declined by site policy")
            self._settle(self.phase, site, TaskStatus.DECLINED, reason or "declined by site policy")
            return "decline recorded; this site will not be asked again for this job"
        if answer.status == TaskStatus.FAILED:
            self._settle(self.phase, site, TaskStatus.FAILED, reason or "the site reported a failure")
            return "failure recorded"
        raise FailedPrecondition("a split task is answered by its Split session's end (SplitDone), or reported "
                                 "declined or failed")

    def session(self, site: str, grant: TaskGrant, batches: int, cut: Callable[[BaseException], None],
                lock: threading.RLock) -> Session:
        """A site opens the Split session of its task (called under the engine lock, which sessions take again to
        record their end)."""
        ph = self.phase
        if grant.kind not in (TaskKind.SPLIT_TRAIN, TaskKind.SPLIT_EVALUATE):
            raise FailedPrecondition(f"task {grant.task_id} is a {grant.kind} task; only split tasks open a session")
        if site in ph.sessions:
            raise FailedPrecondition(f"task {grant.task_id} has a Split session open already")
        if not 0 <= batches <= MAX_TURNS:
            raise IntegrityError(f"SplitOpen.batches {batches} is out of range", reason=Reason.LAYOUT)
        if grant.kind == TaskKind.SPLIT_TRAIN and ph.rendezvous is not None:   # synchronous: the epoch's turns
            if batches != ph.rendezvous.turns:
                raise IntegrityError(f"SplitOpen.batches {batches}: this synchronous epoch has "
                                     f"{ph.rendezvous.turns} turns (the task's local_steps)", reason=Reason.LAYOUT)
            self._lock = lock
            ph.sessions[site] = session = split_sync.SyncSession(self, site, grant, batches, cut, ph.rendezvous)
            return session
        if grant.kind == TaskKind.SPLIT_TRAIN:   # the plan its reported rows allow: at most ⌈rows / batch_size⌉
            rows = self.ctx.presence.rows(self.cfg.data.dataset).get(site, 0)
            most = -(-rows // self.cfg.train.batch_size)
            if not 1 <= batches <= most:
                raise IntegrityError(f"SplitOpen.batches {batches}: this site reported {rows} training rows at Join, "
                                     f"which make 1 to {most} batches of train.batch_size "
                                     f"{self.cfg.train.batch_size}", reason=Reason.NUM_SAMPLES)
        self._lock = lock
        session = Session(self, site, grant, batches, cut, ph.turns)
        ph.sessions[site] = session
        if ph.turns is not None:
            ph.turns.open(site, batches)
        return session

    def stop(self, why: str, *, dropped: bool = False) -> None:
        ph, self.ended = self.phase, True
        if ph is not None:
            self._cut_sessions(ph, RoundClosed(why))
            if dropped:
                self.ctx.store.close_round(self.job_id, ph.round, status="failed", message=why, contributors=[],
                                           total_samples=0)
        self.phase = None
        self._close_worker()

    # the schedule ---------------------------------------------------------------------------
    def _present(self) -> list[str]:
        declined = self.ctx.store.declines(self.job_id)
        return sorted((self.ctx.presence.online() | set(self.busy())) - set(declined))

    def _maybe_open(self, now: float) -> float:
        cfg, store = self.cfg, self.ctx.store
        if self.model_round >= cfg.rounds:
            message = f"{cfg.rounds} epochs of split learning done"
            store.set_job(self.job_id, status=JobStatus.COMPLETED, message=message,
                          event=("job_completed", self.model_round, "", message))
            self._end()
            return 0.0
        online = self._present()
        if len(online) < cfg.sites.min:
            self._waiting(f"waiting for sites: {len(online)} of {cfg.sites.min} needed are online")
            return 0.5
        if self.synchronous and (problem := self._synchronous_problem(online)):
            self._fail_job(problem)
            return 0.0
        round_ = self.model_round + 1
        store.open_round(self.job_id, round_, "train")
        store.set_job(self.job_id, message="")
        self.row = store.job(self.job_id)
        self._open_phase("train", round_, online, now)
        log.info("split job %s epoch %d opened (%s) for %s", self.job_id, round_, cfg.split.schedule,
                 ", ".join(online))
        return 0.2

    def _synchronous_problem(self, sites: list[str]) -> str:
        """Why a synchronous epoch cannot run over `sites` ("" if it can)."""
        if len(sites) > split_sync.MAX_SITES:
            return (f"{len(sites)} sites are online, and a synchronous split epoch takes at most "
                    f"{split_sync.MAX_SITES}; use `schedule: splitfed`")
        rows = self.ctx.presence.rows(self.cfg.data.dataset)
        if not any(rows.get(s, 0) for s in sites):
            return (f"the online sites ({', '.join(sites)}) reported no training rows of {self.cfg.data.dataset} at "
                    "Join, so a synchronous epoch has no turns; check each site's dataset mapping (`plexus site "
                    "check`)")
        total = sum(rows.get(s, 0) for s in sites)
        if (turns := -(-total // self.cfg.train.batch_size)) > MAX_TURNS:
            most = max(sites, key=lambda s: rows.get(s, 0))
            return (f"a synchronous epoch over the {total} rows the online sites reported would take {turns} turns of "
                    f"train.batch_size {self.cfg.train.batch_size}, over the {MAX_TURNS} a session may have "
                    f"(site {most} reported {rows.get(most, 0)}); raise train.batch_size, or check that site's "
                    "dataset")
        return ""

    def _open_phase(self, kind: str, round_: int, sites: list[str], now: float) -> None:
        ph = Phase(kind=kind, round=round_, participants=sites, opened=now, turn_opened=now)
        if kind == "train" and self.synchronous:
            reported = self.ctx.presence.rows(self.cfg.data.dataset)
            rows = {s: reported.get(s, 0) for s in sites}
            turns = -(-sum(rows.values()) // self.cfg.train.batch_size)
            ph.rendezvous = split_sync.Rendezvous(rows, turns, split_sync.STAGES[self.cfg.split.variant],
                                                  functools.partial(split_sync.run_stage, self))
        elif kind == "train":
            ph.turns = Turns(sites if self.cfg.split.schedule == "splitfed" else sites[:1], self.ctx.monotonic)
        self.phase, self._served = ph, None
        self.ctx.notify()
        self.ctx.presence.wake(sites)

    def _train_tick(self, ph: Phase, now: float) -> float:
        deadline = self.cfg.sites.deadline_s
        sequential = self.cfg.split.schedule == "sequential"
        waiting = [ph.participants[ph.turn]] if sequential else ph.participants
        for site in waiting:   # a site that never opened its session within sites.deadline_s is late
            started = ph.turn_opened if sequential else ph.opened
            if site not in ph.outcomes and site not in ph.sessions and now - started > deadline:
                self._settle(ph, site, TaskStatus.LATE, f"no Split session within sites.deadline_s ({deadline:g} s)")
        if sequential:
            while ph.turn < len(ph.participants) and ph.participants[ph.turn] in ph.outcomes:
                ph.turn += 1
                ph.turn_opened, self._served = now, None
                if ph.turn < len(ph.participants):
                    site = ph.participants[ph.turn]
                    ph.turns = Turns([site], self.ctx.monotonic)
                    self.ctx.presence.wake([site])
            if ph.turn < len(ph.participants):
                return 0.2
        elif not all(s in ph.outcomes for s in ph.participants):
            return 0.2
        self._end_training(ph, now)
        return 0.0

    def _end_training(self, ph: Phase, now: float) -> None:
        done = sorted(s for s, o in ph.outcomes.items() if o == TaskStatus.SUBMITTED)
        if not done:
            problems = ", ".join(f"{s}: {o}" for s, o in sorted(ph.outcomes.items())) or "none"
            message = (f"epoch {ph.round} failed: no site completed its Split session ({problems}); the model is "
                       f"unchanged at epoch {self.model_round}; once the sites are back, `plexus job resume` runs it "
                       "again from there")
            self.ctx.store.close_round(self.job_id, ph.round, status="failed", contributors=[], total_samples=0,
                                       message=message, job_update={"status": JobStatus.FAILED, "message": message},
                                       event=("job_failed", message))
            self._end()
            return
        if self.cfg.split.schedule != "sequential":   # synchronous: equal parts, whose average is themselves
            self.site_state = average_parts({s: ph.trained[s] for s in done}, self.site_names)
        metrics = {(ph.round, "", "split", "server_compute_s"): ph.server_s,
                   (ph.round, "", "split", "hop_s_per_batch"): ph.hop_s / max(1, ph.batches),
                   (ph.round, "", "split", "server_batches"): float(ph.batches)}
        self.ctx.store.record_metrics(self.job_id, metrics)
        self._trained = (done, sum(ph.trained[s][0] for s in done))
        self._open_phase("evaluate", ph.round, self._present(), now)

    def _eval_tick(self, ph: Phase, now: float) -> float:
        if not all(s in ph.outcomes for s in ph.participants) and now - ph.opened <= self.cfg.sites.deadline_s:
            return 0.2
        for site in ph.participants:
            if site not in ph.outcomes:
                self._settle(ph, site, TaskStatus.LATE, f"no evaluation within sites.deadline_s "
                                                        f"({self.cfg.sites.deadline_s:g} s)")
        self._close_epoch(ph)
        return 0.0

    def _close_epoch(self, ph: Phase) -> None:
        store = self.ctx.store
        header, tensors = self.worker.call("state")
        state = {**self.site_state, **dict(zip(header["names"], tensors))}
        store.save_checkpoint(self.job_id, ph.round, state)
        # The server optimizer's momentum goes where a strategy's state goes: a resumed epoch steps as this one did.
        header, buffers = self.worker.call("optimizer")
        store.save_strategy_state(self.job_id, ph.round, dict(zip(header["names"], buffers)),
                                  {"split": "the server part's SGD momentum buffers"})
        done, rows = self._trained
        message = f"epoch {ph.round}: {len(done)} site(s) trained over {rows} rows"
        store.close_round(self.job_id, ph.round, status="closed", contributors=done, total_samples=rows,
                          message=message, job_update={"current_round": ph.round})
        store.prune_checkpoints(self.job_id, ph.round)
        self.ctx.saved(ph.round)
        self.row = store.job(self.job_id)
        self.model_round, self.phase = ph.round, None
        log.info("split job %s %s", self.job_id, message)
        self.ctx.notify()

    # sessions' ends (under the engine lock) ----------------------------------------------------
    def completed(self, session: Session, num_samples: int, metrics: dict[str, float],
                 weights: dict[str, np.ndarray] | None) -> str:
        ph, site = self.phase, session.site
        self._check_live(session)
        # A session can outlast the online window (an epoch of a minute or more): its end is the site's presence,
        # so the evaluation that opens next asks it too.
        self.ctx.presence.seen(site)
        if session.grant.kind == TaskKind.SPLIT_TRAIN:
            check_rows(num_samples, self.ctx.presence.rows(self.cfg.data.dataset).get(site, 0))
            if self.cfg.split.schedule == "sequential":
                self.site_state, self._served = weights, None     # handed to the next site
            ph.trained[site] = (num_samples, weights)
            keyed = {(ph.round, "train", k): v for k, v in metrics.items()}
            keyed[(ph.round, "train", "num_samples")] = float(num_samples)
            status = TaskStatus.SUBMITTED
        else:   # weighed by the rows its batches held at the server, whatever it says, capped as training weights are
            rows = self.ctx.presence.rows(self.cfg.data.dataset)
            caps = weight_caps({s: rows.get(s, 0) for s in ph.participants}, self.cfg.sites.max_weight_share)
            keyed = {(ph.round, "eval", k): v for k, v in metrics.items()}
            keyed[(ph.round, "eval", "num_samples")] = float(min(num_samples, caps.get(site, 1)))
            status = TaskStatus.EVALUATED
        keyed.update({(ph.round, "wire", k): v for k, v in session.wire_metrics().items()})
        self._settle(ph, site, status, "", keyed)
        return f"epoch {ph.round}: {'parts' if weights is not None else 'evaluation'} of {site} recorded"

    def broke(self, session: Session, exc: BaseException) -> None:
        """A session ended without its SplitDone: the site is recorded failed (or late) and the epoch goes on."""
        ph = self.phase
        if ph is None or ph.sessions.get(session.site) is not session or session.site in ph.outcomes:
            return
        reason = bounded(f"{type(exc).__name__}: {exc}")
        status = TaskStatus.REJECTED if isinstance(exc, IntegrityError) else TaskStatus.FAILED
        self._settle(ph, session.site, status, f"the Split session ended after {session.seq} {session.unit}: {reason}",
                     code=getattr(exc, "reason", None))

    @property
    def synchronous(self) -> bool:
        return self.cfg.split.schedule == "synchronous"

    def server_call(self, op: str, tensors: list[np.ndarray], consume=None):
        """A training call to the compute worker, its compute and the hop's own time counted for the epoch (the
        calls take turns: one at a time)."""
        worker = self.worker
        if worker is None:
            raise RoundClosed(f"job {self.job_id} is no longer active")
        started = time.perf_counter()
        result = worker.call(op, tensors, consume=consume)
        ph, compute = self.phase, worker.compute_s   # the calls take turns: no other call came in between
        if ph is not None:
            ph.server_s += compute
            ph.hop_s += time.perf_counter() - started - compute
            ph.batches += op in ("vanilla", "backward")
        return result

    def _check_live(self, session: Session) -> None:
        ph = self.phase
        if self.ended or ph is None or ph.sessions.get(session.site) is not session or session.site in ph.outcomes:
            raise RoundClosed(f"task {session.grant.task_id} is no longer current")

    def _settle(self, ph: Phase, site: str, status: TaskStatus, reason: str, metrics: dict | None = None, *,
                code: Reason | None = None) -> None:
        ph.outcomes[site] = status
        grant = ph.grants.get(site)
        if grant is not None:
            self.ctx.store.finish_task(grant.task_id, status, reason, job_id=self.job_id, round_=ph.round, site=site,
                                       metrics=metrics, code=code)
        if reason:
            log.info("split job %s epoch %d site %s: %s (%s)", self.job_id, ph.round, site, status, reason)
        session = ph.sessions.get(site)
        if session is not None and status != TaskStatus.SUBMITTED and status != TaskStatus.EVALUATED:
            session.cut(RoundClosed(f"site {site} is out of epoch {ph.round}: {reason}"))
        if ph.turns is not None:
            ph.turns.leave(site)
        if ph.rendezvous is not None:
            ph.rendezvous.leave(site)
        self.ctx.notify()

    def _cut_sessions(self, ph: Phase, exc: BaseException) -> None:
        for session in ph.sessions.values():
            session.cut(exc)
        if ph.turns is not None:
            ph.turns.wake()
        if ph.rendezvous is not None:
            ph.rendezvous.wake()

    def _waiting(self, message: str) -> None:
        if self.row.message != message:
            self.ctx.store.set_job(self.job_id, message=message)
            self.row = self.ctx.store.job(self.job_id)

    def _fail_job(self, message: str) -> None:
        self.ctx.store.set_job(self.job_id, status=JobStatus.FAILED, message=message,
                               event=("job_failed", self.model_round, "", message))
        self._end()

    def _end(self) -> None:
        self.stop(f"job {self.job_id} has ended")

    def _close_worker(self) -> None:
        with self._starting:
            worker, self.worker = self.worker, None
        if worker is not None:   # called under the engine lock: the worker may be in the middle of a long batch
            worker.close(wait=False)


def average_parts(trained: dict[str, tuple[int, dict[str, np.ndarray]]], names: list[str]) -> dict[str, np.ndarray]:
    """SplitFed's site-side model: the sites' parts averaged, weighted by the rows each trained on (float64, cast
    back to float32), summed in site-name order."""
    total = float(sum(n for n, _ in trained.values()))
    out = {}
    for name in names:
        acc = np.zeros(trained[next(iter(trained))][1][name].shape, np.float64)
        for site in sorted(trained):
            rows, parts = trained[site]
            acc += rows / total * parts[name].astype(np.float64)
        out[name] = acc.astype(np.float32)
    return out


class Session:
    """One site's Split session: each message validated, the server part's turn taken, the worker called, the
    reply built. Runs on the RPC's thread without the engine lock; its end is recorded under it."""

    def __init__(self, driver: SplitRounds, site: str, grant: TaskGrant, batches: int,
                 cut: Callable[[BaseException], None], turns: Turns | None):
        """`turns`: the server's order over the training phase's batches (None for an evaluation session)."""
        self.driver, self.site, self.grant, self.batches, self.turns = driver, site, grant, batches, turns
        self._cut_stream = cut
        self._cut: BaseException | None = None
        self.seq = 0                      # the next batch expected
        self.unit = "batch(es)"           # what seq counts, for the record of a session that broke
        self.pending: int | None = None   # u-shaped training: the batch whose gradient the server waits for
        self.bytes_up = 0
        self.bytes_down = 0
        self.rows = 0
        self.finished = False
        spec = driver.cfg.split
        self.vanilla = spec.variant == "vanilla"
        self.training = grant.kind == TaskKind.SPLIT_TRAIN
        self.max_rows = driver.cfg.train.batch_size if self.training else MAX_EVAL_ROWS

    @property
    def timeout_s(self) -> float:
        return self.driver.cfg.split.batch_timeout_s

    def cut(self, exc: BaseException) -> None:
        self._cut = exc
        self._cut_stream(exc)

    def wire_metrics(self) -> dict[str, float]:
        """The session's message bytes each way, as the coordinator counted them (gRPC payloads, before TLS)."""
        what = "train" if self.training else "eval"
        return {f"{what}_bytes_up": float(self.bytes_up), f"{what}_bytes_down": float(self.bytes_down)}

    def take(self, message: fpb.SplitMessage) -> fpb.SplitReply:
        """One message from the site: its reply (IntegrityError for a malformed one, which ends the session)."""
        self.bytes_up += message.ByteSize()
        body = message.WhichOneof("body")
        if body == "batch":
            reply = self._batch(message.batch)
        elif body == "grad":
            reply = self._grad(message.grad)
        elif body == "done":
            reply = self._done(message.done)
        else:
            raise IntegrityError(f"a Split session takes batches, gradients and its end; got {body or 'nothing'}",
                                 reason=Reason.LAYOUT)
        self.bytes_down += reply.ByteSize()
        return reply

    def _batch(self, batch: fpb.SplitBatch) -> fpb.SplitReply:
        driver = self.driver
        if self.pending is not None:
            raise IntegrityError(f"batch {batch.seq} came before the gradient of batch {self.pending}",
                                 reason=Reason.LAYOUT)
        if batch.seq != self.seq or self.seq >= self.batches:
            raise IntegrityError(f"batch {batch.seq} is out of order: expected batch {self.seq} of the "
                                 f"{self.batches} the session announced", reason=Reason.LAYOUT)
        # Its values (finite, labels in range) are checked by the compute worker, once: the structure here.
        activations = array_of(batch.activations, dtype="F32", what=f"batch {batch.seq}'s activations",
                               rows=(1, self.max_rows), finite=False)
        if tuple(activations.shape[1:]) != driver.row_shape:
            raise IntegrityError(f"batch {batch.seq}'s activations have shape {list(activations.shape)}; the cut "
                                 f"takes (n, {', '.join(map(str, driver.row_shape))})", reason=Reason.LAYOUT)
        n = activations.shape[0]
        if self.vanilla:
            if not batch.HasField("labels"):
                raise IntegrityError(f"batch {batch.seq}: a vanilla split sends the labels with the activations",
                                     reason=Reason.LAYOUT)
            labels = array_of(batch.labels, dtype="I64", what=f"batch {batch.seq}'s labels", shape=(n,))
        elif batch.HasField("labels"):
            raise IntegrityError(f"batch {batch.seq}: a u-shaped split keeps the labels at the site; this session "
                                 "sent some, and they are refused", reason=Reason.LAYOUT)
        self.seq, self.rows = self.seq + 1, self.rows + n
        if not self.training:
            if self.vanilla:
                header, _ = self._call("evaluate", [activations, labels])
                return fpb.SplitReply(seq=batch.seq, loss=header["loss"], correct=header["correct"])
            _, (out,) = self._call("infer", [activations])
            return fpb.SplitReply(seq=batch.seq, tensor=out)
        self.turns.wait(self.site, batch.seq, lambda: self._cut)
        if self.vanilla:
            try:
                header, (grad,) = self._call("vanilla", [activations, labels])
            finally:
                self.turns.done(self.site, batch.seq)
            return fpb.SplitReply(seq=batch.seq, tensor=grad, loss=header["loss"])
        try:
            _, (out,) = self._call("forward", [activations])
        except BaseException:
            self.turns.done(self.site, batch.seq)
            raise
        self.pending = batch.seq       # the server's turn is held until this batch's gradient comes
        return fpb.SplitReply(seq=batch.seq, tensor=out)

    def _grad(self, message: fpb.SplitGrad) -> fpb.SplitReply:
        if self.pending is None or message.seq != self.pending:
            raise IntegrityError(f"a gradient for batch {message.seq}, and the server waits for "
                                 f"{'none' if self.pending is None else f'batch {self.pending}'}s",
                                 reason=Reason.LAYOUT)
        seq = self.pending
        try:
            grad = array_of(message.grad, dtype="F32", what=f"batch {seq}'s gradient", finite=False)
            _, (back,) = self._call("backward", [grad])
        finally:
            self.pending = None
            self.turns.done(self.site, seq)
        return fpb.SplitReply(seq=seq, tensor=back)

    def _done(self, done: fpb.SplitDone) -> fpb.SplitReply:
        driver = self.driver
        if self.pending is not None:
            raise IntegrityError(f"the session ended while the server waits for batch {self.pending}'s gradient",
                                 reason=Reason.LAYOUT)
        if self.seq != self.batches:
            raise IntegrityError(f"the session announced {self.batches} batches and sent {self.seq}",
                                 reason=Reason.LAYOUT)
        if done.num_samples != self.rows:
            raise IntegrityError(f"num_samples {done.num_samples}, and the session's batches held {self.rows} rows",
                                 reason=Reason.NUM_SAMPLES)
        metrics = checked_metrics(dict(done.metrics))
        weights = weights_of(done.weights, {n: a.shape for n, a in driver.site_state.items()},
                             what="the site's parts") if self.training else None
        if not self.training and done.weights:
            raise IntegrityError("an evaluation session sends no weights", reason=Reason.LAYOUT)
        with driver._lock:
            message = driver.completed(self, self.rows, metrics, weights)
        self.finished = True
        return fpb.SplitReply(seq=self.seq, message=message)

    def ended(self, exc: BaseException | None) -> None:
        """The stream is over: a session that did not finish is recorded as broken."""
        if self.finished:
            return
        driver = self.driver
        if self.pending is not None and driver.worker is not None:
            try:   # forget the forward whose gradient never came, then give the turn on
                driver.worker.call("drop")
            except (ConfigError, IntegrityError):
                pass
            finally:
                self.turns.done(self.site, self.pending)
            self.pending = None
        with driver._lock:
            driver.broke(self, exc or RoundClosed("the site closed its Split session before its end"))

    def _call(self, op: str, tensors: list[np.ndarray]) -> tuple[dict, list[fpb.TensorData]]:
        """The worker's reply to `op`: its header, and its tensors as wire messages, made straight from the shared
        segment (one copy)."""
        worker = self.driver.worker
        if worker is None or self._cut is not None:
            raise self._cut or RoundClosed(f"job {self.driver.job_id} is no longer active")
        if self.training:   # counted for the epoch
            return self.driver.server_call(op, tensors, _as_messages)
        return worker.call(op, tensors, consume=_as_messages)


def _as_messages(header: dict, views: list[np.ndarray]) -> tuple[dict, list[fpb.TensorData]]:
    """A worker reply's tensors as wire messages, made straight from the shared segment (one copy)."""
    return header, [tensor_message(v) for v in views]


from coordinator.drivers import split_sync  # noqa: E402  (after Session, which its SyncSession extends)
