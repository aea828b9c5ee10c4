"""Training spread over several worker processes (and machines) of one site, with torch.distributed's DDP.

site.yaml's `training: {workers: N, backend, device, nodes}` makes the site agent the rank 0 of a team of
N × nodes workers. The agent keeps talking to the coordinator alone; the other ranks are helper processes
(`python -m site_agent.team`, started by the agent on its own machine and by `plexus site node` on the
others) that wait for work on a rendezvous store (torch's TCPStore, hosted by the agent at
`training.nodes.address`, or on loopback for one machine).

One training task is one session: rank 0 publishes what to train (the job's YAML, the dataset name, the seed,
the steps, the strategy's proximal weight or gradient correction: JSON, never pickle), every rank loads the
job's model and the site's data itself and says it is ready (or why it cannot be), rank 0 tells them all to
go on or to stand down, and the ranks form a fresh process group for the session. DDP gives
every rank rank 0's weights and averages the gradients. The batches are those of one-process training
(site_agent.training.train_local, the same seeded order and batch size): rank r takes every world-th row of
each batch and weighs its loss sum by world / batch rows, so the averaged gradient is the gradient of the
whole batch's mean loss, and N workers give one worker's update to float tolerance. A rank that fails, dies or
stops answering (training.timeout_s) fails the task at rank 0 with the reason; the agent reports it, starts
its helpers again, and the next task runs as usual.

The rendezvous store and the collectives carry the job's config and model weights between the hospital's
own machines; they are not authenticated: keep `nodes.address` on the hospital's private network.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plexus.config import (
    SiteConfig,
    TrainingSpec,
    dump_site_config,
    load_site_config,
    parse_round_config,
    split_address,
)
from plexus.datasets import load_for_job
from plexus.errors import ConfigError
from plexus.models import build_job_model
from site_agent import training
from site_agent.local import GradientCorrection, ProximalTerm

log = logging.getLogger("plexus.site.team")

POLL_S = 0.05        # how often a rank waiting on the rendezvous store looks again


class TeamError(RuntimeError):
    """A session could not run or finish: a rank failed, died or did not answer in time."""


def spreads(spec: TrainingSpec | None) -> bool:
    """Whether a site trains with more than one process."""
    return spec is not None and spec.world > 1


def _threads(spec: TrainingSpec) -> int:
    return spec.threads or max(1, (os.cpu_count() or 1) // spec.workers)


def _interface(spec: TrainingSpec) -> str | None:
    return spec.interface or ("lo" if spec.nodes is None else None)


@contextlib.contextmanager
def _environment(spec: TrainingSpec) -> Iterator[None]:
    """The collectives' network interface (gloo and NCCL read it from the environment), for the block."""
    interface = _interface(spec)
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    saved = {name: os.environ.get(name) for name in names}
    try:
        if interface is not None:
            for name in names:
                os.environ[name] = interface
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def data_digest(x: np.ndarray, y: np.ndarray) -> str:
    """SHA-256 of the training rows as this rank holds them: every rank must train on the same rows."""
    digest = hashlib.sha256()
    for array in (x, y):
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


# The training loop every rank runs ---------------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    """What rank 0 asks of a session (published as JSON on the store)."""

    session: int
    job_yaml: str
    job_id: str
    module: str            # the trained submodule's name in the job's model ("" for the whole model)
    seed: int
    steps: int | None
    mu: float | None       # FedProx's proximal weight; its anchor follows by broadcast
    correction: bool       # SCAFFOLD's gradient correction follows by broadcast
    rows: int
    digest: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Work:
        fields = json.loads(text)
        if not isinstance(fields, dict) or set(fields) != set(cls.__dataclass_fields__):
            raise ValueError("the session's work description is not one this helper reads; run the same Plexus "
                             "version on every node")
        return cls(**fields)


def _run_ranks(module: nn.Module, xt: torch.Tensor, yt: torch.Tensor, train: Any, work: Work, *, rank: int,
               world: int, device: torch.device, anchor: dict[str, torch.Tensor] | None = None,
               correction: dict[str, torch.Tensor] | None = None,
               started: Callable[[], None] = lambda: None) -> tuple[int, float, int]:
    """Train `module` as rank `rank` of `world` in the current process group; (steps, loss sum, rows) of the
    whole team over what train_local reports (the last pass, or every step in steps mode). `correction`: rank
    0's FedProx anchor and SCAFFOLD correction, which the other ranks receive."""
    make_optimizer = training.OPTIMIZERS[train.optimizer.name]   # checked by training._prepare at every rank
    ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    try:
        term = ProximalTerm(module, _from_rank0(module, anchor), work.mu) if work.mu is not None else None
        hook = GradientCorrection(module, _from_rank0(module, correction)) if work.correction else None
        started()   # the team is formed: its steps begin
        taken, loss_sum, seen = training.minibatch_steps(
            ddp, module, xt, yt, train, make_optimizer(module.parameters(), train.optimizer), seed=work.seed,
            steps=training._step_budget(train, work.steps), loss_term=term, grad_hook=hook, rank=rank, world=world)
        totals = torch.tensor([loss_sum, float(seen)], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        return taken, float(totals[0]), int(totals[1])
    finally:
        _free_reducer(ddp)


def _free_reducer(ddp: DistributedDataParallel) -> None:
    """Free DDP's reducer now, while the process group is still held from Python (by torch.distributed until
    _leave, and by `ddp.process_group`), so that the reducer's reference to it is never the last one.

    The last reference runs ~ProcessGroupGloo, which joins gloo's worker threads. After a failed collective
    (a rank died) a worker may still be releasing the failed work, whose captured thread-local state holds a
    Python object (autograd's stashed context): that needs the GIL. The group's Python binding lets go of the
    GIL before it destroys the group; the reducer's binding keeps it, so a reducer freed last (say when the
    exception's traceback that holds `ddp` goes, long after _leave) would join that worker with the GIL held:
    both wait for ever (seen with py-spy: the agent's thread in std::thread::join under ~Reducer, the gloo
    worker in gil_scoped_acquire under ~AsyncAllreduceWork)."""
    for name in ("logger", "reducer"):   # the logger holds the reducer too
        ddp.__dict__.pop(name, None)


def _from_rank0(module: nn.Module, values: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """One tensor per trainable parameter of `module`, as rank 0 holds them (`values` there, None elsewhere)."""
    mine = {name: torch.zeros_like(p) for name, p in module.named_parameters() if p.requires_grad}
    for name, value in mine.items():
        if values is not None:
            value.copy_(values[name])
        dist.broadcast(value, src=0)
    return mine


def _device(spec: TrainingSpec, local_rank: int) -> torch.device:
    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("training.device is cuda and torch sees no GPU on this machine; install a CUDA build "
                              "of torch or set device: cpu (and backend: gloo)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _join(spec: TrainingSpec, store, work_session: int, rank: int, world: int, device: torch.device) -> None:
    dist.init_process_group(spec.backend, store=dist.PrefixStore(f"session/{work_session}", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=spec.timeout_s),
                            device_id=device if device.type == "cuda" else None)


def _poll(store, keys: list[str], deadline: float, alive: Callable[[], str | None] = lambda: None) -> None:
    """Wait until every key is set on the store; TeamError if `alive()` names a reason to stop (a worker ended)
    or at `deadline` (monotonic). Polls: torch's store.wait logs a warning at every timeout it sees."""
    while not store.check(keys):
        if (reason := alive()) is not None:
            raise TeamError(reason)
        if time.monotonic() > deadline:
            missing = [key for key in keys if not store.check([key])]
            raise TeamError(f"no answer on the team's rendezvous for {', '.join(missing)} within training.timeout_s; "
                            "is every node's `plexus site node` running, with the same site.yaml training section?")
        time.sleep(POLL_S)


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# Rank 0: the site agent ---------------------------------------------------------------------------------
class Team:
    """The site agent's side: the rendezvous store, this machine's helper processes, one session per task."""

    def __init__(self, config: SiteConfig):
        self.config = config
        self.spec: TrainingSpec = config.training
        if self.spec.nodes is not None and self.spec.nodes.rank != 0:
            raise ConfigError(f"this site.yaml is node {self.spec.nodes.rank}'s (training.nodes.rank); the site "
                              "agent runs on node 0: run `plexus site node --config` here instead")
        self.world = self.spec.world
        self.store = None
        self._listener: socket.socket | None = None
        self.helpers: list[subprocess.Popen] = []
        self._digests: dict[int, tuple[np.ndarray, str]] = {}
        self._lock = threading.Lock()

    def _start(self) -> None:
        if self.store is None:
            host, port = split_address(self.spec.nodes.address) if self.spec.nodes is not None else ("127.0.0.1", 0)
            # Bound here, to that address only: torch's own store server would listen on every interface.
            try:
                self._listener = socket.create_server((host, port), backlog=128)
            except OSError as exc:
                raise ConfigError(f"the training team's rendezvous cannot listen on {host}:{port} "
                                  f"(training.nodes.address): {exc.strerror or exc}; give an address of this machine "
                                  "on the hospital network with a free port") from None
            port = self._listener.getsockname()[1]
            self.store = dist.TCPStore(host, port, world_size=None, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=self.spec.timeout_s),
                                       master_listen_fd=self._listener.fileno())
            log.info("training team of %d workers: rendezvous on %s:%d", self.world, host, self.store.port)
        alive = [p for p in self.helpers if p.poll() is None]
        if len(alive) == len(self.helpers) == self.spec.workers - 1:
            return
        self._stop_helpers()
        config = dump_site_config(self.config).encode()
        for local in range(1, self.spec.workers):
            self.helpers.append(start_helper(config, rank=local, store=f"127.0.0.1:{self.store.port}"
                                             if self.spec.nodes is None else self.spec.nodes.address))

    def _stop_helpers(self) -> None:
        stop_processes(self.helpers)
        self.helpers = []

    def close(self) -> None:
        """End this machine's helpers (they also end by themselves when the agent's process ends)."""
        with self._lock:
            self._stop_helpers()

    @contextlib.contextmanager
    def session(self, job_yaml: str, job_id: str, root: nn.Module) -> Iterator[None]:
        """Within the block, train_local on `root` (the task's job model) or one of its submodules trains as
        the team."""
        with self._lock:
            self._start()
            token = training.TEAM.set(_Session(self, job_yaml, job_id, root))
            try:
                yield
            finally:
                training.TEAM.reset(token)

    def gather(self, session: int, deadline: float) -> None:
        """Wait until every other rank has prepared `session` (loaded the model and its rows), watching this
        machine's helpers; then tell them all to go on, or (a rank could not prepare, one ended, time ran out)
        to stand down, and raise TeamError with the reason."""
        keys = [f"ready/{session}/{rank}" for rank in range(1, self.world)]

        def alive() -> str | None:
            for local, proc in enumerate(self.helpers, start=1):
                if proc.poll() is not None:
                    return f"worker rank {local} (PID {proc.pid}) ended with status {proc.returncode} before the task"
            return None

        try:
            _poll(self.store, keys, deadline, alive)
            problems = [f"rank {rank}: {text}" for rank, key in enumerate(keys, start=1)
                        if (text := self.store.get(key).decode())]
            if problems:
                raise TeamError("the training team could not start this task: " + "; ".join(problems))
        except TeamError:
            self.store.set(f"go/{session}", "0")
            raise
        self.store.set(f"go/{session}", "1")

    def forget(self, session: int) -> None:
        """Drop an ended session's keys from the store, so that it does not grow with every task."""
        for key in (f"work/{session}", f"go/{session}", f"done/{session}", f"training/{session}",
                    *(f"ready/{session}/{rank}" for rank in range(1, self.world))):
            self.store.delete_key(key)

    def digest(self, x: np.ndarray, y: np.ndarray) -> str:
        key = id(x)
        if key not in self._digests or self._digests[key][0] is not x:
            self._digests[key] = (x, data_digest(x, y))
        return self._digests[key][1]


class _Session:
    def __init__(self, team: Team, job_yaml: str, job_id: str, root: nn.Module):
        self.team, self.job_yaml, self.job_id, self.root = team, job_yaml, job_id, root

    def train(self, model: nn.Module, x: np.ndarray, y: np.ndarray, train: Any, *, seed: int, steps: int | None,
              loss_term: Callable | None, grad_hook: Callable | None) -> training.TrainResult:
        team, spec = self.team, self.team.spec
        path = next((name for name, module in self.root.named_modules() if module is model), None)
        if path is None:
            raise ConfigError("training spread over workers trains the job's model or one of its parts; this "
                              "strategy trains something else: set training.workers: 1 at this site")
        for given, kind, name in ((loss_term, ProximalTerm, "loss term"), (grad_hook, GradientCorrection, "hook")):
            if given is not None and not isinstance(given, kind):
                raise ConfigError(f"this strategy's {name} cannot be rebuilt at the other workers; set "
                                  "training.workers: 1 at this site for it")
        _, xt, yt, n = training._prepare(model, x, y, train)
        store = team.store
        session = store.add("sessions", 1)
        team.forget(session - 1)   # done: its keys (the job's YAML among them) need not stay in the store
        work = Work(session=session, job_yaml=self.job_yaml, job_id=self.job_id, module=path, seed=seed,
                    steps=steps, mu=loss_term.mu if loss_term is not None else None, correction=grad_hook is not None,
                    rows=n, digest=team.digest(x, y))
        device = _device(spec, 0)
        store.set(f"work/{session}", work.to_json())
        threads = torch.get_num_threads()
        started = time.monotonic()
        try:
            with _environment(spec):
                torch.set_num_threads(_threads(spec))
                model.to(device)
                try:
                    team.gather(session, started + spec.timeout_s)
                    _join(spec, store, session, 0, team.world, device)
                    taken, loss_sum, seen = _run_ranks(
                        model, xt.to(device), yt.to(device), train, work, rank=0, world=team.world, device=device,
                        anchor=loss_term.anchor if loss_term is not None else None,
                        correction=grad_hook.correction if grad_hook is not None else None,
                        started=lambda: store.set(f"training/{session}", "1"))
                except TeamError:
                    raise
                except (RuntimeError, dist.DistBackendError, dist.DistNetworkError) as exc:
                    raise TeamError(f"the training team failed after {time.monotonic() - started:.1f} s: "
                                    f"{type(exc).__name__}: {_first_line(exc)} (training.workers "
                                    f"{spec.workers}; see this site's log; its helpers start again for the next "
                                    "task)") from exc
                finally:
                    _leave()
                    model.to("cpu")
        finally:
            torch.set_num_threads(threads)
            store.set(f"done/{session}", "1")
        train_loss = loss_sum / seen
        if not math.isfinite(train_loss):
            raise ValueError(f"training diverged (train_loss={train_loss}); lower the learning rate")
        return training.TrainResult(num_samples=n, steps=taken, metrics={"train_loss": train_loss})


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


# Helpers: the other ranks -------------------------------------------------------------------------------
def start_helper(config_yaml: bytes, *, rank: int, store: str) -> subprocess.Popen:
    """One helper process for `rank`; it reads its site config on stdin and ends when stdin closes."""
    proc = subprocess.Popen([sys.executable, "-m", "site_agent.team", "--rank", str(rank), "--store", store],
                            stdin=subprocess.PIPE, close_fds=True)
    proc.stdin.write(len(config_yaml).to_bytes(8, "big") + config_yaml)
    proc.stdin.flush()
    return proc


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Close the helpers' stdin (they end), then end any still running after `grace_s`; reap them all."""
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Helper:
    """One rank other than 0: waits for sessions on the store and trains in each."""

    def __init__(self, config: SiteConfig, rank: int, store_address: str):
        self.config, self.spec, self.rank = config, config.training, rank
        self.world = self.spec.world
        self.local = rank % self.spec.workers
        host, port = split_address(store_address)
        self.store = dist.TCPStore(host, port, world_size=None, is_master=False,
                                   timeout=datetime.timedelta(seconds=self.spec.timeout_s))
        self._data: dict = {}
        self.stop = threading.Event()

    def serve(self) -> None:
        torch.set_num_threads(_threads(self.spec))
        session = self._first_session()
        while not self.stop.is_set():
            if not self.store.check([f"work/{session}"]):
                time.sleep(POLL_S)
                continue
            try:
                self._session(Work.from_json(self.store.get(f"work/{session}")))
            except Exception:   # the session failed at rank 0 too (it says why); wait for the next one
                log.exception("rank %d: session %d failed", self.rank, session)
            finally:
                _leave()
            session = max(session + 1, self._first_session())

    def _first_session(self) -> int:
        """The session to take part in: the one in progress (published, not done), else the next."""
        current = self.store.add("sessions", 0)
        if current and self.store.check([f"work/{current}"]) and not self.store.check([f"done/{current}"]):
            return current
        return current + 1

    def _session(self, work: Work) -> None:
        device = _device(self.spec, self.local)
        problem, module, xt, yt, job = "", None, None, None, None
        try:
            job = parse_round_config(work.job_yaml, source=f"job {work.job_id}")
            module = build_job_model(job).get_submodule(work.module).to(device)
            x, y = self._rows(job)
            if len(y) != work.rows or data_digest(x, y) != work.digest:
                problem = (f"dataset {job.data.dataset!r} here holds {len(y)} training rows that differ from node 0's "
                           f"{work.rows}; give every node the same files at the paths its site.yaml names")
            else:
                _, xt, yt, _ = training._prepare(module, x, y, job.train)
        except Exception as exc:   # told to rank 0, which fails the task with it
            problem = f"{type(exc).__name__}: {_first_line(exc)}"
        self.store.set(f"ready/{work.session}/{self.rank}", problem)
        _poll(self.store, [f"go/{work.session}"], time.monotonic() + self.spec.timeout_s)
        if problem or self.store.get(f"go/{work.session}") != b"1":
            return
        with _environment(self.spec):
            _join(self.spec, self.store, work.session, self.rank, self.world, device)
            _run_ranks(module, xt, yt, job.train, work, rank=self.rank, world=self.world, device=device)

    def _rows(self, job) -> tuple[np.ndarray, np.ndarray]:
        if job.data not in self._data:
            split = load_for_job(self.config.datasets[job.data.dataset], job.data)
            self._data = {job.data: (split.x_train, split.y_train)}   # one dataset at a time
        return self._data[job.data]


def run_node(config: SiteConfig, stop: threading.Event, *, poll_s: float = 1.0) -> None:
    """`plexus site node`: this machine's ranks of the site's team (training.nodes.rank > 0), each a helper
    process, started again when one ends, until `stop`."""
    spec = config.training
    if not spreads(spec) or spec.nodes is None or spec.nodes.rank == 0:
        raise ConfigError("`plexus site node` runs the workers of a node other than 0: its site.yaml needs "
                          "training.nodes with rank 1 or more (node 0 runs `plexus site run`)")
    text = dump_site_config(config).encode()
    ranks = [spec.nodes.rank * spec.workers + local for local in range(spec.workers)]
    procs: dict[int, subprocess.Popen] = {}
    try:
        while not stop.is_set():
            for rank in ranks:
                if rank in procs and procs[rank].poll() is not None:
                    log.warning("rank %d (PID %d) ended with status %s; starting it again", rank, procs[rank].pid,
                                procs[rank].returncode)
                if rank not in procs or procs[rank].poll() is not None:
                    procs[rank] = start_helper(text, rank=rank, store=spec.nodes.address)
            stop.wait(poll_s)
    finally:
        stop_processes(list(procs.values()))


def _watch_parent(stream, stop: Callable[[], None]) -> None:
    """End this helper when its parent (the agent or `plexus site node`) closes our stdin or dies."""
    while stream.read(1 << 16):
        pass
    stop()


def _read_config(stream) -> SiteConfig:
    import tempfile
    from pathlib import Path

    size = int.from_bytes(stream.read(8), "big")
    text = stream.read(size)
    if len(text) != size:
        raise SystemExit("site_agent.team: no site config on stdin (start helpers through the site agent or "
                         "`plexus site node`)")
    with tempfile.TemporaryDirectory() as folder:   # the text's paths are absolute (dump_site_config of a loaded one)
        path = Path(folder) / "site.yaml"
        path.write_bytes(text)
        return load_site_config(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m site_agent.team", description="a training helper (one rank)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the team's rendezvous store")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    config = _read_config(sys.stdin.buffer)
    # Before anything that may wait (the store's address may not answer yet): a parent that is gone ends us.
    threading.Thread(target=_watch_parent, args=(sys.stdin.buffer, lambda: os._exit(0)), daemon=True).start()
    Helper(config, args.rank, args.store).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
