"""SyncRounds: the synchronous round cycle. Rounds open once enough sites are online, collect updates,
and close on quorum or deadline; secure aggregation runs a round as phases (SecureRound).

Durable effects go through the Store in one transaction each, checkpoint first, so a SIGKILL at any
point resumes from the last closed round.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator.aggregate import CodedFold, WeightedSum, exact_layout
from coordinator.downlink import Downlink, Step
from coordinator.drivers import Context
from coordinator.drivers.rounds import Action, RoundView, can_open, decide, retry_allowed, training_over
from coordinator.intake import Upload
from coordinator.secure_round import SecureRound
from coordinator.served import Held, ServedModel
from coordinator.store import JobRow, Store
from coordinator.strategies import MeanRule, Update, UpdatesRule, keeps_mean, make_strategy
from coordinator.tasks import (
    SecaggAnswer,
    TaskGrant,
    TaskResult,
    UpdateHeader,
    check_current,
    check_unanswered,
    new_grant,
    site_seed,
)
from plexus.accounting import client_epsilon, load_client_accountant, round_sampling_rate
from plexus.compression import job_uplink
from plexus.config import MIN_GRID_LEVELS, SECURE_FIELD_BITS, RoundConfig, max_secure_sites, parse_round_config
from plexus.dp import NOT_PRIVATE, Distance, add_noise, central_std, check_clipped, noise_key
from plexus.errors import (
    ConfigError,
    FailedPrecondition,
    IntegrityError,
    NotFound,
    PlexusError,
    Reason,
    RoundClosed,
    TimedOut,
)
from plexus.secagg import MAX_WEIGHT
from plexus.text import bounded
from plexus.vocab import JobStatus, SecaggPhase, TaskKind, TaskStatus
from plexus.wire import DTYPES, Layout, decode, encode

log = logging.getLogger("plexus.coordinator")

MAX_METRICS = 64
RETRY_WAIT_S = 1.0   # before a round that missed its quorum opens again; doubles with each retry of it
# A FedAvg mean goes into its checkpoint block by block through this many buffers, so that its SHA-256 is computed
# on a helper thread up to two blocks behind the mean and the file's writes (plexus.files.fed_beside); figures in
# docs/performance.md ("A checkpoint's SHA-256 is computed beside its writes").
MEAN_BLOCKS_KEPT, MEAN_BLOCK_ELEMENTS = 4, 1 << 18


# Strategy rules: the driver dispatches on the rule's type (MeanRule over the weighted mean, UpdatesRule over
# the individual updates) and asks the schedule who trains; every read of a strategy the driver makes is here.
def holds_updates(strategy) -> bool:
    """The rule needs every update at once (robust rules, ensembles): updates are kept, not summed."""
    return isinstance(strategy.rule, UpdatesRule)


def reads_current(strategy) -> bool:
    """The rule's step reads the current model (else the old model is released before the new one is built)."""
    return isinstance(strategy.rule, UpdatesRule) or strategy.rule.reads_current


def mean_is_model(strategy) -> bool:
    """The weighted mean is the new model as it is (plain FedAvg)."""
    return keeps_mean(strategy.rule)


def uniform_weights(strategy, dp) -> bool:
    """Every update weighs the same: DP-FedAvg, and rules such as SCAFFOLD."""
    return dp is not None or (isinstance(strategy.rule, MeanRule) and strategy.rule.weighting == "uniform")


def own_dp(strategy) -> bool:
    """The rule noises what it reads itself (lbfgs under privacy.dp): the driver's DP-FedAvg stays off, i.e. no
    clip check of each update's distance from the model and no central noise on the mean."""
    return strategy.rule.own_dp


def dp_releases(strategy) -> int:
    """Noisy values the rule releases once besides its rounds (lbfgs: the pooled row count), each of which the
    accountant counts as one more round at sampling rate 1 and the job's noise multiplier."""
    return strategy.rule.dp_releases


def min_contributors(strategy) -> int:
    return strategy.min_contributors


def aggregate_mean(strategy, round_: int, current, mean, contributors: list[str]):
    return strategy.rule.step(round_, current, mean, contributors, population=strategy.population)


def aggregate_held(strategy, round_: int, current, updates: list[Update]):
    return strategy.rule.combine(round_, current, updates)


def served_extras(strategy, state) -> dict:
    return strategy.rule.served(state) if isinstance(strategy.rule, MeanRule) else {}


def update_extras(strategy, layout: Layout) -> list:
    return list(strategy.rule.update_extras(layout)) if isinstance(strategy.rule, MeanRule) else []


def choose(strategy, round_: int, online: list[str], known: list[str]) -> list[str]:
    return strategy.schedule.configure(round_, online, known)


def opened(strategy, round_: int, participants: list[str], known: list[str]) -> list[str]:
    return list(strategy.opened(round_, participants, known))


def strategy_done(strategy, model_round: int) -> bool:
    return strategy.schedule.done(model_round)


def local_steps(strategy, site: str, sizes: dict[str, int]) -> int:
    return strategy.schedule.local_steps(site, sizes)


def spent(strategy) -> dict[str, float]:
    """What the rule's latest step spent (a statistics job's ε per query and in total), to record with the round."""
    return strategy.rule.ledger()


def evaluates(cfg: RoundConfig) -> bool:
    """Whether the job's final model is evaluated by the sites: not a statistics job's sums, which are no model."""
    return cfg.kind != "statistics"


def downlink_of(cfg: RoundConfig) -> Downlink | None:
    """The job's compressed downlink (compression.downlink fp16, delta8 or delta4); None: the model travels as it is."""
    spec = cfg.compression.downlink if cfg.compression is not None else None
    return Downlink(spec) if spec is not None and spec.codec != "none" else None


def base_plus_mean(base: dict[str, np.ndarray], total: WeightedSum) -> dict[str, np.ndarray]:
    """base + Σ w·Δ / Σ w per tensor, in float64, cast back to each tensor's dtype (integers rounded)."""
    out = {}
    for name, delta_sum in total.sums().items():
        value = base[name].astype(np.float64) + delta_sum / total.total_weight
        dtype = base[name].dtype
        out[name] = (np.rint(value) if dtype.kind in "iu" else value).astype(dtype)
    return out


def base_plus_unmasked(base: dict[str, np.ndarray], delta: dict[str, np.ndarray],
                       extras: Layout) -> dict[str, np.ndarray]:
    """A secure round's mean from its unmasked Δ (plexus.secagg.plan): base + Δ per model tensor, in its dtype (sites
    masked Δ from the model they decoded), and each update extra's mean value, in the dtype the rule declared
    (its base is zero)."""
    mean = {name: (current.astype(np.float64) + delta[name]).astype(current.dtype) for name, current in base.items()}
    for t in extras.tensors:
        mean[t.name] = delta[t.name].astype(DTYPES[t.dtype])
    return mean


def samples_at_random(cfg: RoundConfig) -> bool:
    """Whether the round's trainers are a random draw (sites.fraction / sites.count): DP's q < 1 then."""
    return cfg.sites.fraction is not None or cfg.sites.count is not None


def save_strategy(store: Store, job_id: str, round_: int, strategy) -> None:
    store.save_strategy_state(job_id, round_, strategy.state_arrays(), strategy.state_meta())


def strategy_at(store: Store, cfg: RoundConfig, job_id: str, round_: int):
    """The job's strategy as it was when round `round_` closed (its checkpointed state; fresh at 0)."""
    strategy = make_strategy(cfg)
    if round_ > 0:
        strategy.load_state(*store.load_strategy_state(job_id, round_))
    return strategy
# End of strategy rules.


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


def check_rows(num_samples: int, rows: int) -> None:
    """Refuse a num_samples beyond `rows`, the training rows its site reported at Join (none: refused)."""
    if rows == 0:
        raise IntegrityError(f"num_samples {num_samples}: this site reported no training rows for the job's "
                             "dataset when it joined, and an update weighs at most its site's reported rows; "
                             "check that the dataset loads at the site, then restart its agent",
                             reason=Reason.NUM_SAMPLES)
    if num_samples > rows:
        raise IntegrityError(f"num_samples {num_samples} exceeds the {rows} training rows this site reported "
                             "for the job's dataset when it joined; an update weighs at most its site's rows",
                             reason=Reason.NUM_SAMPLES)


@dataclass
class RoundState:
    """One open round: who takes part, their grants and outcomes, what is arriving and what is in."""

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
    held: list[tuple[str, int, Path]] = field(default_factory=list)   # (site, samples, spool) for held updates
    folding: dict[str, Upload] = field(default_factory=dict)   # uploads entering a sum, not accepted yet
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
        check_rows(num_samples, self.rows.get(site, 0))

    def weight(self, site: str, num_samples: int) -> int:
        """What a site's update weighs: its num_samples (refused beyond its rows), capped at its largest share."""
        self.check_rows(site, num_samples)
        return min(num_samples, self.caps.get(site, 1))

    def grant_of(self, site: str) -> TaskGrant | None:
        return self.grants.get(site) or self.eval_grants.get(site)

    def outcomes_for(self, site: str) -> dict[str, str]:
        """Where a site's answer is recorded: evaluate-only sites apart from the round's trainers."""
        return self.eval_outcomes if site in self.eval_grants else self.outcomes

    def view(self, needed: int) -> RoundView:
        """What the decision core reads of this round."""
        return RoundView(kind=self.kind, participants=self.participants, outcomes=self.outcomes,
                         evaluators=self.evaluators, eval_outcomes=self.eval_outcomes, receiving=bool(self.receiving),
                         deadline=self.deadline, secure=self.secure is not None, contributors=len(self.contributors),
                         needed=needed)

    def withdraw(self, site: str) -> None:
        """Take a site's upload back out of the sum if it is (partly) in and was not accepted. Call with the
        engine lock held."""
        upload = self.folding.pop(site, None)
        if upload is not None:
            upload.withdraw()

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
    """The job SyncRounds runs: its config, strategy, the global model and what sites fetch."""

    row: JobRow
    cfg: RoundConfig
    strategy: object
    layout: Layout
    state: dict[str, np.ndarray]
    blob: bytes | None
    model_round: int
    served: ServedModel | None = None        # what sites fetch: the model plus the strategy's served tensors
    update_layout: Layout | None = None      # model + the tensors every update adds (SCAFFOLD's Δc)
    activated: float = 0.0                   # monotonic time the engine took the job up
    opened_any: bool = False                 # a round has opened since then
    budget_stop: str = ""                    # set when the next round would exceed dp.target_epsilon
    total: WeightedSum | None = None         # the running sum, kept from round to round (round_sum)
    codec: object = None                     # the uplink codec (plexus.compression) when updates travel compressed
    retried: dict[int, int] = field(default_factory=dict)   # round -> times it was opened again (sites.retries)
    retry_at: float = 0.0                    # monotonic: a round that missed its quorum opens again no sooner
    epsilons: dict[int, float] = field(default_factory=dict)   # DP: ε after round n, computed as it opened
    rates: dict[int, float] | None = None    # DP: round n's sampling rate q (read from the ledger once)
    downlink: Downlink | None = None         # compression.downlink fp16/delta8/4: what sites fetch instead of `served`

    @property
    def in_memory(self) -> bool:
        """Whether the engine itself reads the global model (else sites stream it from the checkpoint file)."""
        s = self.strategy
        return bool(reads_current(s) or holds_updates(s) or self.cfg.privacy.dp is not None
                    or self.cfg.privacy.secure_aggregation or self.update_layout != self.layout
                    or self.codec is not None or self.downlink is not None)

    @property
    def base(self) -> dict[str, np.ndarray] | None:
        """The model the sites start from this round, as they decode it (a compressed update is a Δ from it):
        `state` itself unless the downlink is compressed (then fp16(model), or a delta codec's served chain)."""
        if self.downlink is None:
            return self.state
        return {t.name: self.downlink.base[t.name] for t in self.layout.tensors}

    def fetched(self, held: Held | None, *, zero_base: bool = False) -> ServedModel:
        """What a site fetches: `served`, or under a compressed downlink the encoded model (a delta codec's delta
        if the site holds the model it applies to, or from zeros at the chain's start if it decodes that)."""
        return self.served if self.downlink is None else self.downlink.served(held, zero_base=zero_base)

    def round_sum(self, sites: int) -> WeightedSum:
        """An empty running sum for the next round's `sites` sites: the job's one sum, zeroed in place
        (faulting in a fresh model-sized array every round costs more than folding an update into it)."""
        if self.total is None or self.total.layout != self.update_layout:
            self.total = WeightedSum(self.update_layout, sites=sites)
        else:
            self.total.reset(sites=sites)
        return self.total

    def downlink_step(self, round_: int, state: dict[str, np.ndarray]) -> Step | None:
        """What a compressed downlink will serve for the model `state` (set_model takes it), computed before the
        round's model is stored: IntegrityError if the model cannot travel so (fp16: beyond float16's range)."""
        if self.downlink is None:
            return None
        return self.downlink.prepare(round_, {**state, **served_extras(self.strategy, state)})

    def set_model(self, layout: Layout, blob, round_: int, step: Step | None = None) -> None:
        """The new global model (after round `round_`); what sites fetch is it plus whatever the strategy serves
        with it, encoded as compression.downlink says (`step`: prepared by downlink_step)."""
        self.layout, self.blob = layout, blob
        self.state = decode(layout, blob)
        extra = served_extras(self.strategy, self.state)
        self.served = ServedModel.in_memory(*encode({**self.state, **extra})) if extra else \
            ServedModel.in_memory(layout, blob)
        self.update_layout = Layout.build(
            [(t.name, t.dtype, t.shape) for t in layout.tensors] + update_extras(self.strategy, layout))
        if self.downlink is not None:
            self.downlink.take(step or self.downlink.prepare(round_, {**self.state, **extra}))

    def release_model(self) -> None:
        """Drop the in-memory model before the next one is built (rules that do not read it); a delta codec's chain
        stays, since the next model's delta is taken from it."""
        self.state = self.blob = self.served = None
        if self.downlink is not None:
            self.downlink.release()

    def serve_from_checkpoint(self, store: Store, round_: int) -> None:
        """Drop the in-memory model; FetchModel then streams the checkpoint file (shared page cache)."""
        # Not read through again for its checksum: it was just written, or just verified as it was read.
        layout, path, start = store.checkpoint_source(self.row.id, round_, verify=False)
        self.layout, self.state, self.blob = layout, None, None
        self.served = ServedModel.from_file(layout, path, start)


class SyncRounds:
    """The synchronous round cycle of one job (see the module docstring). Built by `take_up`."""

    def __init__(self, ctx: Context, job: ActiveJob):
        self.ctx, self.job = ctx, job
        self.job_id = job.row.id
        self.round: RoundState | None = None
        self.ended = False

    @classmethod
    def take_up(cls, ctx: Context, row: JobRow) -> SyncRounds | None:
        """Start a queued job, or take up a running one again from its last closed round; None (and the job
        failed in the store) if it cannot be, e.g. its checkpoint is damaged."""
        store = ctx.store
        cfg = parse_round_config(row.config_yaml, source=f"job {row.id}")
        try:
            strategy = strategy_at(store, cfg, row.id, row.current_round)
            if row.status == JobStatus.QUEUED:
                layout, blob = store.checkpoint_blob(row.id, 0)   # built and saved at submit
                store.set_job(row.id, status=JobStatus.RUNNING, current_round=0,
                              event=("job_started", 0, "", f"{cfg.rounds} rounds of {cfg.strategy.name}"))
                if _noise_is_reproducible(cfg):
                    store.event(row.id, "dp_not_private", 0, "", NOT_PRIVATE)
                row = store.job(row.id)
            else:
                layout, blob = store.checkpoint_blob(row.id, row.current_round)
                # A round cut short released nothing (its model is served only once closed), so the
                # re-run round's fresh central noise is that round's only draw: ε is unchanged.
                fresh = (", re-running the next round with fresh central DP noise"
                         if cfg.privacy.dp is not None and cfg.privacy.dp.mode == "central" else "")
                store.event(row.id, "job_resumed", row.current_round, "",
                            f"resuming after round {row.current_round}{fresh}")
        except (ConfigError, NotFound, IntegrityError) as exc:   # e.g. a damaged checkpoint: fail, never retry
            store.set_job(row.id, status=JobStatus.FAILED, message=str(exc), event=("job_failed", 0, "", str(exc)))
            return None
        # The global model exists once: the wire blob; the state dict is views over it. A job
        # whose engine never reads the model (plain FedAvg) serves it from the checkpoint file.
        job = ActiveJob(row, cfg, strategy, layout, {}, blob, row.current_round, activated=ctx.monotonic(),
                        codec=job_uplink(cfg), downlink=downlink_of(cfg))
        try:
            job.set_model(layout, blob, row.current_round)
        except IntegrityError as exc:   # a model compression.downlink cannot carry (fp16: beyond its range)
            store.set_job(row.id, status=JobStatus.FAILED, message=str(exc), event=("job_failed", 0, "", str(exc)))
            return None
        if not job.in_memory:
            job.serve_from_checkpoint(store, row.current_round)
        log.info("job %s active at round %d", row.id, row.current_round)
        if _noise_is_reproducible(cfg):
            log.warning("job %s: %s", row.id, NOT_PRIVATE)
        return cls(ctx, job)

    # outside the lock ---------------------------------------------------------------------
    def prepare(self) -> None:
        """Load the ε accountant outside the engine lock while a DP job is active: the import (dp-accounting
        and scipy) is paid once per process, so the first ε, computed when a round opens, is milliseconds."""
        if self.job.cfg.privacy.dp is not None:
            load_client_accountant()

    def _epsilon(self, q: float) -> float:
        """ε after the job's next round if it runs at sampling rate q, kept (with q) for its ledger: every
        closed round's q (from the privacy ledger; 1 where none is recorded) composed with this one."""
        job = self.job
        dp, n = job.cfg.privacy.dp, job.model_round + 1
        if job.rates is None:
            job.rates = {m.round: m.value for m in self.ctx.store.metrics(job.row.id)
                         if m.site == "" and m.kind == "privacy" and m.name == "sampling_rate"}
        if job.rates.get(n) != q or n not in job.epsilons:   # a round waiting for its quorum asks again
            rates = [1.0] * dp_releases(job.strategy) + [job.rates.get(r, 1.0) for r in range(1, n)]
            job.rates[n], job.epsilons[n] = q, client_epsilon(dp.noise_multiplier, [*rates, q], dp.delta)
        return job.epsilons[n]

    # the engine's questions ---------------------------------------------------------------
    def tick(self, now: float) -> float:
        if self.round is None:
            return self._maybe_open_round(now)
        return self._maybe_close_round(now)

    def busy(self) -> Iterable[str]:
        rs = self.round
        if rs is None:
            return ()
        return [s for s in rs.grants if s not in rs.outcomes] + \
            [s for s in rs.eval_grants if s not in rs.eval_outcomes]

    def grant(self, site: str) -> TaskGrant | None:
        job, rs = self.job, self.round
        if rs is None:
            return None
        if site in rs.participants and site not in rs.outcomes:
            grants, kind = rs.grants, rs.secure.task_kind if rs.secure else TaskKind(rs.kind)
        elif site in rs.evaluators and site not in rs.eval_outcomes:
            grants, kind = rs.eval_grants, TaskKind.EVALUATE
        else:
            return None
        if site not in grants:
            remaining = rs.deadline - self.ctx.monotonic()
            steps = local_steps(job.strategy, site, self._sizes()) \
                if kind in (TaskKind.TRAIN, TaskKind.SECAGG_ADVERTISE) else 0
            grant = new_grant(kind=kind, job_id=job.row.id, round_=rs.round, model_round=rs.model_round,
                              config_yaml=job.row.config_yaml, deadline_unix_s=self.ctx.clock() + remaining,
                              seed=site_seed(job.cfg.seed, rs.round, site),
                              payload=rs.secure.payload(site) if rs.secure and grants is rs.grants else None,
                              local_steps=steps)
            self.ctx.store.add_task(grant.task_id, job.row.id, rs.round, site, kind, grant.nonce)
            grants[site] = grant
        return grants[site]   # a site that restarted mid-task gets the same task back

    def current(self, site: str, task_id: str, round_: int, status: str) -> TaskGrant:
        rs = self.round
        grant = rs.grant_of(site) if rs is not None and rs.round == round_ else None
        grant = check_current(grant, task_id, self.job_id, round_)
        check_unanswered(task_id, status, site in rs.outcomes_for(site))
        return grant

    def served(self, grant: TaskGrant, held: Held | None = None, *, zero_base: bool = False) -> ServedModel:
        return self.job.fetched(held, zero_base=zero_base)

    def upload(self, site: str, grant: TaskGrant, header: UpdateHeader,
               cut: Callable[[BaseException], None]) -> Upload:
        """An update (or masked input) about to stream in for `grant`: its header checked, the fold into its
        sum begun (a summed update into the round's weighted sum, a masked input into the secure round's
        masked sum), its journal named. Rules that hold every update get no fold: their spool is kept once
        complete. `cut(exc)` ends the stream: the round calls it if it closes while the update is arriving."""
        job, rs = self.job, self.round
        masked = grant.kind == TaskKind.SECAGG_MASK
        if site in rs.receiving:
            raise FailedPrecondition(f"an update for task {grant.task_id} is already being received")
        if header.partial is not None:
            return self._upload_partial(site, grant, header, cut)
        layout = rs.secure.masked_layout if masked else job.update_layout
        dp = job.cfg.privacy.dp
        clip_checked = dp is not None and not (masked or own_dp(job.strategy))   # DP-FedAvg: Δ within clip_norm
        try:
            if not masked and not 1 <= header.num_samples <= 2 ** 31:
                raise IntegrityError(f"num_samples must be between 1 and 2**31; got {header.num_samples}",
                                     reason=Reason.NUM_SAMPLES)
            weight = header.num_samples if masked else rs.weight(site, header.num_samples)
            metrics = kept_metrics(job, site_metrics(rs, site, header.eval_metrics, header.metrics, weight))
            coded = job.codec is not None and not masked
            if coded:   # a compressed Δ: its wire layout is checked against the model's, and decoded as it folds
                layout = header.require_layout()
                job.codec.check_layout(job.update_layout, layout, round_=grant.round)
            else:
                layout.require_same(header.require_layout(), what="masked input" if masked else "update")
            if masked:
                fold = rs.secure.masked.begin()
            elif coded:
                model, wire, codec, round_ = job.update_layout, layout, job.codec, grant.round
                fold = CodedFold(rs.total, 1 if uniform_weights(job.strategy, dp) else weight,
                                 lambda: codec.decoder(model, wire, round_=round_))
            elif rs.total is not None:
                fold = rs.total.begin(1 if uniform_weights(job.strategy, dp) else weight)
            else:
                fold = None
            upload = Upload(layout, self.ctx.store.spool / f"{grant.task_id}.part", fold=fold,
                            distance=Distance(layout, job.base) if clip_checked and not coded else None,
                            owner=rs, weight=weight, metrics=metrics)
        except IntegrityError as exc:
            self._record(rs, grant, site, TaskStatus.REJECTED, str(exc), code=exc.reason)
            raise
        if fold is not None:
            rs.folding[site] = upload
        rs.receiving[site] = cut
        return upload

    def _upload_partial(self, site: str, grant: TaskGrant, header: UpdateHeader,
                        cut: Callable[[BaseException], None]) -> Upload:
        """A relay's exact partial sum of its children's updates, folded as the integers they would have added
        here (WeightedSum.begin_exact): the mean is a flat federation's, bit for bit."""
        job, rs = self.job, self.round
        try:
            if problem := partial_sum_problem(job.cfg, job.strategy, job.codec):
                raise IntegrityError(f"a relay's partial sum cannot be taken for this job: {problem}",
                                     reason=Reason.LAYOUT)
            if not 1 <= header.num_samples <= 2 ** 62 or header.partial.updates < 1:
                raise IntegrityError(f"a partial sum needs num_samples in [1, 2**62] and at least one update; got "
                                     f"{header.num_samples} over {header.partial.updates}", reason=Reason.NUM_SAMPLES)
            # Bounded by the rows its children reported (their sum, at the relay's Join); not capped again here:
            # sites.max_weight_share caps each child among its relay's children, and a sum cannot be re-weighed.
            rs.check_rows(site, header.num_samples)
            weight = header.num_samples
            layout = exact_layout(job.update_layout)
            layout.require_same(header.require_layout(), what="partial sum")
            metrics = kept_metrics(job, site_metrics(rs, site, header.eval_metrics, header.metrics, weight))
            upload = Upload(layout, self.ctx.store.spool / f"{grant.task_id}.part",
                            fold=rs.total.begin_exact(weight, header.partial.updates), owner=rs, weight=weight,
                            metrics=metrics)
        except IntegrityError as exc:
            self._record(rs, grant, site, TaskStatus.REJECTED, str(exc), code=exc.reason)
            raise
        rs.folding[site] = upload
        rs.receiving[site] = cut
        return upload

    def accepted(self, site: str, grant: TaskGrant, header: UpdateHeader, upload: Upload) -> str:
        """The upload arrived whole and valid: it counts, unless its round closed meanwhile or the clip
        check refuses it."""
        job, rs = self.job, upload.owner
        rs.receiving.pop(site, None)
        if self.ended or self.round is not rs or rs.grants.get(site) is not grant or site in rs.outcomes:
            raise RoundClosed(f"round {grant.round} of job {grant.job_id} closed before the update was complete")
        if grant.kind == TaskKind.SECAGG_MASK:
            upload.accept()
            del rs.folding[site]   # in for good
            self._record(rs, grant, site, TaskStatus.SUBMITTED, "")
            return f"masked input for round {grant.round} accepted"
        dp = job.cfg.privacy.dp
        try:
            if dp is not None and not own_dp(job.strategy):   # DP-FedAvg: every update within clip_norm of the
                check_clipped(upload.norm, dp.clip_norm)        # global model; sites clip
            if holds_updates(job.strategy):   # robust rules and ensembles need every update at once
                rs.held.append((site, upload.weight, upload.keep()))
            else:
                upload.accept()
                del rs.folding[site]   # in for good
        except IntegrityError as exc:
            self._record(rs, grant, site, TaskStatus.REJECTED, str(exc), code=exc.reason)
            raise
        rs.contributors.append(site)
        rs.samples += 1 if dp is not None else upload.weight   # under DP, no site's row count
        self._record(rs, grant, site, TaskStatus.SUBMITTED, "", upload.metrics)
        capped = (f", weighted as {upload.weight}: sites.max_weight_share caps one site's share"
                  if upload.weight < header.num_samples else "")
        return f"update for round {grant.round} accepted ({header.num_samples} samples{capped})"

    def refused(self, site: str, grant: TaskGrant, upload: Upload, exc: BaseException) -> None:
        """The stream failed part-way: an invalid chunk (rejected), a stall (late: the round waits for it no
        longer), or a broken stream (nothing recorded: it may be sent again while the round is open)."""
        rs = upload.owner
        rs.receiving.pop(site, None)
        status = TaskStatus.REJECTED if isinstance(exc, IntegrityError) else \
            TaskStatus.LATE if isinstance(exc, TimedOut) else None
        if status is not None and not self.ended and self.round is rs and site not in rs.outcomes:
            self._record(rs, grant, site, status, str(exc), code=getattr(exc, "reason", None))

    def ended_upload(self, site: str, upload: Upload) -> None:
        """After every upload, accepted or not: whatever of it is in a sum and was not accepted comes out,
        before its journal goes (serialised, under the lock, with a closing round's withdrawals)."""
        rs = upload.owner
        if rs.folding.get(site) is upload:
            del rs.folding[site]
        upload.withdraw()
        upload.discard()

    def answered(self, site: str, grant: TaskGrant, answer: SecaggAnswer | TaskResult) -> str:
        if isinstance(answer, SecaggAnswer):
            return self._secagg(site, grant, answer)
        return self._result(site, grant, answer)

    def _secagg(self, site: str, grant: TaskGrant, answer: SecaggAnswer) -> str:
        job, rs, value = self.job, self.round, answer.value
        try:
            metrics = None
            if answer.body == "advert":
                rs.check_rows(site, value.num_samples)   # a signed advert cannot be re-weighted, only refused
                rs.secure.on_advert(site, value)
                metrics = kept_metrics(job, site_metrics(rs, site, answer.eval_metrics, answer.metrics,
                                                         value.num_samples))
            elif answer.body == "shares":
                rs.secure.on_shares(site, value)
            else:
                rs.secure.on_reveal(site, value)
        except IntegrityError as exc:
            self._record(rs, grant, site, TaskStatus.REJECTED, str(exc), code=exc.reason)
            raise
        self._record(rs, grant, site, TaskStatus.SUBMITTED, "", metrics)
        return f"{answer.body} for round {grant.round} accepted"

    def _result(self, site: str, grant: TaskGrant, result: TaskResult) -> str:
        job, rs = self.job, self.round
        reason = bounded(result.reason)   # the site's own words, stored and shown: 2 KiB at most
        if result.status == TaskStatus.DECLINED:
            self.ctx.store.decline(job.row.id, site, reason or "declined by site policy")
            self._record(rs, grant, site, TaskStatus.DECLINED, reason or "declined by site policy")
            return "decline recorded; this site will not be asked again for this job"
        if result.status == TaskStatus.FAILED:
            self._record(rs, grant, site, TaskStatus.FAILED, reason or "the site reported a failure")
            return "failure recorded"
        if result.status == TaskStatus.TRAINED:
            raise FailedPrecondition("`trained` answers a training task of an asynchronous secure job; this job "
                                     "runs in synchronous rounds")
        if grant.kind != TaskKind.EVALUATE:
            raise FailedPrecondition("a training task is answered with SubmitUpdate, not an evaluation result")
        metrics = kept_metrics(job, site_metrics(rs, site, result.eval_metrics))
        self._record(rs, grant, site, TaskStatus.EVALUATED, "", metrics)
        return "evaluation recorded"

    def stop(self, why: str, *, dropped: bool = False) -> None:
        rs, self.ended = self.round, True
        if rs is None:
            return
        rs.end_uploads(f"round {rs.round} was dropped: {why}" if dropped else why)
        rs.drop_held()
        if dropped:
            self.ctx.store.close_round(self.job_id, rs.round, status="failed", message=why,
                                       contributors=sorted(rs.contributors), total_samples=rs.samples)

    # internals ---------------------------------------------------------------------------
    def _record(self, rs: RoundState, grant: TaskGrant, site: str, status: TaskStatus, reason: str,
                metrics: dict | None = None, *, code: Reason | None = None) -> None:
        """Record a site's task outcome; `code` says why a rejected update was refused (IntegrityError.reason)."""
        rs.outcomes_for(site)[site] = status
        reason = bounded(reason)
        self.ctx.store.finish_task(grant.task_id, status, reason, job_id=grant.job_id, round_=grant.round,
                                   site=site, metrics=metrics, code=code)
        if reason:
            log.info("job %s round %d site %s: %s (%s)", grant.job_id, grant.round, site, status, reason)
        self.ctx.notify()

    def _sizes(self) -> dict[str, int]:
        """Training rows per site for this job's dataset, as the sites reported them when they joined."""
        return self.ctx.presence.rows(self.job.cfg.data.dataset)

    def _present(self) -> set[str]:
        return self.ctx.presence.online() | set(self.busy())

    def _maybe_open_round(self, now: float) -> float:
        """Open the next round if its sites are there; how long until the engine should look again."""
        job, store = self.job, self.ctx.store
        cfg = job.cfg
        dp = cfg.privacy.dp
        evaluating = training_over(model_round=job.model_round, rounds=cfg.rounds, budget_stop=bool(job.budget_stop),
                                   strategy_done=strategy_done(job.strategy, job.model_round))
        if evaluating and not evaluates(cfg):
            message = (f"round {job.model_round} pooled the sites' sums; `plexus job show {job.row.id}` prints the "
                       "figures")
            store.set_job(job.row.id, status=JobStatus.COMPLETED, message=message,
                          event=("job_completed", job.model_round, "", message))
            self._end()
            return 0.0
        declined = store.declines(job.row.id)
        online = sorted(self._present() - set(declined))
        known = sorted({row[0] for row in store.sites()} - set(declined))   # registered, online or not
        # A job taken up (after a restart, say) waits for the sites that were in it, or for a new job every
        # registered site, until they are all back or the grace ends: a site reconnecting with backoff is
        # not left out of a round an uninterrupted run would have given it.
        expected = (store.job_sites(job.row.id) - set(declined)) or set(known)
        missing = sorted(expected - set(online))
        grace = self.ctx.rejoin_grace_s
        if missing and not job.opened_any and now - job.activated < grace:
            self._waiting(f"waiting up to {grace:g}s for the job's sites to connect: " + ", ".join(missing))
            return 0.5
        if now < job.retry_at:
            self._waiting(f"round {job.model_round + 1} opens again in {job.retry_at - now:.1f}s "
                          f"(retry {job.retried.get(job.model_round + 1, 0)} of sites.retries={cfg.sites.retries})")
            return min(0.5, job.retry_at - now)
        accounting = dp is not None and not job.budget_stop and job.model_round < cfg.rounds
        # The trainers, drawn once per look (the schedule is pure): ε needs the cohort's size before it opens.
        cohort = choose(job.strategy, job.model_round + 1, online, known) if accounting or not evaluating else []
        if accounting:
            # ε of the cohort drawn now, before the round opens: its q is known only once it is drawn.
            q = round_sampling_rate(len(cohort), len(online), at_random=samples_at_random(cfg))
            after = self._epsilon(q)
            if dp.target_epsilon is not None and after > dp.target_epsilon:
                job.budget_stop = (f"privacy budget reached: round {job.model_round + 1} would bring ε to "
                                   f"{after:.3f} > target {dp.target_epsilon} (δ={dp.delta}); stopped after "
                                   f"round {job.model_round}")
                store.event(job.row.id, "privacy_budget_reached", job.model_round, "", job.budget_stop)
                evaluating = True
        participants = online if evaluating else cohort
        if not can_open(participants, evaluating=evaluating, sites_min=cfg.sites.min):
            self._waiting(f"waiting for sites: {len(participants)} of {cfg.sites.min} needed are online")
            return 0.5
        too_many = secure_cohort_problem(cfg, len(participants)) if not evaluating else None
        if too_many:   # before anyone trains: the same sites would be drawn again
            self._fail_job(f"round {job.model_round + 1} cannot open: {too_many}")
            return 0.0
        job.opened_any = True
        round_ = job.model_round + 1
        kind = TaskKind.EVALUATE if evaluating else TaskKind.TRAIN
        store.open_round(job.row.id, round_, kind)
        store.set_job(job.row.id, message="")
        job.row = store.job(job.row.id)
        secure = None
        if cfg.privacy.secure_aggregation and not evaluating:
            # The rule's update extras are masked with the model's Δ; their layout is the rule's, never a site's.
            secure = SecureRound(job.row.id, round_, job.layout, cfg.privacy.secagg, cfg.sites.min,
                                 max_weight=1 if uniform_weights(job.strategy, dp) else MAX_WEIGHT,
                                 uplink=cfg.compression.uplink if cfg.compression else None, seed=cfg.seed,
                                 extras=Layout.build(update_extras(job.strategy, job.layout)))
        summing = not (evaluating or secure or holds_updates(job.strategy))
        evaluators = [] if evaluating or cfg.sites.evaluate != "all" else sorted(set(online) - set(participants))
        sizes, share = self._sizes(), cfg.sites.max_weight_share
        rows = {s: sizes[s] for s in participants + evaluators if s in sizes}
        self.round = RoundState(round=round_, kind=kind, model_round=job.model_round, participants=participants,
                                deadline=now + cfg.sites.deadline_s,
                                total=job.round_sum(len(participants)) if summing else None, secure=secure,
                                evaluators=evaluators, rows=rows,
                                caps=weight_caps({s: rows.get(s, 0) for s in participants}, share),
                                eval_caps=weight_caps({s: rows.get(s, 0) for s in participants + evaluators}, share))
        if not evaluating:
            for note in opened(job.strategy, round_, participants, known):
                store.event(job.row.id, "strategy", round_, "", note)
        log.info("job %s round %d (%s) opened for %s%s", job.row.id, round_, kind, ", ".join(participants),
                 f"; evaluating: {', '.join(evaluators)}" if evaluators else "")
        self.ctx.notify()
        self.ctx.presence.wake(participants + evaluators)
        return 0.5

    def _waiting(self, message: str) -> None:
        job = self.job
        if job.row.message != message:
            self.ctx.store.set_job(job.row.id, message=message)
            job.row = self.ctx.store.job(job.row.id)

    def _needed(self) -> int:
        return max(self.job.cfg.sites.min, min_contributors(self.job.strategy))

    def _maybe_close_round(self, now: float) -> float:
        job, rs = self.job, self.round
        decision = decide(rs.view(self._needed()), now)
        if decision.action == Action.WAIT:
            return decision.wait_s
        if decision.by_deadline:   # updates still arriving are cut, their sites late
            rs.late = self._late()
            rs.end_uploads(f"round {rs.round} of job {job.row.id} reached its deadline before the update was "
                           "complete (the site is recorded late)")
        if decision.action == Action.ADVANCE:
            self._advance_secure(rs)
            self.ctx.notify()
            return 0.0
        for site in rs.participants:
            if site not in rs.outcomes:
                rs.outcomes[site] = TaskStatus.LATE
        for site in list(rs.folding):   # still arriving at the deadline: out of the sum before the mean
            rs.withdraw(site)
        self._decided(rs, decision)
        self.ctx.notify()
        return 0.0

    def _late(self) -> str:
        """Why a task still unanswered at a round's deadline is late."""
        return f"by the round deadline ({self.job.cfg.sites.deadline_s:g} s)"

    def _decided(self, rs: RoundState, decision) -> None:
        """End the round as decided (finish the job, close with the quorum, or fail)."""
        job, store = self.job, self.ctx.store
        if decision.action == Action.FINISH:
            evaluated = sorted(s for s, o in rs.outcomes.items() if o == TaskStatus.EVALUATED)
            message = f"final model evaluated by {len(evaluated)} site(s)"
            status = JobStatus.BUDGET_REACHED if job.budget_stop else JobStatus.COMPLETED
            if job.budget_stop:
                message = f"{job.budget_stop}; {message}"
            store.close_round(job.row.id, rs.round, status="closed", contributors=evaluated, total_samples=0,
                              message=message, job_update={"status": status, "message": message},
                              event=("job_completed", message), late=rs.late)
            self._end()
        elif decision.action == Action.CLOSE:
            try:
                self._close_with_quorum(rs)
            except IntegrityError as exc:
                self._fail_round(rs, str(exc))
        else:
            needed = self._needed()
            problems = ", ".join(f"{s}: {o}" for s, o in sorted(rs.outcomes.items())
                                 if o != TaskStatus.SUBMITTED) or "none"
            floor = (f"sites.min={needed}" if needed == job.cfg.sites.min else
                     f"the {needed} updates {job.cfg.strategy.name} needs per round")
            self._fail_round(rs, f"{len(rs.contributors)} update(s), below {floor} (other sites — {problems})",
                             retry=True)

    def _close_with_quorum(self, rs: RoundState) -> None:
        """The new model from the round's updates, by the memory mode the strategy allows."""
        job = self.job
        if holds_updates(job.strategy):
            updates = [Update(site, samples, decode(job.update_layout, np.memmap(path, mode="r")))
                       for site, samples, path in sorted(rs.held)]
            state = aggregate_held(job.strategy, rs.round, job.state, updates)
            del updates
            rs.drop_held()
            self._close_training_round(rs, state)
        elif not job.in_memory and mean_is_model(job.strategy):
            # Plain FedAvg: the mean goes block by block into the checkpoint sites then stream.
            blocks = rs.total.mean_blocks(kept=MEAN_BLOCKS_KEPT, elements=MEAN_BLOCK_ELEMENTS)
            self._close_training_round(rs, None, blocks)
        elif job.codec is not None:
            # Compressed updates are Δs from the model the sites started from: base + Σ w·Δ / Σ w.
            mean = self._central_noise(rs, base_plus_mean(job.base, rs.total))
            self._close_training_round(rs, aggregate_mean(job.strategy, rs.round, job.base, mean,
                                                          sorted(rs.contributors)))
        else:
            # A rule steps from the model the sites started from (job.base: under a compressed downlink, the
            # model they decoded), so its pseudo-gradient is their mean Δ and no quantisation error of the
            # downlink enters it.
            current = job.base if reads_current(job.strategy) else None
            if current is None:
                job.release_model()   # the old model goes before the new one
            blob = rs.total.mean_blob(release=True)
            mean = self._central_noise(rs, decode(job.update_layout, blob))
            state = aggregate_mean(job.strategy, rs.round, current, mean, sorted(rs.contributors))
            reuse = state is mean and job.cfg.privacy.dp is None
            self._close_training_round(rs, state, blob if reuse else None)

    def _fail_round(self, rs: RoundState, why: str, *, retry: bool = False) -> None:
        """End a round that produced no model: the job fails, unless `retry` (the round missed its quorum)
        and sites.retries allows opening the round again."""
        job = self.job
        rs.drop_held()
        done = job.retried.get(rs.round, 0)
        if retry and retry_allowed(done, job.cfg.sites.retries):
            try:   # opening the round committed schedule state (cwt's next site): back to the last closed round's
                job.strategy = strategy_at(self.ctx.store, job.cfg, job.row.id, job.model_round)
            except (NotFound, IntegrityError) as exc:
                why = f"{why}; it cannot be opened again: {exc}"
            else:
                self._retry_round(rs, why, done + 1)
                return
        message = f"round {rs.round} failed: {why}; the global model is unchanged at round {job.model_round}"
        if retry:
            message += "; once its sites are back, `plexus job resume` runs it again from there"
        self.ctx.store.close_round(job.row.id, rs.round, status="failed", contributors=sorted(rs.contributors),
                                   total_samples=rs.samples, message=message,
                                   job_update={"status": JobStatus.FAILED, "message": message},
                                   event=("job_failed", message), late=rs.late)
        self._end()

    def _retry_round(self, rs: RoundState, why: str, retry: int) -> None:
        """Close the round that missed its quorum; the next tick opens it again once enough sites are online."""
        job = self.job
        job.retried[rs.round] = retry
        # A site that failed at once (a full disk, a restart) would fail the retries at once too: they wait.
        job.retry_at = self.ctx.monotonic() + min(job.cfg.sites.deadline_s, RETRY_WAIT_S * 2 ** min(retry - 1, 20))
        message = f"round {rs.round} missed its quorum: {why}; opening it again (retry {retry} of " \
                  f"sites.retries={job.cfg.sites.retries})"
        self.ctx.store.close_round(job.row.id, rs.round, status="failed", contributors=sorted(rs.contributors),
                                   total_samples=rs.samples, message=message, job_update={"message": message},
                                   event=("round_retry", message), late=rs.late)
        log.warning("job %s: %s", job.row.id, message)
        self.round = None

    def _advance_secure(self, rs: RoundState) -> None:
        """Close the current secure-aggregation phase; open the next one, or finish the round."""
        job, store, sec = self.job, self.ctx.store, rs.secure
        for site in rs.participants:
            if site not in rs.outcomes:
                rs.outcomes[site] = TaskStatus.LATE
                if site in rs.grants:
                    store.finish_task(rs.grants[site].task_id, TaskStatus.LATE, f"no answer in the {sec.phase} phase",
                                      job_id=job.row.id, round_=rs.round, site=site)
        for site in list(rs.folding):   # masked inputs still arriving as the mask phase ends: out of the sum
            rs.withdraw(site)
        answered = sorted(s for s, o in rs.outcomes.items() if o == TaskStatus.SUBMITTED)
        try:
            following = sec.advance(answered, rs.participants)
            if sec.phase == SecaggPhase.DONE:
                delta, weight = sec.result()
                for site, reason in sorted(sec.rejected.items()):   # their masked inputs are in the sum all the same
                    rs.outcomes[site] = TaskStatus.REJECTED
                    store.finish_task(rs.grants[site].task_id, TaskStatus.REJECTED, reason, job_id=job.row.id,
                                      round_=rs.round, site=site)
                    log.warning("job %s round %d site %s: rejected (%s)", job.row.id, rs.round, site, reason)
                rs.contributors, rs.samples = list(sec.u3), weight
                self._unmasked(rs, delta)
                return
        except PlexusError as exc:   # too few sites answered a phase, or too few honest shares
            self._fail_round(rs, str(exc), retry=True)
            return
        rs.participants, rs.grants, rs.outcomes = following, {}, {}
        rs.deadline = self.ctx.monotonic() + job.cfg.privacy.secagg.phase_timeout_s
        self.ctx.presence.wake(following)
        store.event(job.row.id, f"secagg_{sec.phase}", rs.round, "", f"{len(following)} site(s): "
                    + ", ".join(following))

    def _unmasked(self, rs: RoundState, delta: dict[str, np.ndarray]) -> None:
        """A secure round's survivors' mean Δ is unmasked: the new model from it."""
        job = self.job
        mean = base_plus_unmasked(job.base, delta, rs.secure.extras)
        mean = self._central_noise(rs, mean)   # central DP: on the unmasked mean of the survivors
        self._close_training_round(rs, aggregate_mean(job.strategy, rs.round, job.base, mean,
                                                      sorted(rs.contributors)))

    def _central_noise(self, rs: RoundState, mean: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Central DP-FedAvg: N(0, (zS)²) on the sum of clipped updates, i.e. std zS/m on their mean.

        Keyed from 32 fresh OS-random bytes that are never stored: the noise is not derivable
        from anything a config reader knows. Only dp.reproducible_noise keys it from the job
        seed and name (a reproducible run that is not private, and says so).
        """
        cfg = self.job.cfg
        dp = cfg.privacy.dp
        if dp is None or dp.mode != "central" or own_dp(self.job.strategy):
            return mean
        std = central_std(dp.noise_multiplier, dp.clip_norm, len(rs.contributors))
        seed = cfg.seed if dp.reproducible_noise else None
        noisy = add_noise(mean, std, noise_key(seed, cfg.name, rs.round, "coordinator"))
        return {k: noisy[k].astype(mean[k].dtype) for k in mean}

    def _close_training_round(self, rs: RoundState, state: dict[str, np.ndarray] | None, state_blob=None) -> None:
        """state_blob, when given, is the new model's wire blob (`state` views it, or is None): a bytes-like
        blob, or an iterator of its blocks when the model is only ever served from the checkpoint."""
        job, store = self.job, self.ctx.store
        # First, so that a model the downlink cannot carry fails the round before any of it is stored.
        step = job.downlink_step(rs.round, state) if state is not None else None
        if state_blob is not None:
            layout, blob = job.update_layout, state_blob
        else:
            layout, blob = encode(state)
        store.save_checkpoint_blob(job.row.id, rs.round, layout, blob)
        save_strategy(store, job.row.id, rs.round, job.strategy)
        message = f"{len(rs.contributors)} update(s), {rs.samples} samples"
        store.close_round(job.row.id, rs.round, status="closed", contributors=sorted(rs.contributors),
                          total_samples=rs.samples, message=message, job_update={"current_round": rs.round},
                          late=rs.late)
        store.prune_checkpoints(job.row.id, rs.round)
        self.ctx.saved(rs.round)
        job.row = store.job(job.row.id)
        dp = job.cfg.privacy.dp
        if dp is not None:
            epsilon = job.epsilons[rs.round]   # computed for this round's cohort as it opened (_epsilon)
            ledger = {(rs.round, "", "privacy", "epsilon"): epsilon, (rs.round, "", "privacy", "delta"): dp.delta}
            if samples_at_random(job.cfg):   # q < 1 possible
                ledger[(rs.round, "", "privacy", "sampling_rate")] = job.rates[rs.round]
            if dp.reproducible_noise:   # ε holds only against whoever cannot read the config: flag every round
                ledger[(rs.round, "", "privacy", "noise_reproducible")] = 1.0
            store.record_metrics(job.row.id, ledger)
        if ledger := spent(job.strategy):   # a statistics job's noise per query (statistics.dp)
            store.record_metrics(job.row.id, {(rs.round, "", "privacy", name): value for name, value in ledger.items()})
            store.event(job.row.id, "privacy_spent", rs.round, "",
                        ", ".join(f"{name} {value:g}" for name, value in ledger.items()))
        if state is not None:
            job.set_model(layout, blob, rs.round, step)
        if not job.in_memory:
            job.serve_from_checkpoint(store, rs.round)   # sites stream it from the checkpoint just written
        job.model_round = rs.round
        self.round = None
        log.info("job %s round %d closed: %s", job.row.id, rs.round, message)

    def _fail_job(self, message: str) -> None:
        self.ctx.store.set_job(self.job_id, status=JobStatus.FAILED, message=message,
                               event=("job_failed", 0, "", message))
        self._end()

    def _end(self) -> None:
        self.ended = True
        self.round = None


def partial_sum_problem(cfg: RoundConfig, strategy, codec) -> str:
    """Why relays' partial sums cannot stand in for their children's updates in this job ('' if they can): the
    round must fold plain weighted updates, which relays sum exactly."""
    if cfg.asynchronous is not None:
        return "it is asynchronous (each update carries its own staleness)"
    if cfg.privacy.secure_aggregation:
        return "it uses secure aggregation (not yet across relay tiers)"
    if cfg.privacy.dp is not None:
        return "it uses differential privacy (per-site weights and the sampling rate are not yet kept across tiers)"
    if codec is not None:
        return "its updates are compressed (compression.uplink)"
    if holds_updates(strategy):
        return f"{cfg.strategy.name} needs every site's update at once"
    return ""


def secure_cohort_problem(cfg: RoundConfig, sites: int) -> str:
    """Why a secure round over `sites` sites cannot sum in the field of the job's uplink codec ('' if it can)."""
    codec = cfg.compression.uplink.codec if cfg.compression else "none"
    limit = max_secure_sites(codec) if cfg.privacy.secure_aggregation else None
    if limit is None or sites <= limit:
        return ""
    return (f"{sites} sites would train, but under privacy.secure_aggregation uplink codec {codec!r} sums at most "
            f"{limit} sites per round (its grid of clip/L, L = {2 ** (SECURE_FIELD_BITS[codec] - 1) - 1} - sites, "
            f"must stay at least clip/{MIN_GRID_LEVELS}); set sites.count to {limit} or fewer, or use "
            f"{'fp16' if codec == 'int8' else 'randk'}")


def _noise_is_reproducible(cfg: RoundConfig) -> bool:
    return cfg.privacy.dp is not None and cfg.privacy.dp.reproducible_noise


def kept_metrics(job: ActiveJob, metrics: dict) -> dict:
    """The site metrics the store keeps: none under privacy.dp, where they would describe each site's data
    outside the accounted ε (sites withhold them; this covers a site that sends them anyway)."""
    return {} if job.cfg.privacy.dp is not None else metrics


def checked_metrics(values, field_name: str = "metrics") -> dict[str, float]:
    """A site's reported metrics as floats: at most MAX_METRICS, each with a 1-64 character name and a finite value
    (IntegrityError otherwise)."""
    if len(values) > MAX_METRICS:
        raise IntegrityError(f"{field_name} has {len(values)} entries; at most {MAX_METRICS} are allowed",
                             reason=Reason.METRICS)
    for name, value in values.items():
        if not name or len(name) > 64 or not np.isfinite(value):
            raise IntegrityError(f"{field_name}[{name[:64]!r}] must have a 1-64 character name and a finite value",
                                 reason=Reason.METRICS)
    return {name: float(value) for name, value in values.items()}


def site_metrics(rs: RoundState, site: str, eval_metrics, train_metrics=None,
                  num_samples: int | None = None) -> dict:
    """A site's reported metrics, validated, keyed for the store: (round, kind, name) -> value.

    Eval metrics describe the incoming global model (model_round); train metrics this round. Every
    reader averages eval metrics over sites weighted by their "num_samples", so that weight is bounded
    as training weights are (RoundState.eval_caps): a site claiming 1e300 rows cannot set the average.
    """
    out = {}
    for field_name, values, key in (("eval_metrics", eval_metrics, (rs.model_round, "eval")),
                                    ("metrics", train_metrics or {}, (rs.round, "train"))):
        for name, value in checked_metrics(values, field_name).items():
            if key[1] == "eval" and name == "num_samples":
                if value < 1:
                    raise IntegrityError(f"eval_metrics['num_samples'] must be at least 1; got {value}",
                                         reason=Reason.METRICS)
                value = min(value, rs.eval_caps.get(site, 1))
            out[(*key, name)] = float(value)
    if num_samples is not None:
        out[(rs.round, "train", "num_samples")] = float(num_samples)
    return out
