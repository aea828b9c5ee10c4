"""The site agent's connection loop: dial out, take tasks, train locally, send updates.

The agent only ever dials out. While the coordinator is unreachable it retries
with capped exponential backoff; a coordinator restart costs a few seconds, not
an operator.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

import grpc
import numpy as np

from plexus import __version__, staleness, transport
from plexus.accounting import PrivacyLedger, dp_sgd_schedule
from plexus.compression import is_delta, job_uplink
from plexus.config import (
    SITE_BACKOFF_CAP_S,
    SITE_BACKOFF_JITTER,
    SUMMING_STRATEGIES,
    DatasetSpec,
    DataSpec,
    RoundConfig,
    SiteConfig,
    parse_round_config,
    weighs_sites_equally,
)
from plexus.datasets import DataError, Split, load_for_job, train_rows
from plexus.dp import add_noise, clip_update, distributed_std, noise_key
from plexus.errors import ConfigError, FailedPrecondition, IntegrityError, storage_failure, storage_text
from plexus.identity import kit_identity, load_kit
from plexus.models import build_job_model, installed_models, load_numpy_state, state_to_numpy, state_views
from plexus.proto.plexus.v1 import federation_pb2 as fpb, federation_pb2_grpc
from plexus.secagg import SiteSession, advert_to_proto
from plexus.wire import DEFAULT_CHUNK_BYTES, Layout, assemble, chunk_size, decode, encode_chunks
from site_agent.audit import AuditWriteFailed, SiteAudit
from site_agent.downlink import downlink_spec, fetch_model, model_header
from site_agent.local import (
    LocalResult,
    check_statistics_columns,
    evaluates,
    local_update,
    needs_served,
    raw_table,
    reads_raw_table,
    served_layout,
)
from site_agent.policy import policy_digest, refusal
from site_agent.secure import Pending, check_sums_fit, masked_input_messages, secagg_phase
from site_agent.split import SiteSplit, Stream as SplitStream, evaluate_session, train_session
from site_agent.state import JobState, ServedChain, job_id_refusal
from site_agent.team import Team, spreads
from site_agent.training import TrainResult, evaluate, train_local_dp_sgd
from site_agent.uplink import Coded, encode_update, model_delta, residual_layout, rounding_rng

log = logging.getLogger("plexus.site")

BACKOFF_START_S = 0.25
BACKOFF_CAP_S = SITE_BACKOFF_CAP_S   # a coordinator's rejoin_grace_s is validated against it
# A refusal (revoked or foreign certificate) will not heal by itself: retry rarely, loudly, until a new kit.
REFUSED_RETRY_S = 60.0
_REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
SECAGG_LATER_PHASES = (fpb.TASK_SECAGG_SHARE, fpb.TASK_SECAGG_MASKED_INPUT, fpb.TASK_SECAGG_UNMASK)
# the tasks that train on local data (synchronous)
TRAINING_KINDS = (fpb.TASK_TRAIN, fpb.TASK_SECAGG_ADVERTISE, fpb.TASK_SPLIT_TRAIN)
SPLIT_KINDS = (fpb.TASK_SPLIT_TRAIN, fpb.TASK_SPLIT_EVALUATE)
SPLIT_REPLY_MARGIN_S = 60.0   # past split.batch_timeout_s, the coordinator's own bound on each message
KNOWN_KINDS = (fpb.TASK_TRAIN, fpb.TASK_EVALUATE, fpb.TASK_SECAGG_ADVERTISE, *SECAGG_LATER_PHASES, *SPLIT_KINDS)
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
          grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class SiteAgent:
    """One site's agent: dials the coordinator, long-polls for tasks and runs each one on local data.

    Raw rows never leave the site: only updates (or masked inputs), the metrics `to_report` lets
    through and the row counts `advertised_rows` sends at Join. Every task ends with an update, a
    secure-aggregation message or a `report` (declined, failed, evaluated).
    Subclasses may override `handle`, `local_update`, `evaluate`, `to_report`, `load_data` and
    `advertised_rows` (the benchmarks and the adversarial tests do), and `split_stream`, the class of a split
    task's Split stream.
    """

    split_stream = SplitStream

    def __init__(self, config: SiteConfig, *, stop: threading.Event | None = None,
                 backoff_cap_s: float = BACKOFF_CAP_S, refused_retry_s: float = REFUSED_RETRY_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, clock: Callable[[], float] = time.monotonic):
        """`stop` ends `run`; `chunk_bytes` is the largest update chunk this site sends; `clock` times local
        training for `emulation.slowdown`."""
        self.config = config
        self.kit = load_kit(config.kit)
        me = kit_identity(self.kit, "site", "give the kit `plexus pki add-site DIR NAME` wrote for this site")
        if me.name != config.site:
            raise ConfigError(f"{config.kit}: the kit is site {me.name!r}'s, but the config says `site: "
                              f"{config.site}`; the coordinator knows a site only by its certificate: use "
                              f"{config.site!r}'s kit, or set site: {me.name}")
        self.stop = stop or threading.Event()
        self.backoff_cap_s = backoff_cap_s
        self.refused_retry_s = refused_retry_s
        self._channel: grpc.Channel | None = None
        self.chunk_bytes = chunk_bytes
        self._data: dict[DataSpec, Split] = {}
        self._tables: dict[DatasetSpec, dict[str, np.ndarray]] = {}   # raw tables, for statistics jobs
        self._secure: dict[tuple[str, int], Pending] = {}
        self._kept: dict[tuple[str, int], _Kept] = {}   # asynchronous secure jobs: (job, base version) -> update
        self.audit = SiteAudit(config.state_dir, actor=f"site:{config.site}")
        self._rng = random.Random()
        self._clock = clock
        # training.workers > 1 (or nodes): local training runs as a team of processes, this agent its rank 0
        self.team = Team(config) if spreads(config.training) else None
        if config.emulation is not None:
            slowdown = config.emulation.slowdown
            log.warning("EMULATION ONLY: site %r emulates a slower site (emulation.slowdown: %g): after each "
                        "training task it waits %g× that task's training time before answering; remove "
                        "`emulation:` from its config at any real site", config.site, slowdown, slowdown - 1)

    def run(self) -> None:
        """Connect, serve tasks, reconnect on failure, until `stop` is set."""
        delay = BACKOFF_START_S
        while not self.stop.is_set():
            pause = None
            try:
                with transport.channel(self.kit, self.config.coordinator) as channel:
                    self._channel = channel
                    stub = federation_pb2_grpc.FederationStub(channel)
                    reply = stub.Join(self.join_request(), timeout=10)
                    log.info("joined federation %r as site %r", reply.federation, reply.site)
                    delay = BACKOFF_START_S
                    self._serve(stub, reply.poll_timeout_s or 20.0)
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    break   # shutdown() cancelled the call in flight
                code = exc.code()
                pause = self.refused_retry_s if code in _REFUSED else delay
                level = logging.INFO if code in _RETRY else logging.ERROR
                log.log(level, "coordinator %s: %s: %s; retrying in %.1fs", self.config.coordinator,
                        code.name, exc.details(), pause)
            finally:
                self._channel = None
            self.stop.wait((pause or delay) * (1 + SITE_BACKOFF_JITTER * self._rng.random()))
            delay = min(delay * 2, self.backoff_cap_s)
        if self.team is not None:
            self.team.close()

    def join_request(self) -> fpb.JoinRequest:
        """What this site tells the coordinator at Join: its agent, models, policy and training rows per dataset."""
        rows = self.advertised_rows()   # a dataset that does not load is not advertised
        return fpb.JoinRequest(agent_version=__version__, models=sorted(installed_models()), datasets=sorted(rows),
                               policy_digest=policy_digest(self.config.policy), dataset_rows=rows)

    def shutdown(self) -> None:
        """Stop now: set `stop` and cancel the call in flight (a long poll would hold on to its deadline)."""
        self.stop.set()
        channel = self._channel
        if channel is not None:
            channel.close()

    def _serve(self, stub, poll_s: float) -> None:
        while not self.stop.is_set():
            task = stub.NextTask(fpb.NextTaskRequest(wait_s=poll_s), timeout=poll_s + 15)
            if task.kind != fpb.TASK_NONE:
                self.handle(stub, task)

    def handle(self, stub, task: fpb.Task) -> None:
        """Run one task; policy refusals and local failures are reported, never silently dropped.

        A TRAIN task of a job with an uplink codec (site_agent/uplink.py) sends its coded Δ: train → DP clip
        (+ noise share if distributed) → add the residual → encode → DP bound on the decoded sent vector →
        stream; the new residual is kept only once the coordinator accepted the update.
        """
        reason = job_id_refusal(task.job_id)
        if reason:
            return self._decline(stub, task, reason)
        try:
            job = round_config(task.config_yaml, task.job_id)
        except ValueError as exc:
            return self.report(stub, task, fpb.RESULT_FAILED, f"cannot read the job's round config: {exc}")
        if reason := kind_refusal(job, task.kind):
            return self._decline(stub, task, reason)
        state = JobState(self.config.state_dir, task.job_id)
        # An asynchronous secure job trains on its TRAIN task; its cohort's advert masks the update kept then.
        cohorts = in_cohorts(job)
        trains = task.kind == fpb.TASK_TRAIN if cohorts else task.kind in TRAINING_KINDS
        try:
            reason = self._refusal(job, state, trains)
            if not reason:
                self.job_data(job)   # the schema check: data that cannot serve the job declines it
        except DataError as exc:   # the local detail (file, rows, values) stays in this site's log
            log.warning("dataset %r cannot serve job %s: %s", job.data.dataset, task.job_id, exc)
            reason = exc.remote
        except Exception as exc:   # the site's own record cannot be read, or the policy's sums fail: nothing ran
            log.exception("task %s failed", task.task_id)
            return self.report(stub, task, fpb.RESULT_FAILED, failure_reason(exc))
        if reason:
            return self._decline(stub, task, reason)
        if task.kind in SPLIT_KINDS:
            return self._split(stub, task, job, state)
        try:
            if task.kind in SECAGG_LATER_PHASES or (cohorts and task.kind == fpb.TASK_SECAGG_ADVERTISE):
                return self._secagg_phase(stub, task, job)
            if task.kind == fpb.TASK_EVALUATE and not evaluates(job):   # a statistics job's sums are no model
                return self.report(stub, task, fpb.RESULT_EVALUATED, "", {})
            coded = job_uplink(job) if task.kind == fpb.TASK_TRAIN else None   # None: the whole model travels
            data = self.job_data(job)
            model = build_job_model(job)
            served = self._fetch(stub, task, served_layout(job, model), job)
            names = set(model.state_dict())
            incoming = {k: v for k, v in served.items() if k in names}
            load_numpy_state(model, incoming)
            # Read before training: a damaged residual fails the task before it touches the data.
            residual = (state.residual(residual_layout(Layout.of(state_views(model))))
                        if coded is not None and coded.feedback else None)
            kind = "evaluate" if task.kind == fpb.TASK_EVALUATE else "train"
            if trains:
                state.count_round()
            self.audit.ran(task.job_id, task.round, job.data.dataset, job.model.name, kind)
            eval_metrics = self.evaluate(model, data) if evaluates(job) else {}
            if task.kind == fpb.TASK_EVALUATE:
                return self.report(stub, task, fpb.RESULT_EVALUATED, "", self.to_report(job, eval_metrics)[0])
            if not (job.privacy.dp is not None or task.kind == fpb.TASK_SECAGG_ADVERTISE or cohorts
                    or needs_served(job) or coded is not None):
                served = incoming = {}   # the model holds the weights now: let the fetched copy go
            started = self._clock()
            if job.privacy.dp_sgd is not None:
                local = LocalResult(self._train_dp_sgd(model, data, job, task, state), {}, lambda: None)
            else:
                with self.team.session(task.config_yaml, task.job_id, model) if self.team is not None \
                        else contextlib.nullcontext():
                    local = self.local_update(job, model, served, data, task)
            if not self._emulate_slowdown(self._clock() - started):
                log.info("job %s round %d: stopped during the emulated slowdown; the update is not sent",
                         task.job_id, task.round)
                return None
            # A summing strategy's site half is its own DP (rows clipped, noise on the sums): no DP-FedAvg on top.
            dp_fedavg = job.privacy.dp is not None and job.strategy.name not in SUMMING_STRATEGIES
            clipped = self._clip_and_noise(model, incoming, job, task) if dp_fedavg else None
            eval_metrics, result = self.to_report(job, eval_metrics, local.result)
            if task.kind == fpb.TASK_SECAGG_ADVERTISE:
                return self._advertise(stub, task, job, incoming, model, local.update, result, eval_metrics)
            if cohorts:
                return self._keep(stub, task, incoming, model, result, eval_metrics)
            if coded is not None:
                upload = self._code(coded, job, task, model, incoming, clipped, residual, local)
        except grpc.RpcError:
            raise
        except DataError as exc:   # found by the local work (a statistics job's small cells): declined, as above
            log.warning("dataset %r cannot serve job %s: %s", job.data.dataset, task.job_id, exc)
            self._secure.pop((task.job_id, task.round), None)
            return self._decline(stub, task, exc.remote)
        except Exception as exc:   # IntegrityError too: whatever the coordinator sent, reported, and the agent goes on
            log.exception("task %s failed", task.task_id)
            self._secure.pop((task.job_id, task.round), None)
            return self.report(stub, task, fpb.RESULT_FAILED, failure_reason(exc))
        if coded is not None:
            update = upload.wire
        else:
            update = {**local.update, **state_views(model)}   # the model as it stands (after any DP clipping) + extras
        if self._submit(stub, task, update, result, eval_metrics):
            local.commit()   # e.g. SCAFFOLD's control variate: kept only once the coordinator took the update
            if coded is not None and upload.residual is not None:
                self._keep_residual(state, task, upload.residual)

    def _split(self, stub, task, job: RoundConfig, state: JobState) -> None:
        """A split-learning task: fetch this site's parts, then one Split session (site_agent/split.py)."""
        training = task.kind == fpb.TASK_SPLIT_TRAIN
        try:
            site = SiteSplit(job)
            data = self.job_data(job)
            site.load(self._fetch(stub, task, site.layout, job))
            if training:
                state.count_round()
            self.audit.ran(task.job_id, task.round, job.data.dataset, job.model.name,
                           "split_train" if training else "split_evaluate")
        except grpc.RpcError:
            raise
        except Exception as exc:   # IntegrityError too: whatever the coordinator sent, reported, and the agent goes on
            log.exception("task %s failed", task.task_id)
            return self.report(stub, task, fpb.RESULT_FAILED, failure_reason(exc))
        stream = self.split_stream(stub)
        stream.reply_timeout_s = job.split.batch_timeout_s + SPLIT_REPLY_MARGIN_S
        try:
            metrics = (train_session if training else evaluate_session)(stream, site, data, task)
        except grpc.RpcError as exc:
            if exc.code() in _RETRY:
                raise
            log.warning("job %s epoch %d: the Split session was refused: %s", task.job_id, task.round, exc.details())
            return None
        except Exception as exc:   # a malformed reply (IntegrityError), or anything else: reported, the agent goes on
            log.exception("task %s failed", task.task_id)
            self.report(stub, task, fpb.RESULT_FAILED, failure_reason(exc))
            return None
        finally:
            stream.close()
        log.info("job %s epoch %d: split %s done (%s; %d bytes up, %d down)", task.job_id, task.round,
                 "training" if training else "evaluation",
                 ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())), stream.bytes_up, stream.bytes_down)
        return None

    @staticmethod
    def _code(codec, job: RoundConfig, task, model, incoming: dict, clipped: dict | None, residual: dict | None,
              local: LocalResult) -> Coded:
        """The coded Δ = trained − incoming (the DP-clipped Δ under privacy.dp) with the residual folded in."""
        trained = state_views(model)
        if extra := sorted(set(local.update) - set(trained)):
            raise ValueError(f"strategy {job.strategy.name!r} sends tensors beside the model ({extra[:3]}), which "
                             "cannot travel in a compressed update; remove compression.uplink from the job")
        if clipped is None:
            delta = model_delta(trained, incoming)
        else:
            delta = {k: v.astype(np.float32) for k, v in clipped.items()}
        dp = job.privacy.dp
        return encode_update(codec, Layout.of(trained), delta, residual, round_=task.round,
                             rng=rounding_rng(task.seed), clip_norm=None if dp is None else dp.clip_norm)

    @staticmethod
    def _keep_residual(state: JobState, task, residual: dict) -> None:
        """Keep the residual of an accepted update. Should that fail, drop the old one: the accepted update
        already carried it, and sending it again would count it twice."""
        try:
            state.keep_residual(residual)
        except OSError as exc:
            log.error("job %s round %d: the update was accepted but its residual could not be kept (%s); the "
                      "residual restarts from zero", task.job_id, task.round, exc)
            try:
                state.drop_residual()
            except OSError as again:
                log.error("job %s: the old residual could not be removed either (%s); the next update will "
                          "send it a second time", task.job_id, again)

    def _emulate_slowdown(self, trained_s: float) -> bool:
        """emulation.slowdown: wait (slowdown − 1) × trained_s, cut short by `stop`; False if it was."""
        if self.config.emulation is None:
            return True
        return not self.stop.wait((self.config.emulation.slowdown - 1) * max(trained_s, 0.0))

    def _refusal(self, job: RoundConfig, state: JobState, trains: bool) -> str | None:
        """Why this site declines the task, judged by its own record of the job (not the task's round)."""
        if job.data.dataset not in self.config.datasets:
            return (f"dataset {job.data.dataset!r} is not configured at this site "
                    f"(configured: {sorted(self.config.datasets)})")
        if trains and job.privacy.dp_sgd is not None and self.team is not None:
            return (f"this site trains with {self.team.world} workers (site.yaml training) and the job uses "
                    "privacy.dp_sgd, which Plexus runs in one process (Opacus's accounting of distributed "
                    "Poisson batches is not wired in): this site takes DP-SGD jobs once training.workers is 1")
        ledger = state.ledger() if trains and job.privacy.dp_sgd is not None else None
        if ledger is not None and not ledger.history and state.rounds_trained() > 0:
            # Each DP-SGD round is in the ledger before it trains: an empty one after trained rounds was lost.
            return (f"this site has trained {state.rounds_trained()} round(s) of job {state.job_id!r} with DP-SGD "
                    f"and its privacy ledger (dp_sgd/{state.job_id}.json in its state_dir) is missing or empty, so "
                    "the privacy already spent cannot be counted; restore that file from a backup of the state_dir")
        return refusal(self.config.policy, job, installed_models(), round_=state.rounds_trained() + int(trains),
                       ledger=ledger, train_size=lambda: len(self.load_data(job.data).y_train))

    def _decline(self, stub, task, reason: str) -> None:
        log.warning("declining job %r: %s", task.job_id, reason)
        try:
            self.audit.declined(task.job_id, reason)
        except AuditWriteFailed as exc:   # still decline, and say why the site's own record lacks it
            log.error("job %r: %s", task.job_id, exc)
            reason = f"{reason} (and {exc})"
        self.report(stub, task, fpb.RESULT_DECLINED, reason)

    def _audit_sent(self, task, sha256: str, num_samples: int) -> None:
        """Record an update that left the site; it has left, so a failure to record it is only logged."""
        try:
            self.audit.sent(task.job_id, task.round, sha256, num_samples)
        except AuditWriteFailed as exc:
            log.error("job %s round %d: the update was sent (sha256=%s) but %s", task.job_id, task.round, sha256,
                      exc)

    # secure aggregation ---------------------------------------------------------------------
    def _advertise(self, stub, task, job: RoundConfig, incoming: dict, model, update: dict, result,
                   eval_metrics: dict) -> None:
        """Keep Δ = trained − incoming at the site, and the values of the strategy's update extras (the tensors of
        `update` beside the model's); send only two signed public keys and the sample count."""
        layout, delta = _model_delta(model, incoming)
        extras = {name: np.asarray(value, np.float64).reshape(-1) for name, value in update.items()
                  if name not in delta}
        if job.strategy.name in SUMMING_STRATEGIES:   # the model tensors of a statistics job, the exact/* extras
            check_sums_fit([*delta.values(), *extras.values()], job.privacy.secagg.clip)
        session = SiteSession(task.job_id, task.round, self.config.site,
                              min_cohort=self.config.policy.min_secure_cohort)
        weight = 1 if weighs_sites_equally(job) else result.num_samples
        advert = session.advertise(weight, self.kit.key_pem, self.kit.cert_pem)
        for key in [k for k in self._secure if k[0] == task.job_id]:
            del self._secure[key]  # an older round of this job can never resume
        dp = job.privacy.dp   # distributed: this site's noise share was drawn for sites.min survivors (_clip_and_noise)
        floor = job.sites.min if dp is not None and dp.mode == "distributed" else 0
        self._secure[(task.job_id, task.round)] = Pending(
            session, layout, delta | extras, extras=Layout.of({k: update[k] for k in extras}), floor=floor)
        stub.SecAgg(fpb.SecAggMessage(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                      advert=advert_to_proto(advert), metrics=result.metrics,
                                      eval_metrics=eval_metrics), timeout=30)
        log.info("job %s round %d: trained on %d samples; advertised secure-aggregation keys", task.job_id,
                 task.round, result.num_samples)

    def _keep(self, stub, task, incoming: dict, model, result, eval_metrics: dict) -> None:
        """Asynchronous secure aggregation: keep Δ = trained − incoming here until a cohort masks it; the
        coordinator is only told that training is done."""
        layout, delta = _model_delta(model, incoming)
        for key in [k for k in self._kept if k[0] == task.job_id]:
            del self._kept[key]   # one kept update per job: the newest replaces an unused older one
        self._kept[(task.job_id, task.model_round)] = _Kept(layout, delta, result.num_samples, dict(result.metrics),
                                                            dict(eval_metrics))
        self.report(stub, task, fpb.RESULT_TRAINED, "")
        log.info("job %s: trained on %d samples from version %d; the update is kept here for a secure cohort",
                 task.job_id, result.num_samples, task.model_round)

    def _advertise_kept(self, stub, task, job: RoundConfig) -> None:
        """A cohort's advert for the update kept from version model_round: this site computes its own
        τ = version − model_round and signs the weight s(τ)·n, which its masked input is then multiplied by."""
        key = (task.job_id, task.model_round)
        kept = self._kept.get(key)
        if kept is None:
            raise FailedPrecondition(f"no update trained from version {task.model_round} of job {task.job_id} is "
                                     "kept at this site (the agent restarted, or trained again since); it drops out "
                                     f"of cohort {task.round}")
        spec = job.asynchronous
        tau = task.secagg.version - task.model_round
        if not 0 <= tau <= spec.max_staleness:
            raise IntegrityError(f"cohort {task.round} is at version {task.secagg.version}, so the update kept from "
                                 f"version {task.model_round} would be {tau} versions old; a site weighs its update "
                                 f"only for 0 <= τ <= asynchronous.max_staleness ({spec.max_staleness})")
        weight = staleness.fixed_weight(spec.staleness, tau, kept.num_samples)
        session = SiteSession(task.job_id, task.round, self.config.site,
                              min_cohort=self.config.policy.min_secure_cohort, max_weight=staleness.MAX_FIXED_WEIGHT)
        advert = session.advertise(weight, self.kit.key_pem, self.kit.cert_pem)
        for old in [k for k in self._secure if k[0] == task.job_id]:
            del self._secure[old]  # an older cohort of this job can never resume
        dp = job.privacy.dp
        self._secure[(task.job_id, task.round)] = Pending(session, kept.layout, kept.delta,
                                                           noise=dp is not None and dp.mode == "distributed")
        stub.SecAgg(fpb.SecAggMessage(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                      advert=advert_to_proto(advert), metrics=kept.metrics,
                                      eval_metrics=kept.eval_metrics), timeout=30)
        del self._kept[key]
        log.info("job %s cohort %d: advertised the update kept from version %d (τ %d, weight %d / 2**16)",
                 task.job_id, task.round, task.model_round, tau, weight)

    def _secagg_phase(self, stub, task, job: RoundConfig) -> None:
        if task.kind == fpb.TASK_SECAGG_ADVERTISE:   # an asynchronous cohort's (a synchronous one's trains)
            return self._advertise_kept(stub, task, job)
        pending = self._secure.get((task.job_id, task.round))
        if pending is None:
            raise FailedPrecondition(f"no secure-aggregation state for job {task.job_id} round {task.round} "
                                     "(this agent restarted mid-round); it drops out of this round")
        if secagg_phase(stub, task, job, pending, ca_pem=self.kit.ca_pem,
                        submit_masked=lambda layout, masked: self._submit_masked(stub, task, layout, masked)):
            del self._secure[(task.job_id, task.round)]

    def _submit_masked(self, stub, task, layout: Layout, masked) -> None:
        """Stream the masked input; `layout` is its manifest (plexus.secagg.plan), one unsigned width throughout."""
        digest = hashlib.sha256()
        stub.SubmitUpdate(masked_input_messages(task, layout, masked, chunk_size(layout.total_bytes, self.chunk_bytes),
                                                digest), timeout=call_timeout(task))
        self._audit_sent(task, "masked:" + digest.hexdigest(), 0)
        log.info("job %s round %d: sent the masked update", task.job_id, task.round)

    @staticmethod
    def to_report(job: RoundConfig, eval_metrics: dict[str, float],
                  result: TrainResult | None = None) -> tuple[dict[str, float], TrainResult | None]:
        """What this site tells the coordinator about itself. Under privacy.dp: nothing, whatever it is asked.

        Its losses, evaluation metrics and row count describe its data outside the accounted ε,
        so they stay here; the update carries num_samples 1 (DP-FedAvg weighs sites equally).
        """
        if job.privacy.dp is None:
            return eval_metrics, result
        return {}, None if result is None else replace(result, num_samples=1, metrics={})

    def local_update(self, job: RoundConfig, model, served: dict, data: Split, task) -> LocalResult:
        """This round's local work for the job's strategy; benchmarks override it with a trivial step."""
        return local_update(job, model, served, data, site=self.config.site, job_id=task.job_id, seed=task.seed,
                            local_steps=task.local_steps, state_dir=self.config.state_dir, round_=task.round,
                            min_cell_count=self.config.policy.min_cell_count)

    def evaluate(self, model, data: Split) -> dict[str, float]:
        """Metrics of `model` on this site's held-out rows."""
        return evaluate(model, data.x_test, data.y_test)

    @staticmethod
    def _train_dp_sgd(model, data: Split, job: RoundConfig, task, state: JobState) -> TrainResult:
        """DP-SGD via Opacus; this site's privacy ledger for the job persists across rounds and restarts. The
        round's spend is recorded before it trains (its steps are fixed by the data's size and the job), so a
        round that crashes mid-way counts too, and the ledger covers every round the site started."""
        dp_sgd = job.privacy.dp_sgd
        before = state.ledger()
        rate, steps = dp_sgd_schedule(len(data.y_train), job.train.batch_size, job.train.epochs)
        spent = PrivacyLedger(before.history)
        spent.step(dp_sgd.noise_multiplier, rate, steps=steps)
        state.keep_ledger(spent)
        result = train_local_dp_sgd(model, data.x_train, data.y_train, job.train, dp_sgd, seed=task.seed,
                                    ledger=before)   # stepped by the training as it goes: it ends equal to spent
        if before.history != spent.history:
            raise RuntimeError(f"DP-SGD took {before.history} where {spent.history} was recorded before it trained")
        return result

    @staticmethod
    def _clip_and_noise(model, incoming: dict, job: RoundConfig, task) -> dict[str, np.ndarray]:
        """DP-FedAvg at the site: clip Δ to clip_norm; in distributed mode also add this site's share of noise.
        The model then holds incoming + Δ; returns that Δ (float64)."""
        dp = job.privacy.dp
        trained = state_to_numpy(model)
        delta, _ = clip_update({k: trained[k].astype(np.float64) - incoming[k] for k in trained}, dp.clip_norm)
        # Unpredictable to the coordinator, by design: not seeded from the job. An asynchronous cohort's share
        # is added at masking instead, once the cohort's size is known (_cohort_noise).
        if dp.mode == "distributed" and job.asynchronous is None:
            std = distributed_std(dp.noise_multiplier, dp.clip_norm, job.sites.min)
            delta = add_noise(delta, std, noise_key(None, task.job_id, task.round, "site"))
        load_numpy_state(model, {k: (incoming[k] + delta[k]).astype(trained[k].dtype) for k in trained})
        return delta

    def advertised_rows(self) -> dict[str, int]:
        """Training rows per dataset that loads (sent at Join, for steps proportional to site size).

        CSV and npz files are read here without a job's schema or target (the job's own check comes with its
        first task).
        """
        rows = {}
        for name, spec in sorted(self.config.datasets.items()):
            try:
                rows[name] = train_rows(spec)
            except (ValueError, OSError) as exc:   # reported again, with the job, when a task needs it
                log.warning("dataset %r cannot be loaded, so it is not advertised: %s", name, exc)
        return rows

    def load_data(self, data: DataSpec) -> Split:
        """The job's view of a configured dataset (its data section: name and, for CSV, schema), loaded once."""
        if data not in self._data:
            self._data[data] = load_for_job(self.config.datasets[data.dataset], data)
        return self._data[data]

    def job_data(self, job: RoundConfig):
        """What the job's local work reads: its training Split (load_data), or for a statistics job the dataset's
        raw table (read once), its columns checked against the job's. DataError when the data cannot serve it."""
        if not reads_raw_table(job):
            return self.load_data(job.data)
        spec = self.config.datasets[job.data.dataset]
        if spec not in self._tables:
            self._tables[spec] = raw_table(spec, job.data.dataset)
        check_statistics_columns(job, spec, self._tables[spec])
        return self._tables[spec]

    def _fetch(self, stub, task: fpb.Task, expected: Layout, job: RoundConfig) -> dict:
        """The served model (layout `expected`), decoded as the job's compression.downlink says."""
        spec = downlink_spec(job)
        if spec.codec == "none":
            stream = stub.FetchModel(fpb.FetchModelRequest(task_id=task.task_id), timeout=call_timeout(task))
            layout = Layout.from_proto(model_header(stream).manifest)
            expected.require_same(layout, what="the coordinator's model")
            return decode(layout, assemble(layout, (message.chunk for message in stream)))
        chain = ServedChain(self.config.state_dir, task.job_id) if is_delta(spec.codec) else None
        return fetch_model(stub, task.task_id, expected, spec, chain, timeout=call_timeout(task))

    def _submit(self, stub, task, update: dict, result, eval_metrics: dict) -> bool:
        """Stream the update straight from its tensors (no model-sized buffer); True once accepted."""
        layout, chunks = encode_chunks(update, chunk_size(Layout.of(update).total_bytes, self.chunk_bytes))
        header = fpb.UpdateHeader(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                  num_samples=result.num_samples, metrics=result.metrics,
                                  eval_metrics=eval_metrics, manifest=layout.to_proto())
        sha = hashlib.sha256()

        def messages():
            yield fpb.UpdateMessage(header=header)
            for offset, data in chunks:
                sha.update(data)
                yield fpb.UpdateMessage(chunk={"offset": offset, "data": data})

        try:
            reply = stub.SubmitUpdate(messages(), timeout=call_timeout(task))
        except grpc.RpcError as exc:
            if exc.code() in _RETRY:
                raise
            log.warning("job %s round %d: update refused: %s", task.job_id, task.round, exc.details())
            return False
        digest = sha.hexdigest()
        self._audit_sent(task, digest, result.num_samples)
        log.info("job %s round %d: sent update sha256=%s (%d samples, train_loss %.4f): %s", task.job_id,
                 task.round, digest[:16], result.num_samples,
                 result.metrics.get("train_loss", float("nan")), reply.message)
        return True

    def report(self, stub, task, status, reason: str, eval_metrics: dict | None = None) -> None:
        """Tell the coordinator how a task ended that sends no update (declined, failed, evaluated)."""
        try:
            stub.ReportResult(fpb.TaskResult(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                             nonce=task.nonce, status=status, reason=reason,
                                             eval_metrics=eval_metrics or {}), timeout=30)
        except grpc.RpcError as exc:
            if exc.code() in _RETRY:
                raise
            log.warning("job %s round %d: result refused: %s", task.job_id, task.round, exc.details())


@dataclass
class _Kept:
    """An asynchronous secure job's trained update, kept at the site until its cohort's advert."""

    layout: Layout
    delta: dict[str, np.ndarray]   # Δ per model tensor
    num_samples: int       # n (1 under DP)
    metrics: dict[str, float]
    eval_metrics: dict[str, float]


@functools.lru_cache(maxsize=8)
def round_config(text: str, job_id: str) -> RoundConfig:
    """A task's round config, parsed once per job (every task of a job carries the same text; RoundConfig is
    immutable)."""
    return parse_round_config(text, source=f"job {job_id}")


def failure_reason(exc: BaseException) -> str:
    """What the coordinator is told of a task that failed here. A full or failing disk under the state dir is
    said as such, without the local path (the site's log has it)."""
    if storage_failure(exc):
        return (f"this site cannot write its state_dir ({storage_text(exc)}); its tasks fail until its operator "
                "frees space there (its log names the file)")
    return f"{type(exc).__name__}: {exc}"


def kind_refusal(job: RoundConfig, kind: int) -> str:
    """Why this site does not run a task of `kind` for `job` ('' if it does). The coordinator picks the kind; one the
    job does not have would skip what the job's settings promise the site: a plain training task in a synchronous
    secure-aggregation job would send its update unmasked, and a kind this agent does not know would train without
    counting towards policy.max_rounds or the DP ledger."""
    if kind not in KNOWN_KINDS:
        return (f"task kind {kind} is not one this site agent runs; if the coordinator is newer, upgrade the site "
                "agent")
    name = fpb.TaskKind.Name(kind)
    if (kind in SPLIT_KINDS) != (job.mode == "split"):
        return f"a {name} task does not belong to a {job.mode} job"
    secure = job.privacy.secure_aggregation
    if kind == fpb.TASK_TRAIN and secure and not in_cohorts(job):
        return ("this job's updates are masked (secure aggregation), so its training starts with an advert; a plain "
                "TASK_TRAIN would send this site's update in the clear")
    if (kind == fpb.TASK_SECAGG_ADVERTISE or kind in SECAGG_LATER_PHASES) and not secure:
        return f"a {name} task does not belong to a job without secure aggregation"
    return ""


def in_cohorts(job: RoundConfig) -> bool:
    """An asynchronous job under secure aggregation: its updates are masked in cohorts, after training."""
    return job.asynchronous is not None and job.privacy.secure_aggregation


def _model_delta(model, incoming: dict) -> tuple[Layout, dict[str, np.ndarray]]:
    """The model's layout and Δ = trained − incoming per tensor (float64, flat): what a secure round masks."""
    trained = state_to_numpy(model)
    layout = Layout.of(trained)
    return layout, {t.name: (trained[t.name].astype(np.float64) - incoming[t.name]).reshape(-1)
                    for t in layout.tensors}


def call_timeout(task: fpb.Task) -> float:
    """Seconds a call serving `task` may take: until the task's deadline plus 5 s, at least 5 s and at most
    transport.MAX_CALL_S + 5, whatever deadline the coordinator sent."""
    return max(5.0, transport.seconds_left(task.deadline_unix_s) + 5.0)
