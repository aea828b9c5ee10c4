"""Thin gRPC servicers: parse the request, call the engine, build the reply."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

from cryptography import x509

from coordinator.aggregate import MAX_WEIGHT
from coordinator.engine import Engine
from coordinator.events import admin_actor
from coordinator.served import Held, ServedModel
from coordinator.store import EventRow, JobRow, SiteRow
from coordinator.tasks import Binding, JoinInfo, Partial, SecaggAnswer, TaskGrant, TaskResult, UpdateHeader
from plexus.config import MAX_SITES
from plexus.errors import FailedPrecondition, IntegrityError, Reason, TimedOut
from plexus.proto.plexus.v1 import admin_pb2, admin_pb2_grpc, federation_pb2 as fpb, federation_pb2_grpc
from plexus.rpc import Authenticator, SendWatchdog, caller_certificate, guarded
from plexus.secagg import advert_from_proto, advert_to_proto
from plexus.vocab import TERMINAL, TaskKind, TaskStatus
from plexus.wire import Layout

_KINDS = {TaskKind.TRAIN: fpb.TASK_TRAIN, TaskKind.EVALUATE: fpb.TASK_EVALUATE,
          TaskKind.SECAGG_ADVERTISE: fpb.TASK_SECAGG_ADVERTISE, TaskKind.SECAGG_SHARE: fpb.TASK_SECAGG_SHARE,
          TaskKind.SECAGG_MASK: fpb.TASK_SECAGG_MASKED_INPUT, TaskKind.SECAGG_UNMASK: fpb.TASK_SECAGG_UNMASK,
          TaskKind.SPLIT_TRAIN: fpb.TASK_SPLIT_TRAIN, TaskKind.SPLIT_EVALUATE: fpb.TASK_SPLIT_EVALUATE}
MAX_SHARE_VALUE_BYTES = 80   # a share value mod 2**521 - 1 fits in 66 bytes
MAX_JOIN_NAMES = 256         # models, datasets (and their row counts) one site may advertise
MAX_JOIN_NAME_CHARS = 64     # a model or dataset name, and the agent version
# A relay's children at its Join, and the contributors of its partial sum: as many as a federation has sites,
# each a path of site names ("child/grandchild/...") through at most 8 tiers.
MAX_CHILDREN = MAX_SITES
MAX_CHILD_PATH_CHARS = 8 * 64
_RESULTS = {fpb.RESULT_EVALUATED: TaskStatus.EVALUATED, fpb.RESULT_DECLINED: TaskStatus.DECLINED,
            fpb.RESULT_FAILED: TaskStatus.FAILED, fpb.RESULT_TRAINED: TaskStatus.TRAINED}


_ENCODINGS = {"dense": fpb.MODEL_DENSE, "fp16": fpb.MODEL_FP16, "delta8": fpb.MODEL_DELTA8,
              "delta4": fpb.MODEL_DELTA4}


def model_stream(job_id: str, round_: int, served: ServedModel, chunk_bytes: int):
    """Header, then chunks of the one shared model, at most chunk_bytes each (ServedModel.chunks)."""
    yield fpb.ModelMessage(header=fpb.ModelHeader(job_id=job_id, round=round_, manifest=served.layout.to_proto(),
                                                  encoding=_ENCODINGS[served.encoding], base_round=served.base_round,
                                                  sha256=served.sha256, zero_base=served.zero_base))
    for offset, data in served.chunks(chunk_bytes):
        yield fpb.ModelMessage(chunk={"offset": offset, "data": data})


class TransferSlots:
    """At most `limit` model downloads and update uploads at once, whatever the number of sites, and at most
    one per holder (a site fetches, trains, then submits: it never needs two): each holds a few chunks of
    buffers, so this is what keeps the coordinator's memory flat in N, and one site cannot take every slot.
    A call waiting for a slot holds no data; it gives up when its caller does."""

    def __init__(self, limit: int):
        self._limit = limit
        self._holders: list[str | None] = []
        self._cv = threading.Condition()

    @contextmanager
    def slot(self, context, holder: str | None = None):
        with self._cv:
            while len(self._holders) >= self._limit or (holder is not None and holder in self._holders):
                self._cv.wait(0.5)
                if not context.is_active():
                    raise FailedPrecondition("the call ended while it waited for a transfer slot")
            self._holders.append(holder)
        try:
            yield
        finally:
            with self._cv:
                self._holders.remove(holder)
                self._cv.notify_all()


class Inbound:
    """A client stream read one message at a time, each within `idle_s`, and cut short on demand (when its
    round closes). gRPC's request iterator has no timeout, so a helper thread waits in it and keeps at most
    one message ready: the reader takes it without waiting for the helper to be woken (one hand-over per
    message, not two), and a stream not being read holds one message beyond its flow-control window. The
    helper ends with the call, which ends as soon as the method returns. A stream already in memory (a Sequence:
    a call made in process, as `plexus simulate` makes them) cannot stall, and is read without a helper."""

    def __init__(self, messages, *, idle_s: float, what: str, setting: str = "the coordinator's stream_idle_timeout_s"):
        self._messages, self.idle_s, self.what, self.setting = messages, idle_s, what, setting
        self._cv = threading.Condition()
        self._closed = False
        self._item: tuple | None = None    # (message, None), (None, None) at the end, or (None, the error)
        self._cut: BaseException | None = None
        self.held = messages if isinstance(messages, Sequence) else None   # the whole stream, if in memory
        self._in_memory = iter(messages) if self.held is not None else None
        if self._in_memory is None:
            threading.Thread(target=self._pump, name="plexus-inbound", daemon=True).start()

    def __iter__(self):
        while (message := self.next()) is not None:
            yield message

    def next(self):
        """The next message; None at the end of the stream; TimedOut if none arrives within idle_s."""
        if self._in_memory is not None:
            if self._cut is not None:
                raise self._cut
            return next(self._in_memory, None)
        with self._cv:
            end = time.monotonic() + self.idle_s
            while self._item is None and self._cut is None:
                if (remaining := end - time.monotonic()) <= 0:
                    raise TimedOut(f"the next message of {self.what} did not arrive within {self.idle_s:g} s "
                                   f"({self.setting}), so the stream was dropped; a sender this slow needs a "
                                   "faster link or a less loaded machine")
                self._cv.wait(remaining)
            if self._cut is not None:
                raise self._cut
            (message, error), self._item = self._item, None
            self._cv.notify_all()   # the helper may read the next one
        if error is not None:
            raise error
        return message

    def cut(self, exc: BaseException) -> None:
        """End the stream now: the reader's next() raises exc (from any thread)."""
        with self._cv:
            self._cut = exc
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _pump(self) -> None:
        while True:
            try:
                item = (next(self._messages), None)
            except StopIteration:
                item = (None, None)
            except Exception as exc:   # grpc.RpcError: the caller went away; the reader sees it as before
                item = (None, exc)
            with self._cv:
                while self._item is not None and not self._closed:   # one message ready at most
                    self._cv.wait()
                if self._closed:
                    return
                self._item = item
                self._cv.notify_all()
            if item[0] is None:
                return


class FederationService(federation_pb2_grpc.FederationServicer):
    def __init__(self, engine: Engine, auth: Authenticator, *, chunk_bytes: int, max_transfers: int, audit=None,
                 idle_s: float = 30.0, watchdog: SendWatchdog | None = None):
        self.engine, self.auth, self.chunk_bytes, self.audit = engine, auth, chunk_bytes, audit
        self.transfers = TransferSlots(max_transfers)
        self.idle_s = idle_s
        self.watchdog = watchdog or SendWatchdog(idle_s)

    @guarded(kind=("site", "relay"))
    def Join(self, request, context, *, who):
        check_join(request)
        self.engine.join(who.name, join_info(request, serial=who.serial, relay=who.kind == "relay"))
        if self.audit is not None:
            self.audit.site_joined(who.name, policy_digest=request.policy_digest,
                                   agent_version=request.agent_version, serial=who.serial)
        return fpb.JoinReply(federation=self.engine.federation, site=who.name,
                             poll_timeout_s=self.engine.poll_timeout_s)

    @guarded(kind=("site", "relay"))
    def NextTask(self, request, context, *, who):
        grant = self.engine.next_task(who.name, request.wait_s, valid=lambda: self.auth.still_valid(who))
        if grant is None:
            return fpb.Task(kind=fpb.TASK_NONE)
        return task_message(grant)

    @guarded(kind=("site", "relay"))
    def FetchModel(self, request, context, *, who):
        served, job_id, model_round = self.engine.model_for(who.name, request.task_id, held_model(request),
                                                            zero_base=request.zero_base)
        stream = _while_valid(model_stream(job_id, model_round, served, self.chunk_bytes),
                              lambda: self.auth.still_valid(who))
        with self.transfers.slot(context, who.name):
            yield from self.watchdog.paced(stream, context)

    @guarded(kind=("site", "relay"))
    def SubmitUpdate(self, request_iterator, context, *, who):
        inbound = Inbound(request_iterator, idle_s=self.idle_s, what="the update")
        try:
            first = inbound.next()
            if first is None or first.WhichOneof("body") != "header":
                raise IntegrityError("an update stream must start with its header")
            held = inbound.held   # a stream in memory (plexus simulate's calls): its chunks are its journal
            with self.transfers.slot(context, who.name):
                message = self.engine.submit_update(who.name, update_header(first.header, relay=who.kind == "relay"),
                                                    _chunks(inbound, lambda: self.auth.still_valid(who)),
                                                    cut=inbound.cut, replay=None if held is None else
                                                    lambda: (m.chunk.data for m in itertools.islice(held, 1, None)))
        finally:
            inbound.close()
        return fpb.SubmitReply(accepted=True, message=message)

    @guarded(kind="site")
    def Split(self, request_iterator, context, *, who):
        """A split task's session: SplitOpen first, then batches (and u-shaped gradients) in lock-step, each
        answered before the next is read, each within split.batch_timeout_s; SplitDone last."""
        inbound = Inbound(request_iterator, idle_s=self.idle_s, what="the Split session")
        session = None
        try:
            first = inbound.next()
            if first is None or first.WhichOneof("body") != "open":
                raise IntegrityError("a Split session must start with SplitOpen")
            session = self.engine.split_session(who.name, _binding(first.open), first.open.batches, inbound.cut)
            inbound.idle_s, inbound.setting = session.timeout_s, "the job's split.batch_timeout_s"
            yield fpb.SplitReply(message=f"session open for {first.open.batches} batch(es)")
            for message in inbound:
                self.auth.still_valid(who)   # revoked mid-session: the session ends with that reason
                yield session.take(message)
                if session.finished:
                    break
            if not session.finished:   # the site closed its stream early: it dropped (recorded failed, not rejected)
                raise FailedPrecondition("the site closed its Split session before its SplitDone")
        except BaseException as exc:
            if session is not None:
                session.ended(exc if isinstance(exc, Exception) else None)
            raise
        finally:
            inbound.close()
            if session is not None:
                self.engine.split_ended(who.name, valid=lambda: self.auth.still_valid(who))

    @guarded(kind=("site", "relay"))
    def SecAgg(self, request, context, *, who):
        answer = secagg_answer(request)
        if answer.body == "advert":   # the certificate its peers check it by is the one this call came with
            check_own_certificate(answer.value.cert_pem, caller_certificate(context), who)
        return fpb.ResultReply(message=self.engine.secagg(who.name, answer))

    @guarded(kind=("site", "relay"))
    def ReportResult(self, request, context, *, who):
        if request.status not in _RESULTS:
            raise IntegrityError("result status must be EVALUATED, DECLINED, FAILED or TRAINED")
        result = TaskResult(task=_binding(request), status=_RESULTS[request.status], reason=request.reason,
                            eval_metrics=dict(request.eval_metrics))
        return fpb.ResultReply(message=self.engine.report(who.name, result))


def check_own_certificate(cert_pem: bytes, caller_pem: bytes, who) -> None:
    """IntegrityError unless `cert_pem` (an advert's) is the caller's own certificate."""
    try:
        same = x509.load_pem_x509_certificate(cert_pem) == x509.load_pem_x509_certificate(caller_pem)
    except ValueError:
        same = False
    if not same:
        raise IntegrityError(f"the advert's certificate is not the one {who.kind} {who.name!r} called with; an advert "
                             "carries its sender's own certificate")


def held_model(request: fpb.FetchModelRequest) -> Held | None:
    """The model the site says it holds (compression.downlink delta8, delta4), or None: send the model in full."""
    if not request.have_sha256:
        return None
    if len(request.have_sha256) != 32:
        raise IntegrityError(f"have_sha256 has {len(request.have_sha256)} bytes; a SHA-256 digest has 32 (leave it "
                             "empty to fetch the model in full)")
    return Held(request.have_round, request.have_sha256)


def check_join(request: fpb.JoinRequest) -> None:
    """Refuse a Join whose names could not be shown or stored sanely (`plexus sites list`, the audit log):
    at most MAX_JOIN_NAMES of them, each 1-64 printable characters, and a hex policy digest."""
    for field_name, names in (("models", request.models), ("datasets", request.datasets),
                              ("dataset_rows", list(request.dataset_rows))):
        if len(names) > MAX_JOIN_NAMES:
            raise IntegrityError(f"Join refused: {len(names)} {field_name}; a site advertises at most "
                                 f"{MAX_JOIN_NAMES}: map fewer datasets or install fewer model plug-ins")
        for name in names:
            _check_join_text(f"{field_name} name", name, allow_empty=False)
    if len(request.children) > MAX_CHILDREN:
        raise IntegrityError(f"Join refused: {len(request.children)} children; a relay stands for at most "
                             f"{MAX_CHILDREN} sites and relays below it")
    for name in request.children:
        _check_join_text("children name", name, allow_empty=False, most=MAX_CHILD_PATH_CHARS)
    for dataset, rows in request.dataset_rows.items():
        if not 0 <= rows <= MAX_WEIGHT:   # a count the engine schedules by (a synchronous split epoch's turns)
            raise IntegrityError(f"Join refused: {rows} training rows of {dataset[:64]!r}; a site reports at most "
                                 f"{MAX_WEIGHT} rows of a dataset (the most an update may weigh)")
    _check_join_text("agent_version", request.agent_version, allow_empty=True)
    digest = request.policy_digest
    if len(digest) > 128 or digest.strip("0123456789abcdef"):
        raise IntegrityError(f"Join refused: policy_digest {digest[:40]!r} is not a lowercase hex digest of at "
                             "most 128 characters; a Plexus site agent sends the SHA-256 of its policy")


def _check_join_text(what: str, text: str, *, allow_empty: bool, most: int = MAX_JOIN_NAME_CHARS) -> None:
    if (not text and not allow_empty) or len(text) > most or not text.isprintable() \
            or text != text.strip():
        shown = repr(text[:40]) + ("…" if len(text) > 40 else "")
        raise IntegrityError(f"Join refused: {what} {shown} ({len(text)} characters) must be 1-{most} "
                             "printable characters without control characters or surrounding spaces; rename it "
                             "in site.yaml (datasets) or in the model plug-in")


def join_info(request: fpb.JoinRequest, *, serial: int, relay: bool = False) -> JoinInfo:
    if request.children and not relay:
        raise IntegrityError("Join refused: only a relay's certificate may name children; a site has none")
    return JoinInfo(agent_version=request.agent_version, models=tuple(request.models),
                    datasets=tuple(request.datasets), policy_digest=request.policy_digest,
                    dataset_rows={k: int(v) for k, v in request.dataset_rows.items()}, serial=serial,
                    relay=relay, children=tuple(request.children))


def task_message(grant: TaskGrant) -> fpb.Task:
    """A grant as NextTask sends it."""
    return fpb.Task(kind=_KINDS[grant.kind], task_id=grant.task_id, job_id=grant.job_id, round=grant.round,
                    model_round=grant.model_round, config_yaml=grant.config_yaml, nonce=grant.nonce,
                    deadline_unix_s=grant.deadline_unix_s, seed=grant.seed,
                    secagg=_payload_proto(grant.payload) if grant.payload is not None else None,
                    local_steps=grant.local_steps)


def secagg_answer(request: fpb.SecAggMessage) -> SecaggAnswer:
    """A SecAgg message as the engine reads it: an advert, the shares by recipient, or the reveals by peer."""
    body = request.WhichOneof("body")
    if body == "advert":
        value = advert_from_proto(request.advert)
    elif body == "shares":
        value = dict(request.shares.ciphertexts)
    elif body == "reveal":
        value = {}
        for r in request.reveal.reveals:
            if r.peer in value or len(r.y) > MAX_SHARE_VALUE_BYTES:
                raise IntegrityError(f"reveal for {r.peer!r} is repeated or oversized")
            value[r.peer] = (r.kind, r.x, int.from_bytes(r.y, "big"))
    else:
        raise IntegrityError("a SecAgg message carries an advert, shares or a reveal")
    return SecaggAnswer(task=_binding(request), body=body, value=value, metrics=dict(request.metrics),
                        eval_metrics=dict(request.eval_metrics))


def update_header(header: fpb.UpdateHeader, *, relay: bool = False) -> UpdateHeader:
    """The header as the engine reads it; a manifest that cannot be read is kept as the error to report,
    so the update is refused (and recorded) with the task it answers. `relay`: the sender's certificate is a
    relay's, the only kind that sends (and must send) its children's partial sum."""
    try:
        layout, problem = Layout.from_proto(header.manifest), None
    except IntegrityError as exc:
        layout, problem = None, exc
    partial = None
    if header.HasField("partial"):
        if not relay:
            raise IntegrityError("only a relay's certificate may send a partial sum; a site sends its own update")
        contributors = tuple(header.partial.contributors)
        if len(contributors) > MAX_CHILDREN or any(len(c) > MAX_CHILD_PATH_CHARS for c in contributors):
            raise IntegrityError(f"a partial sum names at most {MAX_CHILDREN} contributors of at most "
                                 f"{MAX_CHILD_PATH_CHARS} characters each")
        updates = header.partial.updates
        if not len(contributors) <= updates <= min(header.num_samples, MAX_CHILDREN):
            raise IntegrityError(f"a partial sum of {updates} update(s) from {len(contributors)} contributor(s) "
                                 f"weighing {header.num_samples}: it holds at least one update per contributor, and "
                                 f"each weighs at least 1 (at most {MAX_CHILDREN} updates)", reason=Reason.NUM_SAMPLES)
        partial = Partial(updates=updates, contributors=contributors)
    return UpdateHeader(task=_binding(header), num_samples=header.num_samples, layout=layout,
                        metrics=dict(header.metrics), eval_metrics=dict(header.eval_metrics), problem=problem,
                        partial=partial)


def _binding(message) -> Binding:
    return Binding(task_id=message.task_id, job_id=message.job_id, round=message.round, nonce=message.nonce)


def _payload_proto(p: dict) -> fpb.SecAggPayload:
    return fpb.SecAggPayload(adverts=[advert_to_proto(a) for a in p.get("adverts", [])], threshold=p["threshold"],
                             total_weight=p["total_weight"], clip=p["clip"], frac_bits=p["frac_bits"],
                             shares_for_you=p.get("shares_for_you", {}), u2=p.get("u2", []), u3=p.get("u3", []),
                             version=p.get("version", 0))


def _chunks(messages, valid: Callable[[], None]):
    """(offset, data) of each chunk message; anything else in the stream is refused, and so is the rest of it once
    `valid()` raises (the sender's certificate was revoked while it streamed: its update never counts)."""
    for message in messages:
        valid()
        if message.WhichOneof("body") != "chunk":
            raise IntegrityError("an update stream carries one header, then only chunks")
        yield message.chunk.offset, message.chunk.data


def _while_valid(messages, valid: Callable[[], None]):
    """`messages`, each sent only while `valid()` does not raise: a model download whose caller's certificate is
    revoked on the way ends there, with the refusal."""
    try:
        for message in messages:
            valid()
            yield message
    finally:
        messages.close()


def job_summary(row: JobRow) -> admin_pb2.JobSummary:
    return admin_pb2.JobSummary(job_id=row.id, name=row.name, status=row.status, rounds=row.rounds,
                                current_round=row.current_round, message=row.message, submitted_by=row.submitted_by,
                                created_unix_s=row.created, updated_unix_s=row.updated, strategy=row.strategy)


def job_event(event: EventRow, summary: admin_pb2.JobSummary) -> admin_pb2.JobEvent:
    """A recorded event as WatchJob streams it, with the job's summary as of when it is sent."""
    return admin_pb2.JobEvent(unix_s=event.at, kind=event.kind, round=event.round, site=event.site,
                              message=event.message, summary=summary)


def job_detail(store, job_id: str) -> admin_pb2.JobDetail:
    """What `plexus job show`, `metrics` and `plot` read of a job: its rounds (an asynchronous job's versions),
    its tasks' outcomes and every metric it recorded."""
    row = store.job(job_id)
    rounds = [admin_pb2.RoundInfo(round=r, status=f"{status}" if kind == "train" else f"{status} (evaluation)",
                                  opened_unix_s=opened, closed_unix_s=closed or 0.0,
                                  contributors=json.loads(contributors), total_samples=samples, message=message)
              for r, kind, status, opened, closed, contributors, samples, message in store.rounds(row.id)]
    events = [admin_pb2.SiteStatus(site=s, status=st, round=r, reason=reason)
              for s, st, r, reason in store.site_events(row.id)]
    metrics = [admin_pb2.MetricRow(round=r, site=s, kind=k, name=n, value=v) for r, s, k, n, v in store.metrics(row.id)]
    return admin_pb2.JobDetail(summary=job_summary(row), config_yaml=row.config_yaml, rounds=rounds,
                               site_events=events, metrics=metrics)


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, engine: Engine, auth: Authenticator, *, chunk_bytes: int, audit=None,
                 watchdog: SendWatchdog | None = None):
        self.engine, self.auth, self.chunk_bytes = engine, auth, chunk_bytes
        self.store = engine.store
        self.audit = audit  # plexus.audit.AuditLog, or None when the server runs without one
        self.watchdog = watchdog or SendWatchdog(30.0)

    @guarded(kind="admin", min_role="operator")
    def SubmitJob(self, request, context, *, who):
        job_id = self.engine.submit(request.config_yaml, who.name, request.request_id)
        return job_summary(self.store.job(job_id))

    @guarded(kind="admin", min_role="viewer")
    def ListJobs(self, request, context, *, who):
        return admin_pb2.JobList(jobs=[job_summary(r) for r in self.store.jobs()])

    @guarded(kind="admin", min_role="viewer")
    def GetJob(self, request, context, *, who):
        return job_detail(self.store, request.job_id)

    @guarded(kind="admin", min_role="viewer")
    def WatchJob(self, request, context, *, who):
        row = self.store.job(request.job_id)
        last = 0
        while context.is_active():
            for event in self.engine.wait_events(row.id, last, 1.0):
                last = event.id
                self.auth.still_valid(who)   # an admin revoked while it watches sees nothing more
                yield job_event(event, job_summary(self.store.job(row.id)))
            if self.store.job(row.id).status in TERMINAL and not self.store.events_after(row.id, last):
                return

    @guarded(kind="admin", min_role="operator")
    def AbortJob(self, request, context, *, who):
        self.engine.abort(request.job_id, who.name)
        return job_summary(self.store.job(request.job_id))

    @guarded(kind="admin", min_role="operator")
    def ResumeJob(self, request, context, *, who):
        return job_summary(self.engine.resume(request.job_id, who.name))

    @guarded(kind="admin", min_role="operator")
    def DownloadModel(self, request, context, *, who):
        row = self.store.job(request.job_id)
        round_ = row.current_round if request.round < 0 else request.round
        if round_ > row.current_round:
            raise IntegrityError(f"job {row.id} has closed rounds 0..{row.current_round}; round {round_} has no "
                                 "model yet")
        with self.store.reading(row.id, round_):   # checkpoint retention leaves it alone until the stream ends
            layout, path, start = self.store.checkpoint_source(row.id, round_)   # streamed from the file
            self.store.event(row.id, "model_downloaded", round_, "", f"by {who.name}", actor=admin_actor(who.name))
            stream = model_stream(row.id, round_, ServedModel.from_file(layout, path, start), self.chunk_bytes)
            yield from self.watchdog.paced(_while_valid(stream, lambda: self.auth.still_valid(who)), context)

    @guarded(kind="admin", min_role="viewer")
    def ListSites(self, request, context, *, who):
        online = self.engine.online_sites()
        return admin_pb2.SiteList(sites=[
            site_info(row, online=row.name in online,
                      revoked=bool(row.serial) and self.auth.revoked(int(row.serial)))
            for row in self.store.sites()])

    @guarded(kind="admin", min_role="viewer")
    def GetAudit(self, request, context, *, who):
        if self.audit is None:
            return admin_pb2.AuditReply(problem="audit log not configured")
        return audit_reply(self.audit, verify=request.verify, limit=request.limit, sign_head=request.sign_head)


def site_info(row: SiteRow, *, online: bool, revoked: bool) -> admin_pb2.SiteInfo:
    """A site as `plexus sites list` shows it."""
    return admin_pb2.SiteInfo(site=row.name, last_seen_unix_s=row.last_seen, online=online,
                              policy_digest=row.policy_digest, models=json.loads(row.models),
                              datasets=json.loads(row.datasets), agent_version=row.agent_version,
                              dataset_rows=json.loads(row.dataset_rows), revoked=revoked,
                              kind="relay" if row.children else "site",
                              children=json.loads(row.children) if row.children else [])


def audit_reply(log, *, verify: bool, limit: int, sign_head: bool = False) -> admin_pb2.AuditReply:
    """The reply for `plexus audit`: a failed verification is reported in `problem`, with the entries."""
    problem, verified = "", False
    signed = log.anchor().to_json() if sign_head else ""
    if verify:
        try:
            log.verify()
            verified = True
        except IntegrityError as exc:
            problem = str(exc)
    try:
        entries = [admin_pb2.AuditEntry(seq=e.seq, at=e.at, actor=e.actor, action=e.action, subject=e.subject,
                                        details_json=json.dumps(e.details, sort_keys=True), hash=e.hash)
                   for e in log.entries(limit=limit or None)]
    except IntegrityError as exc:  # an entry too damaged to read: report it, still answer
        entries, problem = [], problem or str(exc)
    return admin_pb2.AuditReply(entries=entries, verified=verified, problem=problem, count=log.count(),
                                signed_head_json=signed)
