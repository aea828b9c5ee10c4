"""A malicious coordinator for site-side tests: real gRPC over mTLS, tasks of the test's choosing.

It holds the federation's real coordinator certificate (what a compromised or curious
coordinator has), so the site talks to it exactly as to the real one; the test decides
every field of every task: job ids, round numbers, replays.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from plexus import pki, transport
from plexus.config import DatasetSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.identity import load_kit
from plexus.models import build_job_model, state_views
from plexus.proto.plexus.v1 import federation_pb2 as fpb, federation_pb2_grpc
from plexus.wire import encode, iter_chunks
from site_agent.agent import SiteAgent

DP_SGD_JOB = """\
name: replayed
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 10
train: {epochs: 1, batch_size: 32, optimizer: {name: sgd, lr: 0.1}}
privacy: {dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0}}
"""


@dataclass(frozen=True)
class Outcome:
    """What the site answered to one task: 'update', the ResultStatus name with the reason, or the SecAgg
    message's body ('advert', 'shares', 'reveal') with the message."""

    what: str
    job_id: str
    round: int
    reason: str = ""
    message: object = field(default=None, compare=False)


class RogueCoordinator(federation_pb2_grpc.FederationServicer):
    def __init__(self, kit_dir: Path):
        self._tasks: queue.Queue[fpb.Task] = queue.Queue()
        self._issued: dict[str, fpb.Task] = {}
        self.outcomes: queue.Queue[Outcome] = queue.Queue()
        self.joins: list[fpb.JoinRequest] = []
        self._ids = itertools.count(1)
        self.empty_models = False   # FetchModel ends before its header
        self.split_opened = threading.Event()   # a Split call took its first message, and will never answer
        self.executor = futures.ThreadPoolExecutor(max_workers=16)
        self.server, self.port = transport.server(load_kit(kit_dir), "127.0.0.1:0", executor=self.executor)
        federation_pb2_grpc.add_FederationServicer_to_server(self, self.server)
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.stop(0).wait()
        self.executor.shutdown(wait=True)

    def ask(self, job_id: str, config_yaml: str, *, round_: int = 1, kind=fpb.TASK_TRAIN,
            model_round: int | None = None, secagg: fpb.SecAggPayload | None = None, local_steps: int = 0,
            timeout: float = 120.0) -> Outcome:
        """Hand the site one task (model_round: round_ - 1 unless given) and wait for its answer."""
        task_id = f"t{next(self._ids)}"
        task = fpb.Task(kind=kind, task_id=task_id, job_id=job_id, round=round_,
                        model_round=round_ - 1 if model_round is None else model_round, config_yaml=config_yaml,
                        nonce=task_id.encode(), deadline_unix_s=time.time() + timeout, seed=round_, secagg=secagg,
                        local_steps=local_steps)
        self._issued[task_id] = task
        self._tasks.put(task)
        return self.outcomes.get(timeout=timeout)

    # the Federation service, as a malicious coordinator plays it --------------------------------
    def Join(self, request, context):
        self.joins.append(request)
        return fpb.JoinReply(federation="rogue", site="a", poll_timeout_s=1.0)

    def NextTask(self, request, context):
        # A stopped agent's poll lingers here until its wait runs out; a task it took would be lost and the
        # restarted agent never see it. So the poll waits in short steps, and a task taken for a caller that
        # has gone away goes back to the queue.
        deadline = time.monotonic() + min(request.wait_s, 1.0)
        while context.is_active() and time.monotonic() < deadline:
            try:
                task = self._tasks.get(timeout=0.05)
            except queue.Empty:
                continue
            if context.is_active():
                return task
            self._tasks.put(task)
            break
        return fpb.Task(kind=fpb.TASK_NONE)

    def FetchModel(self, request, context):
        if self.empty_models:
            return
        task = self._issued[request.task_id]
        layout, blob = encode(state_views(build_job_model(parse_round_config(task.config_yaml))))
        yield fpb.ModelMessage(header=fpb.ModelHeader(job_id=task.job_id, round=task.model_round,
                                                      manifest=layout.to_proto()))
        for offset, piece in iter_chunks(blob, 1 << 16):
            yield fpb.ModelMessage(chunk={"offset": offset, "data": bytes(piece)})

    def SubmitUpdate(self, request_iterator, context):
        header = next(request_iterator).header
        for _ in request_iterator:
            pass
        self.outcomes.put(Outcome("update", header.job_id, header.round))
        return fpb.SubmitReply(accepted=True, message="thank you")

    def Split(self, request_iterator, context):
        next(request_iterator)   # the site's SplitOpen, then nothing back for as long as the site waits
        self.split_opened.set()
        while context.is_active():
            time.sleep(0.05)
        yield from ()

    def SecAgg(self, request, context):
        self.outcomes.put(Outcome(request.WhichOneof("body"), request.job_id, request.round, message=request))
        return fpb.ResultReply(message="noted")

    def ReportResult(self, request, context):
        self.outcomes.put(Outcome(fpb.ResultStatus.Name(request.status), request.job_id, request.round,
                                  request.reason))
        return fpb.ResultReply(message="noted")


@contextmanager
def rogue_federation(tmp_path: Path, federation: str) -> Iterator[RogueCoordinator]:
    """A federation of one site "a" (PKI under tmp_path/pki) whose coordinator is a RogueCoordinator;
    its `root` is the PKI folder."""
    root = tmp_path / "pki"
    pki.init_federation(root, federation, hosts=["127.0.0.1"])
    pki.add_site(root, "a")
    coordinator = RogueCoordinator(root / "coordinator")
    coordinator.root = root
    try:
        yield coordinator
    finally:
        coordinator.close()


@contextmanager
def site_agents(rogue: RogueCoordinator, state_dir: Path):
    """Yields start(policy) -> (agent, thread): a real site agent of site "a" on `state_dir`, dialling
    `rogue`; every agent started is stopped at the end."""
    running = []

    def start(policy: PolicySpec) -> tuple[SiteAgent, threading.Thread]:
        running.append(start_site(rogue.root, rogue.address, state_dir, policy))
        return running[-1]

    try:
        yield start
    finally:
        for agent, thread in running:
            stop_site(agent, thread)


def start_site(root: Path, address: str, state_dir: Path, policy: PolicySpec) -> tuple[SiteAgent, threading.Thread]:
    """A real site agent (site 'a' of the pki in `root`) serving the rogue coordinator in a thread."""
    config = SiteConfig(site="a", coordinator=address, kit=root / "sites" / "a", state_dir=state_dir,
                        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital="cleveland")},
                        policy=policy)
    agent = SiteAgent(config, backoff_cap_s=0.5)
    thread = threading.Thread(target=agent.run, name="site-a", daemon=True)
    thread.start()
    return agent, thread


def stop_site(agent: SiteAgent, thread: threading.Thread) -> None:
    agent.shutdown()
    thread.join(30)
    agent.audit.close()
