"""The relay as one site of its parent: it joins with its children's rows, takes the parent's tasks, hands each
to its tier (the Mailbox) with the model the parent served, and answers with what the tier made of it."""

from __future__ import annotations

import json
import logging
import random
import threading
import time

import grpc

from coordinator.aggregate import MAX_WEIGHT, exact_layout
from coordinator.engine import Engine
from coordinator.store import SiteRow, Store, rows_by_dataset
from plexus import __version__, transport
from plexus.config import RelayConfig, parse_round_config
from plexus.errors import ConfigError, IntegrityError
from plexus.identity import Kit, identity_from_cert
from plexus.memory import default_model_cap
from plexus.proto.plexus.v1 import federation_pb2 as fpb, federation_pb2_grpc
from plexus.secagg import SiteSession, advert_to_proto
from plexus.vocab import TaskKind
from plexus.wire import Layout, assemble, iter_chunks
from relay.driver import Answer, Mailbox, Offer, relay_problem
from site_agent.downlink import model_header
from site_agent.secure import Pending, check_sums_fit, masked_input_messages, secagg_phase

log = logging.getLogger("plexus.relay")

CHUNK_BYTES = 1 << 20
_LATER_PHASES = (fpb.TASK_SECAGG_SHARE, fpb.TASK_SECAGG_MASKED_INPUT, fpb.TASK_SECAGG_UNMASK)
BACKOFF_START_S, BACKOFF_CAP_S = 1.0, 30.0
_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.CANCELLED)


def join_request(sites: list[SiteRow]) -> fpb.JoinRequest:
    """The relay at its parent, from its children as they joined it: the models they have in common, their
    datasets with their rows summed, and who they are (below a child that is a relay, its own as
    "child/grandchild")."""
    models = set.intersection(*(set(json.loads(r.models)) for r in sites)) if sites else set()
    children = []
    for row in sites:
        children += [row.name] + [f"{row.name}/{child}" for child in json.loads(row.children or "[]")]
    # The tier refuses a child past this (Engine.tier_rows_cap); rows recorded before it did must not keep the
    # parent refusing the whole relay.
    rows = {dataset: min(n, MAX_WEIGHT) for dataset, n in rows_by_dataset(sites).items()}
    return fpb.JoinRequest(agent_version=__version__, models=sorted(models), datasets=sorted(rows),
                           dataset_rows=rows, children=children)


class Upstream:
    """Talks to the parent for the relay; `run` until `stop` is set."""

    def __init__(self, config: RelayConfig, kit: Kit, engine: Engine, store: Store, mailbox: Mailbox):
        self.config, self.kit, self.engine, self.store, self.mailbox = config, kit, engine, store, mailbox
        self.name = identity_from_cert(kit.cert_pem).name
        self.stop = threading.Event()
        self._secure: dict[tuple[str, int], Pending] = {}   # a secure round between its phases at the parent
        self._channel: grpc.Channel | None = None
        self._joined: fpb.JoinRequest | None = None
        self._rng = random.Random()

    def run(self) -> None:
        delay = BACKOFF_START_S
        while not self.stop.is_set():
            if len(self.store.sites()) < self.config.tier.sites_min:   # nothing to stand for yet
                self.stop.wait(0.5)
                continue
            try:
                with transport.channel(self.kit, self.config.parent) as channel:
                    self._channel = channel
                    stub = federation_pb2_grpc.FederationStub(channel)
                    reply = self._join(stub)
                    log.info("relay joined federation %r as %r (parent %s)", reply.federation, reply.site,
                             self.config.parent)
                    delay = BACKOFF_START_S
                    self._serve(stub, reply.poll_timeout_s or 20.0)
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    break
                log.log(logging.INFO if exc.code() in _RETRY else logging.ERROR, "parent %s: %s: %s; retrying in "
                        "%.1fs", self.config.parent, exc.code().name, exc.details(), delay)
            except Exception:   # never a silent end: the relay would serve its children and never its parent again
                if self.stop.is_set():
                    break
                log.exception("parent %s: the relay's connection failed; retrying in %.1fs", self.config.parent,
                              delay)
            finally:
                self._channel = None
            self.stop.wait(delay * (1 + 0.2 * self._rng.random()))
            delay = min(delay * 2, BACKOFF_CAP_S)

    def shutdown(self) -> None:
        self.stop.set()
        if self._channel is not None:
            self._channel.close()

    def _join(self, stub) -> fpb.JoinReply:
        self._joined = join_request(self.store.sites())
        return stub.Join(self._joined, timeout=10)

    def _serve(self, stub, poll_s: float) -> None:
        while not self.stop.is_set():
            if join_request(self.store.sites()) != self._joined:   # children come and go: the parent's view follows
                self._join(stub)
            task = stub.NextTask(fpb.NextTaskRequest(wait_s=min(poll_s, 5.0)), timeout=min(poll_s, 5.0) + 15)
            if task.kind == fpb.TASK_NONE:
                continue
            try:
                self.handle(stub, task)
            except grpc.RpcError:
                raise
            except Exception as exc:   # whatever the parent sent, reported, and the relay goes on
                log.exception("task %s from the parent failed", task.task_id)
                self._report(stub, task, fpb.RESULT_FAILED, f"the relay failed: {type(exc).__name__}: {exc}")

    def handle(self, stub, task: fpb.Task) -> None:
        try:
            cfg = parse_round_config(task.config_yaml, source=f"job {task.job_id}")
        except ConfigError as exc:
            return self._report(stub, task, fpb.RESULT_FAILED, f"the relay cannot read the job's round config: {exc}")
        if cfg.mode == "split":
            return self._report(stub, task, fpb.RESULT_DECLINED, "a relay cannot run a split-learning job: each site's "
                                "session talks to the server part itself; connect these sites directly for this job")
        if task.kind in _LATER_PHASES:
            return self._secure_phase(stub, task, cfg)
        if task.kind not in (fpb.TASK_TRAIN, fpb.TASK_EVALUATE, fpb.TASK_SECAGG_ADVERTISE):
            return self._report(stub, task, fpb.RESULT_DECLINED, "a relay cannot answer this task; connect these "
                                "sites directly for this job")
        if problem := relay_problem(cfg):
            return self._report(stub, task, fpb.RESULT_DECLINED, f"a relay cannot run this job: {problem}")
        self.engine.retire(task.job_id, f"the parent moved on to job {task.job_id}")
        if not any(row.id == task.job_id for row in self.store.jobs()):
            self.store.add_job(task.job_id, cfg.name, task.config_yaml, cfg.strategy.name, cfg.rounds,
                               f"parent {self.config.parent}")
        left = transport.seconds_left(task.deadline_unix_s) - self.config.tier.upload_margin_s
        try:
            layout, blob = self._fetch(stub, task)
        except (IntegrityError, ValueError) as exc:
            return self._report(stub, task, fpb.RESULT_FAILED, f"the parent's model is unusable: {exc}")
        kind = TaskKind.EVALUATE if task.kind == fpb.TASK_EVALUATE else TaskKind.TRAIN   # advertise: train first
        self.mailbox.post(task.job_id, Offer(task.task_id, kind, task.round, task.model_round,
                                             time.monotonic() + left, layout, blob))
        self.engine.nudge()
        answer = self.mailbox.wait_answer(task.task_id, max(left, 0.0) + 5.0)
        if answer is None:
            return self._report(stub, task, fpb.RESULT_FAILED, "the relay's round did not end before the parent's "
                                "deadline")
        if answer.status == "sum":
            return self._submit(stub, task, answer)
        if answer.status == "delta":
            return self._advertise(stub, task, cfg, answer)
        if answer.status == "evaluated":
            return self._report(stub, task, fpb.RESULT_EVALUATED, "", answer.eval_metrics)
        return self._report(stub, task, fpb.RESULT_FAILED, answer.reason)

    def _advertise(self, stub, task: fpb.Task, cfg, answer: Answer) -> None:
        """Secure aggregation at the parent's tier: the relay keeps its tier's mean Δ and advertises keys for it,
        signed with its own certificate, weighing it by its survivors' samples; the later phases mask it."""
        try:
            check_sums_fit(list(answer.delta.values()), cfg.privacy.secagg.clip)
        except ValueError as exc:
            return self._report(stub, task, fpb.RESULT_FAILED, str(exc))
        session = SiteSession(task.job_id, task.round, self.name)
        advert = session.advertise(answer.weight, self.kit.key_pem, self.kit.cert_pem)
        self._secure = {(task.job_id, task.round): Pending(session, answer.layout, answer.delta)}
        stub.SecAgg(fpb.SecAggMessage(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                      advert=advert_to_proto(advert), metrics=answer.metrics,
                                      eval_metrics=answer.eval_metrics), timeout=30)
        log.info("job %s round %d: the tier's mean of %d update(s) (weight %d) kept; keys advertised", task.job_id,
                 task.round, answer.updates, answer.weight)

    def _secure_phase(self, stub, task: fpb.Task, cfg) -> None:
        pending = self._secure.get((task.job_id, task.round))
        if pending is None:
            return self._report(stub, task, fpb.RESULT_FAILED, f"no secure-aggregation state for round {task.round} "
                                "at the relay (it restarted mid-round); it drops out of this round")
        try:
            done = secagg_phase(stub, task, cfg, pending, ca_pem=self.kit.ca_pem,
                                submit_masked=lambda layout, masked: self._submit_masked(stub, task, layout, masked))
        except (IntegrityError, ValueError) as exc:
            return self._report(stub, task, fpb.RESULT_FAILED, f"secure aggregation at the relay: {exc}")
        if done:
            self._secure.pop((task.job_id, task.round), None)

    def _submit_masked(self, stub, task: fpb.Task, layout: Layout, masked) -> None:
        stub.SubmitUpdate(masked_input_messages(task, layout, masked, CHUNK_BYTES), timeout=_timeout(task))

    def _fetch(self, stub, task: fpb.Task) -> tuple[Layout, bytes]:
        stream = stub.FetchModel(fpb.FetchModelRequest(task_id=task.task_id), timeout=_timeout(task))
        layout = Layout.from_proto(model_header(stream).manifest)
        limit = self.config.tier.max_model_bytes or default_model_cap()
        if layout.total_bytes > limit:   # before a byte of it is allocated
            stream.cancel()
            what = ("this relay's tier.max_model_bytes" if self.config.tier.max_model_bytes else
                    "a quarter of this relay's machine's memory, the default of its tier.max_model_bytes")
            raise IntegrityError(f"it holds {layout.total_bytes:,} bytes, over {what} ({limit:,} bytes)")
        return layout, bytes(assemble(layout, (message.chunk for message in stream)))

    def _submit(self, stub, task: fpb.Task, answer: Answer) -> None:
        layout = exact_layout(answer.layout)
        header = fpb.UpdateHeader(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                  num_samples=answer.weight, metrics=answer.metrics, eval_metrics=answer.eval_metrics,
                                  manifest=layout.to_proto(),
                                  partial=fpb.PartialSum(updates=answer.updates, contributors=answer.contributors))

        def messages():
            yield fpb.UpdateMessage(header=header)
            for offset, piece in iter_chunks(answer.exact.view("u1"), CHUNK_BYTES):
                yield fpb.UpdateMessage(chunk={"offset": offset, "data": bytes(piece)})

        try:
            reply = stub.SubmitUpdate(messages(), timeout=_timeout(task))
            log.info("job %s round %d: the tier's sum (%d updates, weight %d): %s", task.job_id, task.round,
                     answer.updates, answer.weight, reply.message)
        except grpc.RpcError as exc:
            if exc.code() in _RETRY:
                raise
            log.warning("job %s round %d: the parent refused the tier's sum: %s", task.job_id, task.round,
                        exc.details())

    def _report(self, stub, task: fpb.Task, status, reason: str, eval_metrics: dict | None = None) -> None:
        try:
            stub.ReportResult(fpb.TaskResult(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                             nonce=task.nonce, status=status, reason=reason[:2000],
                                             eval_metrics=eval_metrics or {}), timeout=30)
        except grpc.RpcError as exc:
            if exc.code() in _RETRY:
                raise
            log.warning("job %s round %d: the parent refused the relay's result: %s", task.job_id, task.round,
                        exc.details())


def _timeout(task: fpb.Task) -> float:
    return max(30.0, transport.seconds_left(task.deadline_unix_s) + 30.0)
