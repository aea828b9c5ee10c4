"""Real federations for integration tests: a CA in tmp_path, a coordinator on 127.0.0.1:0, mTLS everywhere."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from coordinator.aggregate import WeightedSum
from coordinator.server import Coordinator
from plexus import identity, pki, transport
from plexus.admin_client import AdminClient
from plexus.config import CoordinatorConfig, DatasetSpec, PolicySpec, SiteConfig, TrainingSpec
from plexus.proto.plexus.v1 import federation_pb2 as fpb, federation_pb2_grpc
from plexus.vocab import TERMINAL
from plexus.wire import Layout, assemble, decode, encode, iter_chunks
from site_agent.agent import SiteAgent

from timing import scaled, wait_until  # noqa: F401  (wait_until is the tests' one poller)

HOSPITAL_OF = {"a": "cleveland", "b": "hungary", "c": "va", "d": "switzerland", "e": "cleveland"}
RAW_ROWS = 1000   # the training rows a RawSite reports at Join by default

HEART_JOB = """\
name: {name}
model: {{name: {model}, args: {{in_features: 13, num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
sites: {{min: {min}, deadline_s: {deadline}{retries}}}
train: {{epochs: 1, batch_size: 32, optimizer: {{name: sgd, lr: 0.1}}}}
seed: {seed}
"""


def heart_job(*, name="heart", model="logistic", rounds=2, min=2, deadline=scaled(30), seed=0, retries=0) -> str:
    return HEART_JOB.format(name=name, model=model, rounds=rounds, min=min, deadline=deadline, seed=seed,
                            retries=f", retries: {retries}" if retries else "")


def expected_mean(layout: Layout, sent: dict) -> dict:
    """The round's model the coordinator's exact sum makes of `sent` ({site: (update, samples)}), as WeightedSum
    folds them."""
    total = WeightedSum(layout)
    for update, samples in sent.values():
        blob = encode(update)[1]
        total.fold([blob], samples, max(float(np.abs(v).max()) for v in update.values()), nbytes=len(blob))
    return total.mean()


def long_poll(site: RawSite, engine, wait_s: float = 30.0) -> tuple[threading.Thread, dict]:
    """Start `site`'s long poll of wait_s at `engine`'s coordinator; return once it waits, with the thread and what
    it will end with: {"task" or "error", "after_s"}."""
    outcome: dict = {}

    def poll():
        started = time.monotonic()
        try:
            outcome["task"] = site.stub.NextTask(fpb.NextTaskRequest(wait_s=wait_s), timeout=2 * wait_s)
        except grpc.RpcError as exc:
            outcome["error"] = exc
        outcome["after_s"] = time.monotonic() - started

    polling = threading.Thread(target=poll)
    polling.start()
    wait_until(lambda: engine._presence.polling == 1, 10, "the site's long poll")
    return polling, outcome


def install_plugin(lib: Path, module: str, source: str, models: dict[str, str]) -> Path:
    """A model plug-in installed in `lib` as pip leaves one: the module and a dist-info whose `plexus.models`
    entry points map each model name to a class of the module. Returns `lib`, to put on a path."""
    info = lib / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (lib / f"{module}.py").write_text(source)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[plexus.models]\n" + "".join(
        f"{name} = {module}:{cls}\n" for name, cls in models.items()))
    return lib


class Federation:
    def __init__(self, root: Path, state_dir: Path, *, models=None, **options):
        """options: CoordinatorConfig keys; models: a ModelWorker of the test's own (default: the shared one)."""
        self.root = root
        self.coordinator = Coordinator(CoordinatorConfig(**{
            "listen": "127.0.0.1:0", "kit": root / "coordinator", "state_dir": state_dir,
            "crl": root / "coordinator" / "crl.pem", "poll_timeout_s": 1.0, "chunk_bytes": 65536, "max_workers": 64,
            "rejoin_grace_s": 2.0, **options}), models=models)
        self.coordinator.start()
        self.address = f"127.0.0.1:{self.coordinator.port}"
        self.agents: list[tuple[SiteAgent, threading.Thread]] = []
        self.clients: list = []

    @property
    def store(self):
        return self.coordinator.store

    def admin(self, name: str = "ops") -> AdminClient:
        client = AdminClient(self.address, self.root / "admins" / name)
        self.clients.append(client)
        return client

    def start_site(self, name: str, *, allowed_models=("logistic", "mlp"), dataset: str = "heart-disease",
                   datasets: dict[str, DatasetSpec] | None = None, training: TrainingSpec | None = None,
                   coordinator: str | None = None, agent_cls: type = SiteAgent, **policy) -> SiteAgent:
        """datasets: the site's own (default: `dataset`, its hospital's heart-disease rows); training: its
        site.yaml `training` (workers); coordinator: where it dials (default: this federation's coordinator; a
        relay's address puts it below that relay); agent_cls: a SiteAgent subclass; policy: further PolicySpec keys
        (e.g. min_cell_count)."""
        if datasets is None:
            datasets = {dataset: DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[name])}
        config = SiteConfig(site=name, coordinator=coordinator or self.address, kit=self.root / "sites" / name,
                            state_dir=self.root / "sites" / name / "state", datasets=datasets,
                            policy=PolicySpec(allowed_models=tuple(allowed_models), **policy), training=training)
        agent = agent_cls(config, backoff_cap_s=0.5)
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        self.agents.append((agent, thread))
        return agent

    def start_sites(self, *names: str) -> Federation:
        """Start these sites (start_site's defaults) and wait until all are online; the federation, for fixtures."""
        for name in names:
            self.start_site(name)
        self.wait_online(*names)
        return self

    def cli_args(self, name: str = "ops") -> list[str]:
        """The flags that point a `plexus` admin command at this federation with admin `name`'s kit."""
        return ["--kit", str(self.root / "admins" / name), "--coordinator", self.address]

    def raw_site(self, name: str) -> RawSite:
        site = RawSite(self.root / "sites" / name, self.address)
        self.clients.append(site)
        return site

    def wait_online(self, *names: str) -> None:
        wait_until(lambda: set(names) <= self.coordinator.engine.online_sites(), what=f"sites {names} online")

    def wait_job(self, job_id: str, timeout: float = 60.0) -> str:
        return wait_until(lambda: (s := self.store.job(job_id).status) in TERMINAL and s,
                          timeout, f"job {job_id} to end")

    def close(self) -> None:
        for agent, _ in self.agents:
            agent.stop.set()
        for client in self.clients:
            client.close()
        self.coordinator.stop(grace=0.5)
        for _, thread in self.agents:
            thread.join(timeout=scaled(10))


class RawSite:
    """A site speaking the protocol by hand, to send what an honest agent never would."""

    def __init__(self, kit_dir: Path, address: str):
        self.channel = transport.channel(identity.load_kit(kit_dir), address)
        self.stub = federation_pb2_grpc.FederationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def join(self, dataset_rows: dict[str, int] | None = None) -> fpb.JoinReply:
        """Join, reporting RAW_ROWS training rows of heart-disease unless told otherwise (an update weighs at
        most the rows its site reported at Join)."""
        rows = {"heart-disease": RAW_ROWS} if dataset_rows is None else dataset_rows
        return self.stub.Join(fpb.JoinRequest(agent_version="raw", models=["logistic"], dataset_rows=rows),
                              timeout=scaled(5))

    def next_task(self, timeout: float = 30.0) -> fpb.Task:
        def poll():
            task = self.stub.NextTask(fpb.NextTaskRequest(wait_s=1.0), timeout=scaled(10))
            return task if task.kind != fpb.TASK_NONE else None
        return wait_until(poll, timeout, "a task")

    def fetch(self, task: fpb.Task) -> tuple[Layout, dict]:
        stream = self.stub.FetchModel(fpb.FetchModelRequest(task_id=task.task_id), timeout=scaled(10))
        layout = Layout.from_proto(next(stream).header.manifest)
        blob = assemble(layout, (message.chunk for message in stream))
        return layout, {k: v.copy() for k, v in decode(layout, blob).items()}

    def submit(self, task: fpb.Task, state: dict, *, num_samples: int = 10, extra: bytes = b"",
               manifest=None, task_id: str | None = None, nonce: bytes | None = None, chunk: int = 1000,
               timeout: float = 10, pause: tuple[int, threading.Event] | None = None) -> fpb.SubmitReply:
        """pause=(n, event): stall the stream after n bytes until event is set."""
        layout, blob = encode(state)
        header = fpb.UpdateHeader(task_id=task_id or task.task_id, job_id=task.job_id, round=task.round,
                                  nonce=task.nonce if nonce is None else nonce, num_samples=num_samples,
                                  manifest=manifest or layout.to_proto())

        def messages():
            yield fpb.UpdateMessage(header=header)
            data = blob + extra
            for offset, piece in iter_chunks(data, chunk):
                if pause and offset >= pause[0]:
                    pause[1].wait(scaled(60))
                yield fpb.UpdateMessage(chunk={"offset": offset, "data": bytes(piece)})

        return self.stub.SubmitUpdate(messages(), timeout=scaled(timeout))

    def report(self, task: fpb.Task, status, reason: str = "") -> fpb.ResultReply:
        return self.stub.ReportResult(fpb.TaskResult(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                                     nonce=task.nonce, status=status, reason=reason), timeout=scaled(5))

    def poison_every_round(self, stop: threading.Event, scale: float) -> threading.Thread:
        """A Byzantine site: answer every training task with the global model times `scale`."""
        def answer(task):
            if task.kind != fpb.TASK_TRAIN:
                return self.report(task, fpb.RESULT_FAILED, "raw test site does not evaluate")
            _, state = self.fetch(task)
            self.submit(task, {k: v * scale for k, v in state.items()}, num_samples=200)
        return self._serve(stop, answer)

    def answer_everything_with_failure(self, stop: threading.Event) -> threading.Thread:
        """Keep polling and fail every further task, so rounds need not wait for this site's deadline."""
        return self._serve(stop, lambda task: self.report(task, fpb.RESULT_FAILED, "raw test site does not work"))

    def decline_everything(self, stop: threading.Event, reason: str) -> threading.Thread:
        """Keep polling and decline every task with `reason` (text a site controls, shown to admins)."""
        return self._serve(stop, lambda task: self.report(task, fpb.RESULT_DECLINED, reason))

    def _serve(self, stop: threading.Event, answer) -> threading.Thread:
        def loop():
            while not stop.is_set():
                try:
                    task = self.stub.NextTask(fpb.NextTaskRequest(wait_s=0.5), timeout=scaled(5))
                    if task.kind != fpb.TASK_NONE:
                        answer(task)
                except grpc.RpcError:
                    return
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread


class DropsOut(SiteAgent):
    """An agent that vanishes (answers nothing more) when a given secure-aggregation phase reaches it."""

    def __init__(self, *args, vanish_at, **kwargs):
        super().__init__(*args, **kwargs)
        self.vanish_at = vanish_at

    def handle(self, stub, task):
        if task.kind == self.vanish_at:
            self.stop.set()
            return None
        return super().handle(stub, task)


def cli_kits(root: Path, federation: str, sites: tuple[str, ...], *, allowed_models: tuple[str, ...]
             ) -> tuple[int, Path, Path]:
    """A federation for `plexus` processes: its CA, an operator kit, a coordinator.yaml (1 s polls) on a free port,
    and each site's kit with a site.yaml mapping its hospital's heart-disease rows. (port, admin kit, coordinator
    config)."""
    port = free_port()
    pki.init_federation(root, federation, hosts=["127.0.0.1"], port=port)
    admin_kit = pki.add_admin(root, "ops", role="operator")
    coord_cfg = root / "coordinator" / "coordinator.yaml"
    coord_cfg.write_text(coord_cfg.read_text() + "poll_timeout_s: 1\n")
    for name in sites:
        kit = pki.add_site(root, name)
        (kit / "site.yaml").write_text(
            f'site: "{name}"\ncoordinator: "127.0.0.1:{port}"\nkit: "."\n'
            f"datasets:\n  heart-disease: {{kind: heart-disease, hospital: {HOSPITAL_OF[name]}}}\n"
            f"policy: {{allowed_models: [{', '.join(allowed_models)}]}}\n")
    return port, admin_kit, coord_cfg


def free_port() -> int:
    """A port free now, for configs that must name one before the server starts (`plexus pki init --port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """`plexus` commands as child processes, each logging to LOGS/NAME.log; `stop_all()` ends exactly those."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "plexus", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(env or os.environ, PYTHONUNBUFFERED="1"),
                                cwd=cwd)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
