"""Jobs on virtual sites: the coordinator's own engine, drivers and servicers, on a virtual clock.

The simulator builds what `plexus coordinator run` builds (a Store in STATE/coordinator, the Engine, the
Federation and Admin servicers, an Authenticator over a federation CA made for the run) and calls the
servicers in process (plexus.inproc) as each virtual site, with that site's own certificate. The sites are
the real `SiteAgent` in worker processes (simulation/worker.py), so every byte of an update is computed and
checked as in a federation: the same seed gives the same model, bit for bit.

Time is virtual (simulation/profile.py). The engine runs on the simulator's clock and is ticked, never
threaded. A task granted at t answers at t + its virtual duration; answers are handed to the coordinator
in the order of their virtual arrival, with one shortcut that changes no result: in a synchronous job an
answer that arrives before its round's deadline is taken at once (a round sums its updates exactly, in any
order, and closes only once all are in), so only late answers wait. The coordinator's memory stays that of
a federation's: updates fold as they arrive, whatever the number of sites.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from coordinator.engine import Engine
from coordinator.service import AdminService, FederationService
from coordinator.store import Store
from plexus import pki
from plexus.config import RoundConfig, SiteConfig, dump_site_config, parse_round_config
from plexus.errors import ConfigError, PlexusError
from plexus.identity import RevocationList, federation_of, load_kit
from plexus.inproc import LocalStub
from plexus.proto.plexus.v1 import admin_pb2, federation_pb2 as fpb
from plexus.rpc import Authenticator
from plexus.vocab import TERMINAL
from plexus.wire import DEFAULT_CHUNK_BYTES
from simulation.arena import owned
from simulation.inplace import chunk_in_place
from simulation.profile import Profile
from simulation.worker import ANSWERS, DEFAULT_AGENT

log = logging.getLogger("plexus.simulation")

FEDERATION = "simulation"
ADMIN = "simulator"
# A job with nothing in flight and no new event for this many round deadlines (and at least STALL_MIN_S of
# simulated time) is waiting for something its virtual sites will never do: the simulation says so and ends.
STALL_DEADLINES, STALL_MIN_S = 3, 600.0
_REQUESTS = {"Join": fpb.JoinRequest, "FetchModel": fpb.FetchModelRequest, "SecAgg": fpb.SecAggMessage,
             "ReportResult": fpb.TaskResult}
_FEDERATION = fpb.DESCRIPTOR.services_by_name["Federation"]
_ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"]


def final_model(state: Path, job_id: str) -> dict[str, np.ndarray]:
    """The model a simulated job ended with (its last closed round), read from the simulation's state dir."""
    store = Store(Path(state) / "coordinator")
    try:
        return store.load_checkpoint(job_id, store.job(job_id).current_round)
    finally:
        store.close()


class SimulationError(PlexusError):
    """The simulation could not run (a worker died, a site could not join)."""


class _Parsed(Sequence):
    """Serialized messages of one type, each parsed when it is read: a client stream held in memory, which the
    servicer reads as such (coordinator.service.Inbound), not as a network stream that might stall. Chunk
    messages are read in place (simulation.inplace): their data is a view of the message, not a copy."""

    def __init__(self, kind, messages: list[bytes]):
        self._kind, self._messages = kind, messages

    def __len__(self) -> int:
        return len(self._messages)

    def __getitem__(self, index):
        message = self._messages[index]
        return chunk_in_place(message) or self._kind.FromString(message)


@dataclass
class _Task:
    site: str
    task_id: str
    start: float                 # virtual time it was granted
    deadline: float              # virtual
    compute_s: float
    synchronous: bool            # its job's rounds close on all answers or the deadline (the shortcut applies)
    down: int = 0                # bytes fetched
    arrival: float | None = None  # virtual time its answer reaches the coordinator
    parked: bool = False         # its answer waits for virtual time to reach `arrival`


@dataclass(order=True)
class _Held:
    arrival: float
    seq: int
    worker: int = field(compare=False)
    header: dict = field(compare=False)
    messages: list = field(compare=False)


@dataclass
class Outcome:
    """How the simulation ended: its last job (and every job in `jobs`), virtual and real time."""

    job_id: str
    status: str
    rounds: int
    simulated_s: float
    wall_s: float
    sites: int
    workers: int
    dropped: int
    jobs: list[tuple[str, str, int]]   # (job id, status, last round) of each job, in order
    round_wall_s: list[float]          # real seconds from the start to each round's close


class Simulator:
    """`jobs`: round configs (YAML), run one after the other as a coordinator runs its queue. `sites`: site name ->
    its SiteConfig (datasets and policy; kit, state dir and coordinator are the run's). `pool(count, logs,
    inbox, threads=)` makes the workers (simulation.pool.ProcessPool, or the Ray pool); `threads`: torch's in
    each (default: the cores shared out)."""

    def __init__(self, jobs: list[str], sites: dict[str, SiteConfig], state: Path, *, workers: int, pool,
                 profile: Profile = Profile(), agent: str = DEFAULT_AGENT, threads: int | None = None):
        if not sites:
            raise ConfigError("a simulation needs at least one site: give --site FILE or --data")
        self.jobs = list(jobs)
        for index, text in enumerate(self.jobs):
            job = parse_round_config(text, source=f"job {index + 1}")
            if job.mode == "split":
                raise ConfigError(f"job {job.name!r} is split learning (mode: split), which `plexus simulate` does not "
                                  "run yet: its sessions stream batch by batch to the server part; run it on a "
                                  "federation (`plexus demo` starts one on this machine)")
            if job.sites.min > len(sites):
                raise ConfigError(f"job {job.name!r} needs sites.min = {job.sites.min} sites and the simulation has "
                                  f"{len(sites)}; simulate more sites or lower sites.min")
        self._configs: dict[str, RoundConfig] = {}
        self.agent = agent   # the site agent class the workers run, as module:Class
        self.sites = dict(sorted(sites.items()))
        self.state = Path(state)
        self.workers = max(1, min(workers, len(self.sites)))
        # torch threads per worker: given, or the cores shared out (more would only fight over them)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.workers)
        self.profile = profile
        self._make_pool = pool
        self.now = 0.0
        self.epoch = time.time()   # virtual time 0, as wall time: the store's timestamps read from it
        self._inbox: queue.Queue = queue.Queue()
        self._worker_of = {site: i % self.workers for i, site in enumerate(self.sites)}
        self._rows: dict[str, dict[str, int]] = {}
        self._tasks: dict[str, _Task] = {}            # site -> its task in flight
        self._held: list[_Held] = []
        self._seq = itertools.count()
        self._free_at = dict.fromkeys(self.sites, 0.0)
        self._horizon = 0.0                           # the latest answer taken ahead of the clock (see above)
        self._answered = False                        # an answer reached the engine since its last tick
        self._served: dict[int, tuple[str, int]] = {}  # worker -> the served model it holds, its bytes (_fetch)
        self._serialized: tuple[str, list[bytes]] = ("", [])   # the served model last sent, as sent (_fetch)
        self.dropped = 0
        self.round_wall_s: list[float] = []   # real seconds from the start to each round's close, every job

    # setting up ---------------------------------------------------------------------------
    def _federation(self) -> None:
        """A CA, a coordinator and admin kit, and a kit and site.yaml per site, under STATE."""
        root = self.state / "pki"
        pki.init_federation(root, FEDERATION)
        pki.add_admin(root, ADMIN, role="operator")
        site_dir = self.state / "sites"
        kits = pki.add_sites(root, dict.fromkeys(self.sites, {}), durable=False)
        for (name, config), kit in zip(self.sites.items(), kits):
            home = site_dir / name
            home.mkdir(parents=True, exist_ok=True)
            local = SiteConfig(site=name, coordinator="simulation.invalid:1", kit=kit.resolve(),
                               state_dir=(home / "state").resolve(), datasets=config.datasets, policy=config.policy)
            (home / "site.yaml").write_text(dump_site_config(local))

    def _coordinator(self) -> None:
        root = self.state / "pki"
        kit = load_kit(root / pki.COORDINATOR_NAME)
        self.store = Store(self.state / "coordinator", clock=self._wall)
        crl = RevocationList(root / "crl.pem", kit.ca_pem, floor_file=self.state / "coordinator" / "crl-number")
        auth = Authenticator(crl)
        self.engine = Engine(self.store, federation=federation_of(kit.cert_pem), clock=self._wall,
                             monotonic=lambda: self.now)
        self.engine.online_window_s = math.inf   # a virtual site is online unless its profile drops it
        self.federation = FederationService(self.engine, auth, chunk_bytes=DEFAULT_CHUNK_BYTES, max_transfers=4)
        self.admin = AdminService(self.engine, auth, chunk_bytes=DEFAULT_CHUNK_BYTES)
        admin_kit = load_kit(root / "admins" / ADMIN)
        self.admin_stub = LocalStub(self.admin, _ADMIN, admin_kit.cert_pem, peer="simulator")
        self._stubs = {name: LocalStub(self.federation, _FEDERATION, load_kit(root / "sites" / name).cert_pem,
                                       peer=f"virtual site {name}") for name in self.sites}

    def _wall(self) -> float:
        return self.epoch + self.now

    # running ------------------------------------------------------------------------------
    def run(self, *, watch=None) -> Outcome:
        """Run the jobs to their end; `watch(admin_stub, job_id)` (in a thread) follows each as `job watch` does."""
        started = self._started = time.monotonic()
        self._federation()
        self._coordinator()
        job_ids: list[str] = []
        try:
            pool = self._make_pool(self.workers, self.state / "logs", self._inbox, threads=self.threads)
            try:
                for site, worker in self._worker_of.items():
                    pool.send(worker, {"op": "site", "site": site, "agent": self.agent,
                                       "config": str(self.state / "sites" / site / "site.yaml")})
                self._join_all(pool)
                for text in self.jobs:   # each once the one before has ended: the engine takes them in that order
                    job_ids.append(self.admin_stub.SubmitJob(admin_pb2.SubmitJobRequest(config_yaml=text)).job_id)
                    self._run_job(pool, job_ids[-1], watch)
            finally:
                pool.close()
            rows = [self.store.job(job_id) for job_id in job_ids]
        finally:
            self.store.close()
        outcome = Outcome(job_id=rows[-1].id, status=rows[-1].status, rounds=rows[-1].current_round,
                          simulated_s=self.now, wall_s=time.monotonic() - started, sites=len(self.sites),
                          workers=self.workers, dropped=self.dropped,
                          jobs=[(r.id, r.status, r.current_round) for r in rows], round_wall_s=self.round_wall_s)
        (self.state / "simulation.json").write_text(json.dumps(outcome.__dict__, indent=2) + "\n")
        return outcome

    def _join_all(self, pool) -> None:
        for site, worker in self._worker_of.items():
            pool.send(worker, {"op": "join", "site": site})
        pending = set(self.sites)
        while pending:
            worker, header, messages = self._next_frame()
            if header["op"] == "call":
                if header["method"] == "Join":
                    request = fpb.JoinRequest.FromString(messages[0])
                    self._rows[header["site"]] = dict(request.dataset_rows)
                self._reply(pool, worker, header, self._execute(header["site"], header["method"], messages))
            elif header["op"] == "done":
                if header["error"]:
                    raise SimulationError(f"site {header['site']} could not join: {header['error']}")
                pending.discard(header["site"])

    def _run_job(self, pool, job_id: str, watch) -> None:
        follower = None
        if watch is not None:
            follower = threading.Thread(target=watch, args=(self.admin_stub, job_id), daemon=True,
                                        name="simulation-watch")
            follower.start()
        try:
            self._loop(pool, job_id)
        finally:
            if follower is not None:
                self.engine.nudge()
                follower.join(timeout=30)

    def _job(self, job_id: str, config_yaml: str) -> RoundConfig:
        if job_id not in self._configs:
            self._configs[job_id] = parse_round_config(config_yaml, source=f"job {job_id}")
        return self._configs[job_id]

    def _loop(self, pool, job_id: str) -> None:
        job = self._job(job_id, self.store.job(job_id).config_yaml)
        tick_at, progress, last_event = self.now, self.now, 0
        stall_s = max(STALL_DEADLINES * job.sites.deadline_s, STALL_MIN_S)
        while True:
            while self._held and self._held[0].arrival <= self.now:
                held = heapq.heappop(self._held)
                self._answer(pool, held.worker, held.header, held.messages)
            if self.now >= tick_at or self._answered:   # an answer wakes the engine, as in a coordinator
                self._answered = False
                driver = self.engine.driver
                if driver is not None:
                    driver.prepare()
                tick_at = self.now + max(self.engine.tick(), 1e-3)
            if self.store.job(job_id).status in TERMINAL:
                return
            events = self.store.events_after(job_id, last_event)
            if events:
                last_event, progress = events[-1][0], self.now
                self.round_wall_s.extend(time.monotonic() - self._started for e in events if e.kind == "round_closed")
            elif self.now - progress > stall_s and not self._tasks and not self._held:
                raise SimulationError(f"job {job_id} made no progress for {stall_s:g} simulated seconds with no task "
                                      f"in flight; its sites ({len(self.sites)}) may not meet what it needs "
                                      f"(sites.min {job.sites.min}, the data set {job.data.dataset!r}, their "
                                      "policies): see `plexus job show --state` and the workers' logs")
            for site in self.sites:
                if site not in self._tasks and self._free_at[site] <= self.now:
                    self._poll(pool, site)
            self._settle(pool)
            self.now = max(self.now, self._horizon)
            if self._answered:
                continue   # the engine looks at the answers now
            upcoming = [tick_at, *(t for t in self._free_at.values() if t > self.now)]
            if self._held:
                upcoming.append(self._held[0].arrival)
            self.now = max(self.now, min(upcoming))

    def _poll(self, pool, site: str) -> None:
        task = self._stubs[site].NextTask(fpb.NextTaskRequest(wait_s=0))
        if task.kind == fpb.TASK_NONE:
            return
        deadline = task.deadline_unix_s - self.epoch
        kind = fpb.TaskKind.Name(task.kind)
        job = self._job(task.job_id, task.config_yaml)
        if self.profile.drops(site, job.seed or 0, task.round, kind):
            self.dropped += 1
            self._free_at[site] = max(self.now, deadline) + 1e-6   # back once the task it left is over
            log.info("virtual site %s drops out of %s of round %d (profile dropout)", site, kind, task.round)
            return
        self._tasks[site] = _Task(site, task.task_id, self.now, deadline,
                                  self.profile.compute_s(site, self._samples(site, task, job)),
                                  synchronous=job.asynchronous is None)
        pool.send(self._worker_of[site], {"op": "task", "site": site, "task": task.task_id},
                  [task.SerializeToString()])

    def _samples(self, site: str, task: fpb.Task, job: RoundConfig) -> int:
        """Training rows the task passes over (its compute, in the profile's terms); 0 for tasks that do not train."""
        trains = task.kind == fpb.TASK_TRAIN or (task.kind == fpb.TASK_SECAGG_ADVERTISE and job.asynchronous is None)
        if not trains:
            return 0
        steps = task.local_steps or job.train.steps
        if steps:
            return steps * job.train.batch_size
        return job.train.epochs * self._rows.get(site, {}).get(job.data.dataset, 0)

    def _settle(self, pool) -> None:
        """Serve the workers until every task in flight has ended or waits for virtual time."""
        while any(not t.parked for t in self._tasks.values()):
            worker, header, messages = self._next_frame()
            site = header["site"]
            task = self._tasks.get(site)
            if header["op"] == "done":
                self._tasks.pop(site, None)
                if task is not None:
                    self._free_at[site] = task.arrival if task.arrival is not None else self.now
                    if header["error"]:
                        log.warning("virtual site %s: its task ended with %s", site, header["error"])
                continue
            method = header["method"]
            if method not in ANSWERS:
                reply = self._execute(site, method, messages, worker=worker)
                if task is not None:   # the bytes the site would have fetched, whatever the worker holds
                    task.down += sum(map(len, messages)) + reply[0].get("bytes", sum(map(len, reply[1])))
                self._reply(pool, worker, header, reply)
                continue
            up = sum(map(len, messages))
            task.arrival = (task.start + self.profile.transfer_s(site, task.down, up=False) + task.compute_s
                            + self.profile.transfer_s(site, up, up=True))
            if task.synchronous and task.arrival <= task.deadline:
                self._horizon = max(self._horizon, task.arrival)
                now, self.now = self.now, max(self.now, task.arrival)   # its events carry its arrival time
                try:
                    self._answer(pool, worker, header, messages)
                finally:
                    self.now = now
            else:
                task.parked = True
                heapq.heappush(self._held, _Held(task.arrival, next(self._seq), worker, header, owned(messages)))
                pool.send(worker, {"op": "held", "call": header["call"]})   # its worker computes on meanwhile

    def _answer(self, pool, worker: int, header: dict, messages: list[bytes]) -> None:
        task = self._tasks.get(header["site"])
        if task is not None:
            task.parked = False
        self._answered = True
        self._reply(pool, worker, header, self._execute(header["site"], header["method"], messages))

    def _next_frame(self) -> tuple[int, dict, list[bytes]]:
        worker, header, messages = self._inbox.get()
        if header is None:
            raise SimulationError(messages[0])
        return worker, header, messages

    @staticmethod
    def _reply(pool, worker: int, call: dict, reply: tuple[dict, list[bytes]]) -> None:
        header, messages = reply
        pool.send(worker, {"op": "reply", "call": call["call"], **header}, messages)

    def _execute(self, site: str, method: str, messages: list[bytes], *, worker: int | None = None
                 ) -> tuple[dict, list[bytes]]:
        """One call of `site`'s to the coordinator's servicer; (reply header, reply messages)."""
        stub = self._stubs[site]
        try:
            if method == "SubmitUpdate":   # a stream in memory, each message parsed as it is read
                replies = [stub.SubmitUpdate(_Parsed(fpb.UpdateMessage, messages))]
            elif method == "FetchModel":
                return self._fetch(stub, fpb.FetchModelRequest.FromString(messages[0]), worker)
            else:
                replies = [getattr(stub, method)(_REQUESTS[method].FromString(messages[0]))]
        except grpc.RpcError as exc:
            return {"error": {"code": exc.code().name, "details": exc.details() or ""}}, []
        return {}, [r.SerializeToString() for r in replies]

    def _fetch(self, stub, request: fpb.FetchModelRequest, worker: int) -> tuple[dict, list[bytes]]:
        """A served model goes to each worker once: its header message names the model (digest, encoding,
        base), so a worker that holds the stream that header began gets the header alone (SiteHost.models), and
        the stream is serialized once for all workers."""
        stream = stub.FetchModel(request)
        try:
            head = next(stream).SerializeToString()
            key = hashlib.sha256(head).hexdigest()
            held, size = self._served.get(worker, ("", 0))
            if held == key:
                return {"cached": key, "bytes": size}, [head]
            if self._serialized[0] == key:   # another worker's copy: the same bytes, serialized once
                messages = self._serialized[1]
            else:
                messages = [head, *(m.SerializeToString() for m in stream)]
                self._serialized = (key, messages)
        finally:
            stream.close()
        size = sum(map(len, messages))
        self._served[worker] = (key, size)
        return {"cache": key, "bytes": size}, messages
