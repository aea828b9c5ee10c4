"""Asynchronous secure aggregation's cost per flush, against plain asynchronous buffers (same K, same model).

    python -m bench.async_secagg_cost [--sizes 100K,1M] [--buffers 3,5] [--flushes 4] [--repeats 3] [--out FILE]

One process, no sockets: the real AsyncRounds driver over a real Store (in a temporary folder), driven the
way the engine and the gRPC servicers drive it (the same task, payload, update-header and SecAgg message
conversions, ownership and binding checks), and K in-memory sites whose training is "add a constant"
(plexus.secagg.SiteSession does a secure site's protocol work). Every site takes part in every flush, on
the newest version (τ = 0).

Plain and secure runs alternate `--repeats` times. Per flush (the median over flushes 2..F of every
repeat; the first flush of a run pays one-off costs) it reports:
- coordinator CPU: the thread time of everything the coordinator does for the flush: handing out tasks,
  serving the model, folding updates (plain) or masked inputs (secure), checking and relaying adverts and
  shares, unmasking, the version write, and its side of the protobuf conversions; and the same without the
  checkpoint write (the same in both, and the noisiest part: it goes to disk);
- site CPU, summed over the K sites (secure: keys, shares, masking, reveals; both: the model's decoding);
- bytes on the wire: every RPC message of the flush in both directions (NextTask, FetchModel, SubmitUpdate,
  ReportResult, SecAgg and their replies) as serialised protobuf plus gRPC's 5-byte message prefix, without
  HTTP/2 and TLS framing (a few per cent more on a real connection; bench/run.py measures those on
  loopback for synchronous rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench.run import label, parse_size
from coordinator.drivers import Context
from coordinator.drivers.async_ import AsyncRounds
from coordinator.service import model_stream, secagg_answer, task_message, update_header
from coordinator.store import Store
from coordinator.tasks import Binding, Presence, TaskResult, check_binding, owned_task
from plexus import identity, pki, staleness
from plexus.config import dump_round_config, parse_round_config
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg import Field, SiteSession, advert_from_proto, advert_to_proto
from plexus.vocab import TaskKind, TaskStatus
from plexus.wire import DEFAULT_CHUNK_BYTES, Layout, assemble, chunk_size, decode, encode_chunks

GRPC_PREFIX = 5   # each gRPC message: a compressed flag and a 4-byte length
TENSORS = 4
SAMPLES = 100
JOB = """\
name: bench-async-secagg
model: {{name: vector, args: {{size: {size}, chunks: {tensors}}}}}
data: {{dataset: bench}}
rounds: {versions}
sites: {{min: 3, deadline_s: 3600}}
strategy: {{name: fedavg}}
asynchronous: {{buffer: {buffer}, max_staleness: 4, cohort_timeout_s: 3600, idle_timeout_s: 3600}}
{privacy}seed: 0
"""
SECURE = "privacy: {secure_aggregation: true, secagg: {phase_timeout_s: 3600}}\n"
KIND = {fpb.TASK_SECAGG_ADVERTISE: TaskKind.SECAGG_ADVERTISE, fpb.TASK_SECAGG_SHARE: TaskKind.SECAGG_SHARE,
        fpb.TASK_SECAGG_MASKED_INPUT: TaskKind.SECAGG_MASK, fpb.TASK_SECAGG_UNMASK: TaskKind.SECAGG_UNMASK}
SECAGG_BODY = {"advert": TaskKind.SECAGG_ADVERTISE, "shares": TaskKind.SECAGG_SHARE,
               "reveal": TaskKind.SECAGG_UNMASK}


class Meter:
    """CPU seconds by party (and of the coordinator's checkpoint writes), and bytes and messages on the wire."""

    def __init__(self):
        self.cpu = {"coordinator": 0.0, "sites": 0.0, "checkpoint": 0.0}
        self.bytes = 0
        self.messages = 0

    @contextmanager
    def on(self, party: str):
        start = time.thread_time()
        try:
            yield
        finally:
            self.cpu[party] += time.thread_time() - start

    def wire(self, *messages) -> None:
        for message in messages:
            self.bytes += message.ByteSize() + GRPC_PREFIX
            self.messages += 1

    def snapshot(self) -> tuple[float, float, float, int, int]:
        return self.cpu["coordinator"], self.cpu["sites"], self.cpu["checkpoint"], self.bytes, self.messages


class Federation:
    """The driver, its store and presence, and what the engine does around each driver call."""

    def __init__(self, root: Path, *, size: int, buffer: int, secure: bool, versions: int, meter: Meter):
        self.meter = meter
        self.store = Store(root / "state")
        write = self.store.save_checkpoint_blob

        def timed_write(*args, **kwargs):
            with meter.on("checkpoint"):
                return write(*args, **kwargs)
        self.store.save_checkpoint_blob = timed_write   # measured apart: the same work in both modes
        self.presence = Presence(threading.RLock(), online_window_s=1e9, monotonic=time.monotonic)
        ctx = Context(store=self.store, presence=self.presence, clock=time.time, monotonic=time.monotonic,
                      notify=lambda: None, models=None, model_limits=None)
        cfg = parse_round_config(JOB.format(size=size, tensors=TENSORS, versions=versions, buffer=buffer,
                                            privacy=SECURE if secure else ""), source="bench job")
        self.cfg, self.job_id = cfg, "bench-async-secagg-00000000"
        step = size // TENSORS
        self.store.save_checkpoint(self.job_id, 0, {f"w{i}": np.zeros(step if i < TENSORS - 1 else size - step * i,
                                                                      np.float32) for i in range(TENSORS)})
        self.store.add_job(self.job_id, cfg.name, dump_round_config(cfg), cfg.strategy.name, cfg.rounds, "bench")
        self.driver = AsyncRounds.take_up(ctx, self.store.job(self.job_id))

    def join(self, site: str) -> None:
        self.store.site_seen(site, agent_version="bench", models=["vector"], datasets=["bench"], policy_digest="")
        self.presence.joined(site, {"bench": SAMPLES})

    # the servicers' side of each RPC, timed as the coordinator's
    def next_task(self, site: str) -> fpb.Task | None:
        with self.meter.on("coordinator"):
            grant = self.driver.grant(site)
            task = task_message(grant) if grant is not None else None
        if task is not None:
            self.meter.wire(fpb.NextTaskRequest(wait_s=20.0), task)
        return task

    def _current(self, site: str, task_id: str):
        _, round_, status = owned_task(self.store, site, task_id)
        return self.driver.current(site, task_id, round_, status)

    def fetch(self, site: str, task: fpb.Task) -> list[fpb.ModelMessage]:
        with self.meter.on("coordinator"):
            served = self.driver.served(self._current(site, task.task_id))
            messages = list(model_stream(task.job_id, task.model_round, served, DEFAULT_CHUNK_BYTES))
        self.meter.wire(fpb.FetchModelRequest(task_id=task.task_id), *messages)
        return messages

    def submit(self, site: str, messages: list[fpb.UpdateMessage]) -> None:
        self.meter.wire(*messages)
        with self.meter.on("coordinator"):
            header = update_header(messages[0].header)
            grant = self._current(site, header.task.task_id)
            masked = grant.kind == TaskKind.SECAGG_MASK
            check_binding(grant, header.task.job_id, header.task.round, header.task.nonce,
                          TaskKind.SECAGG_MASK if masked else TaskKind.TRAIN)
            upload = self.driver.upload(site, grant, header, lambda exc: None)
            try:
                upload.receive((m.chunk.offset, m.chunk.data) for m in messages[1:])
                reply = fpb.SubmitReply(accepted=True, message=self.driver.accepted(site, grant, header, upload))
            finally:
                self.driver.ended_upload(site, upload)
        self.meter.wire(reply)

    def report(self, site: str, request: fpb.TaskResult) -> None:
        self.meter.wire(request)
        with self.meter.on("coordinator"):
            grant = self._current(site, request.task_id)
            check_binding(grant, request.job_id, request.round, request.nonce, None)
            binding = Binding(request.task_id, request.job_id, request.round, request.nonce)
            reply = fpb.ResultReply(message=self.driver.answered(site, grant, TaskResult(binding, TaskStatus.TRAINED)))
        self.meter.wire(reply)

    def secagg(self, site: str, request: fpb.SecAggMessage) -> None:
        self.meter.wire(request)
        with self.meter.on("coordinator"):
            answer = secagg_answer(request)
            grant = self._current(site, answer.task.task_id)
            check_binding(grant, answer.task.job_id, answer.task.round, answer.task.nonce, SECAGG_BODY[answer.body])
            reply = fpb.ResultReply(message=self.driver.answered(site, grant, answer))
        self.meter.wire(reply)

    def tick(self) -> None:
        with self.meter.on("coordinator"):
            self.driver.tick(time.monotonic())


class Site:
    """A bench site: the agent's protocol, training replaced by adding a constant to every parameter."""

    def __init__(self, fed: Federation, name: str, index: int, kit):
        self.fed, self.name, self.kit = fed, name, kit
        self.delta = 0.001 * (index + 1)
        self.kept: list[np.ndarray] | None = None
        self.session: SiteSession | None = None

    def handle(self, task: fpb.Task) -> None:
        fed, meter = self.fed, self.fed.meter
        header = dict(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce)
        if task.kind == fpb.TASK_TRAIN:
            messages = fed.fetch(self.name, task)
            with meter.on("sites"):
                layout = Layout.from_proto(messages[0].header.manifest)
                model = decode(layout, assemble(layout, (m.chunk for m in messages[1:])))
                if not fed.cfg.privacy.secure_aggregation:
                    update = {k: v + np.float32(self.delta) for k, v in model.items()}
                    layout, chunks = encode_chunks(update, chunk_size(layout.total_bytes, DEFAULT_CHUNK_BYTES))
                    stream = [fpb.UpdateMessage(header=fpb.UpdateHeader(**header, num_samples=SAMPLES,
                                                                        manifest=layout.to_proto()))]
                    stream += [fpb.UpdateMessage(chunk={"offset": o, "data": bytes(d)}) for o, d in chunks]
                else:
                    self.kept = [np.full(t.numel, self.delta) for t in layout.tensors]
                    self.layout = layout
            if fed.cfg.privacy.secure_aggregation:
                return fed.report(self.name, fpb.TaskResult(**header, status=fpb.RESULT_TRAINED))
            return fed.submit(self.name, stream)
        p = task.secagg
        with meter.on("sites"):
            if task.kind == fpb.TASK_SECAGG_ADVERTISE:
                tau = p.version - task.model_round
                weight = staleness.fixed_weight(fed.cfg.asynchronous.staleness, tau, SAMPLES)
                self.session = SiteSession(task.job_id, task.round, self.name, max_weight=staleness.MAX_FIXED_WEIGHT)
                message = fpb.SecAggMessage(**header, advert=advert_to_proto(
                    self.session.advertise(weight, self.kit.key_pem, self.kit.cert_pem)))
            elif task.kind == fpb.TASK_SECAGG_SHARE:
                shares = self.session.share([advert_from_proto(a) for a in p.adverts], threshold=p.threshold,
                                            total_weight=p.total_weight, ca_pem=self.kit.ca_pem)
                message = fpb.SecAggMessage(**header, shares=fpb.SharesMessage(ciphertexts=shares))
            elif task.kind == fpb.TASK_SECAGG_MASKED_INPUT:
                self.session.receive_shares(dict(p.shares_for_you))
                masked = np.concatenate(list(self.session.mask(self.kept, field=Field.fixed(p.clip, p.frac_bits))))
                manifest = Layout.build([(t.name, "U32", t.shape) for t in self.layout.tensors]).to_proto()
                data = masked.astype("<u4").tobytes()
                step = chunk_size(len(data), DEFAULT_CHUNK_BYTES)
                message = [fpb.UpdateMessage(header=fpb.UpdateHeader(**header, manifest=manifest))]
                message += [fpb.UpdateMessage(chunk={"offset": o, "data": data[o:o + step]})
                            for o in range(0, len(data), step)]
            else:
                reveals = self.session.unmask(list(p.u3))
                message = fpb.SecAggMessage(**header, reveal=fpb.RevealMessage(reveals=[
                    fpb.ShareReveal(peer=peer, kind=kind, x=x, y=y.to_bytes(66, "big"))
                    for peer, (kind, x, y) in sorted(reveals.items())]))
        if task.kind == fpb.TASK_SECAGG_MASKED_INPUT:
            return fed.submit(self.name, message)
        return fed.secagg(self.name, message)


def measure(size: int, buffer: int, flushes: int, *, secure: bool, root: Path) -> list[tuple]:
    """Run `flushes` + 1 flushes; per flush after the first: (coordinator CPU, site CPU, checkpoint-write CPU,
    bytes, messages)."""
    meter = Meter()
    fed = Federation(root / ("secure" if secure else "plain"), size=size, buffer=buffer, secure=secure,
                     versions=flushes + 2, meter=meter)
    pki.init_federation(root / "pki", "bench-async-secagg")
    sites = []
    for i in range(buffer):
        name = f"site-{i:02d}"
        fed.join(name)
        sites.append(Site(fed, name, i, identity.load_kit(pki.add_site(root / "pki", name))))
    fed.tick()
    marks = [meter.snapshot()]
    while fed.driver.version < flushes + 1:
        before = fed.driver.version
        for site in sites:
            task = fed.next_task(site.name)
            if task is not None:
                site.handle(task)
        fed.tick()
        if fed.driver.version != before:
            marks.append(meter.snapshot())
    fed.store.close()
    return [tuple(b - a for a, b in zip(marks[i - 1], marks[i])) for i in range(2, len(marks))]


def summary(per: list[tuple]) -> dict:
    return {"coordinator_cpu_s": statistics.median(p[0] for p in per),
            "coordinator_cpu_without_checkpoint_s": statistics.median(p[0] - p[2] for p in per),
            "sites_cpu_s": statistics.median(p[1] for p in per),
            "bytes": statistics.median(p[3] for p in per), "messages": statistics.median(p[4] for p in per),
            "per_flush": per}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100K,1M")
    ap.add_argument("--buffers", default="3,5")
    ap.add_argument("--flushes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    print("per flush, median; CPU in ms; 'w/o ckpt': without the checkpoint write; bytes: protobuf + gRPC prefix")
    print(f"{'model':>6} {'K':>3} | {'coordinator CPU':^22} | {'coordinator w/o ckpt':^22} | "
          f"{'bytes on the wire (MiB)':^26} | {'site CPU, all K':^20}")
    print(f"{'':>6} {'':>3} | {'plain':>6} {'secure':>7} {'ratio':>6} | {'plain':>6} {'secure':>7} {'ratio':>6} | "
          f"{'plain':>8} {'secure':>8} {'ratio':>7} | {'plain':>5} {'secure':>6} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="plexus-async-secagg-") as tmp:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            for buffer in (int(k) for k in args.buffers.split(",")):
                runs = {False: [], True: []}
                for repeat in range(args.repeats):   # alternating, so drifting load hits both alike
                    for secure in (False, True):
                        case = Path(tmp) / f"{size}-{buffer}-{repeat}-{secure}"
                        runs[secure] += measure(size, buffer, args.flushes, secure=secure, root=case)
                plain, secure = summary(runs[False]), summary(runs[True])
                rows.append({"size": size, "buffer": buffer, "model_bytes": 4 * size, "plain": plain,
                             "secure": secure})
                pc, sc = plain["coordinator_cpu_s"], secure["coordinator_cpu_s"]
                pw, sw = plain["coordinator_cpu_without_checkpoint_s"], secure["coordinator_cpu_without_checkpoint_s"]
                pb, sb = plain["bytes"], secure["bytes"]
                ps, ss = plain["sites_cpu_s"], secure["sites_cpu_s"]
                print(f"{label(size):>6} {buffer:>3} | {pc * 1e3:6.1f} {sc * 1e3:7.1f} {sc / pc:5.2f}x | "
                      f"{pw * 1e3:6.1f} {sw * 1e3:7.1f} {sw / pw:5.2f}x | "
                      f"{pb / 2**20:8.2f} {sb / 2**20:8.2f} {sb / pb:6.4f}x | "
                      f"{ps * 1e3:5.0f} {ss * 1e3:6.0f} {ss / max(ps, 1e-6):5.1f}x", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
