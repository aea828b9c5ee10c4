"""A simulation worker: the site agents of some virtual sites, run by the real `SiteAgent` code.

The simulator hands a worker its sites once and then their tasks. A task runs `SiteAgent.handle` in a thread
of its own with a stub whose calls travel back to the simulator as frames (simulation/frames.py) and wait for
its reply; the simulator answers them from the coordinator's own servicer. One task computes at a time; once
a task has sent its answer (the last thing it sends) the next one computes, so an answer the simulator holds
back until virtual time reaches it never stalls the worker (SiteHost.call says how many may wait). A site's
data is loaded by its agent with the first task and kept for the run.

Run as `python -m simulation.worker`: frames in on stdin, frames out on stdout, logs on stderr.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import os
import queue
import sys
import threading
import weakref
from pathlib import Path

import grpc

from plexus.config import load_site_config
from plexus.inproc import LocalRpcError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.shutdown import exit_now
from simulation.arena import DOWN_ENV, ENV as ARENA_ENV, MIN_BYTES, ArenaReader, ArenaWriter, messages_of
from simulation.frames import read_frame, write_frame
from simulation.inplace import chunk_in_place, serialized, update_bytes

log = logging.getLogger("plexus.simulation")

# The calls a task ends with: the site's answer, which reaches the coordinator at the task's virtual arrival.
ANSWERS = ("SubmitUpdate", "SecAgg", "ReportResult")
_REPLY_TYPES = {"Join": fpb.JoinReply, "SubmitUpdate": fpb.SubmitReply, "SecAgg": fpb.ResultReply,
                "ReportResult": fpb.ResultReply}


DEFAULT_AGENT = "site_agent.agent:SiteAgent"
ANSWERING = 2   # a worker's answers in the simulator's queue at once, held ones aside: one folds, one waits


def set_threads(threads: int) -> None:
    """The torch threads a virtual site trains with, as `plexus site run --threads` sets a real site's: the
    results of some layers (convolutions) depend on it, so a simulation meant to match a federation bit for bit
    uses the sites' count."""
    import torch

    torch.set_num_threads(threads)


def agent_class(name: str) -> type:
    """The SiteAgent (sub)class `module:Class` names: the real agent, or a benchmark's (bench/plexus_site.py).
    The simulator that started this worker names it; torch and the site's code load with it, once."""
    module, _, attr = name.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    from site_agent.agent import SiteAgent

    if not (isinstance(cls, type) and issubclass(cls, SiteAgent)):
        raise TypeError(f"{name} is not a SiteAgent class")
    return cls


class SiteHost:
    """The virtual sites of one worker. `receive` takes the simulator's frames; `outgoing` gives this host's
    (calls, and `done` once a task or join has ended), None once closed. Thread-safe."""

    def __init__(self, arena: ArenaWriter | None = None):
        self._arena = arena   # where answers' messages go instead of their frame (simulation/arena.py), if any
        self._configs: dict[str, dict] = {}
        self._agents: dict = {}
        self._waiting: dict[int, _Reply] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._compute = threading.Semaphore(1)
        self._holding = threading.local()   # whether this task thread holds `_compute`
        self._answering = threading.Semaphore(ANSWERING)
        self._out: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._model: tuple[str, list] = ("", [])   # the served model last fetched (see `models`)

    def receive(self, header: dict, messages: list[bytes]) -> None:
        op = header.get("op")
        if op == "site":
            self._configs[header["site"]] = header
        elif op in ("task", "join"):
            thread = threading.Thread(target=self._run, args=(header, messages), daemon=True,
                                      name=f"site-{header['site']}")
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        elif op == "reply":
            with self._lock:
                waiting = self._waiting.pop(header["call"])
            self._settled(header["call"])
            if header.get("shared") and messages and isinstance(messages[0], memoryview):
                # read in place in the down arena: the region is the simulator's again once nothing uses it
                weakref.finalize(messages[0].obj, self._free, header["call"]).atexit = False
            if "cache" in header or "cached" in header:   # a served model (`models`)
                header, messages = self._served(header, messages)
            waiting.give(header, messages)
        elif op == "held":
            with self._lock:
                waiting = self._waiting[header["call"]]
            self._settled(header["call"])
            waiting.hold()
        else:
            raise ValueError(f"unknown frame op {op!r}")

    def _served(self, header: dict, messages: list) -> tuple[dict, list]:
        """A served model's reply, parsed as it arrives: a later reply may refer to it (`cached`), and may reach a
        task that computes before the task this one is for (tasks wait for their replies without computing)."""
        try:
            parsed = self.models(header, messages)
        except Exception as exc:   # noqa: BLE001 (a reply it cannot parse: its caller raises it, the worker goes on)
            return {"error": {"code": "INTERNAL", "details": f"{type(exc).__name__}: {exc}"}}, []
        return {**header, "parsed": True}, parsed

    def _settled(self, call: int) -> None:
        """The simulator is done with the call's messages (it replied, or holds its own copy)."""
        if self._arena is not None:
            self._arena.release(call)

    def _free(self, call: int) -> None:
        """Nothing refers to a reply's messages in the down arena any more (a served model: once another has
        replaced it and its sites are done with it): its region is the simulator's again."""
        self._out.put(({"op": "free", "call": call}, []))

    def outgoing(self, timeout: float | None = None) -> tuple[dict, list[bytes]] | None:
        return self._out.get(timeout=timeout)

    def close(self) -> None:
        with self._lock:
            for waiting in self._waiting.values():
                waiting.give({"error": {"code": "CANCELLED", "details": "the simulation ended"}}, [])
        for thread in self._threads:
            thread.join(timeout=30)
        self._out.put(None)

    # a task ------------------------------------------------------------------------------
    def _run(self, header: dict, messages: list[bytes]) -> None:
        site, error = header["site"], ""
        self._compute.acquire()
        self._holding.value = True
        try:
            agent = self._agent(site)
            calls = _Calls(self, site)
            if header["op"] == "join":
                calls.Join(agent.join_request())
            else:
                agent.handle(calls, fpb.Task.FromString(messages[0]))
        except Exception as exc:   # reported with the task; the site's log (stderr) has the traceback
            log.exception("site %s: %s failed", site, header["op"])
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if self._holding.value:
                self._compute.release()
        self._out.put(({"op": "done", "site": site, "of": header["op"], "task": header.get("task", ""),
                        "error": error}, []))

    def _agent(self, site: str):
        agent = self._agents.get(site)
        if agent is None:
            spec = self._configs[site]
            config = dataclasses.replace(load_site_config(Path(spec["config"])), emulation=None)
            cls = agent_class(spec.get("agent", DEFAULT_AGENT))
            log.info("virtual site %s: %s.%s", site, cls.__module__, cls.__qualname__)
            agent = self._agents[site] = cls(config)
        return agent

    def call(self, site: str, method: str, requests: list[bytes]) -> tuple[dict, list[bytes]]:
        """Send one call to the simulator and wait for its reply. A task's answer (its update) is the last thing
        it sends: the next task computes from then on, while this one only waits and records. But only ANSWERING
        answers at a time may wait for the simulator to take them (it takes them one by one); those it holds
        back for virtual time (it says `held`) do not count. So a worker holds a few tasks' updates at a time
        (and those held), never one per site. While a task waits for any other reply (its model, most often),
        another task computes. `requests`: the call's messages (or their bytes), serialized here one by one as
        they come (`_placed`)."""
        reply = _Reply()
        with self._lock:
            call_id = next(self._ids)
            self._waiting[call_id] = reply
        header = {"op": "call", "call": call_id, "site": site, "method": method}
        if method not in ANSWERS:
            holding = getattr(self._holding, "value", False)
            if holding:   # another task computes while this one waits for its reply (a model, most often)
                self._compute.release()
            self._out.put((header, [serialized(m) for m in requests]))
            del requests
            header, messages = reply.wait()
            if holding:
                self._compute.acquire()
        else:
            self._answering.acquire()   # at most ANSWERING answers in the simulator's hands, not yet held
            try:
                where, requests = self._placed(call_id, requests)
            except BaseException:
                with self._lock:
                    self._waiting.pop(call_id, None)
                self._settled(call_id)
                self._answering.release()
                raise
            if where is not None:
                header["arena"] = where
            frame = (header, requests)
            del requests
            self._out.put(frame)
            del frame   # the writer drops it once written
            self._holding.value = False
            self._compute.release()
            reply.wait_held()
            self._answering.release()
            header, messages = reply.wait()
        if "error" in header:
            raise LocalRpcError(grpc.StatusCode[header["error"]["code"]], header["error"]["details"])
        return header, messages

    def _placed(self, call: int, requests) -> tuple[dict | None, list[bytes]]:
        """An answer's messages serialized one by one as they come: (where they lie in the up arena, []), or (None,
        their bytes) for a frame (no arena, or too small for it). An update whose header names its size goes
        straight into the arena, each message from the cache."""
        requests = iter(requests)
        first = next(requests, None)
        if first is None:
            return None, []
        size = update_bytes(first) if self._arena is not None else 0
        if size < MIN_BYTES:
            messages = [serialized(first), *(serialized(m) for m in requests)]
            where = None if self._arena is None else self._arena.place(call, messages)
            return where, [] if where is not None else messages
        placing = self._arena.stream(call, size)
        placing.add(serialized(first))
        for message in requests:
            placing.add(serialized(message))
        return placing.done(), []

    def models(self, header: dict, messages: list[bytes]) -> list:
        """A FetchModel reply, parsed: the simulator sends a served model to a worker once (`cache`: its
        key, the digest of its header message, which names the model, its encoding and base), and afterwards
        only its header with `cached`: the same key. One model is kept, the last."""
        if "cached" in header:
            key, parsed = self._model
            if key != header["cached"]:
                raise ValueError("the simulator referred to a model this worker does not hold")
            return parsed
        parsed = [chunk_in_place(m) or fpb.ModelMessage.FromString(m) for m in messages]   # its sites read in place
        if "cache" in header:
            self._model = (header["cache"], parsed)
        return parsed


class _Reply:
    """A call's reply, and whether the simulator holds the call back for a while first."""

    def __init__(self):
        self._cv = threading.Condition()
        self._value: tuple[dict, list[bytes]] | None = None
        self._held = False

    def give(self, header: dict, messages: list[bytes]) -> None:
        with self._cv:
            self._value = (header, messages)
            self._cv.notify_all()

    def hold(self) -> None:
        with self._cv:
            self._held = True
            self._cv.notify_all()

    def wait_held(self) -> bool:
        """Wait for the reply or word that it is held; True if held (and no reply yet)."""
        with self._cv:
            self._cv.wait_for(lambda: self._value is not None or self._held)
            return self._value is None

    def wait(self) -> tuple[dict, list[bytes]]:
        with self._cv:
            self._cv.wait_for(lambda: self._value is not None)
            return self._value


class _Calls:
    """The Federation stub a virtual site's agent calls: each call a frame to the simulator."""

    def __init__(self, host: SiteHost, site: str):
        self._host, self._site = host, site

    def call(self, method: str, messages):
        """`messages` (an update's stream) are serialized one by one as they come (SiteHost._placed): each goes
        from the agent's chunk to its bytes, and into the shared memory, while still in the processor's cache,
        and no message outlives its bytes (docs/performance.md, "The simulation moves each update ...")."""
        header, replies = self._host.call(self._site, method, messages)
        if method == "FetchModel":
            return iter(replies if header.get("parsed") else self._host.models(header, replies))
        return _REPLY_TYPES[method].FromString(replies[0])

    def Join(self, request, timeout=None):
        return self.call("Join", [request])

    def FetchModel(self, request, timeout=None):
        return self.call("FetchModel", [request])

    def SubmitUpdate(self, messages, timeout=None):
        return self.call("SubmitUpdate", messages)

    def SecAgg(self, request, timeout=None):
        return self.call("SecAgg", [request])

    def ReportResult(self, request, timeout=None):
        return self.call("ReportResult", [request])


def main() -> int:
    """Serve one simulator over stdin/stdout until it says stop or goes away."""
    from plexus.logs import configure
    from plexus.memory import set_up_simulation

    configure("text", os.environ.get("PLEXUS_LOG", "INFO"))
    set_up_simulation()   # before the tasks' threads
    set_threads(int(os.environ.get("PLEXUS_SIMULATION_THREADS", "1")))
    # Frames go to the original stdout, through a buffered writer of their own (sys.stdout.buffer is an unbuffered
    # FileIO under PYTHONUNBUFFERED=1, as in the images); anything printed, by Python or a library's C code, goes
    # to stderr (the worker's log), so it cannot land among the frames.
    frames_in, frames_out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    up, down = os.environ.get(ARENA_ENV), os.environ.get(DOWN_ENV)
    host = SiteHost(ArenaWriter(int(up)) if up else None)
    replies = ArenaReader(int(down)) if down else None

    def send():
        while (frame := host.outgoing()) is not None:
            write_frame(frames_out, *frame)
            frame[1].clear()   # the sender's list: an update's bytes go now, not when its task ends

    writer = threading.Thread(target=send, name="frames-out")
    writer.start()
    try:
        while (frame := read_frame(frames_in)) is not None and frame[0].get("op") != "stop":
            header, messages = frame
            if "arena" in header:   # a large reply, read in place from the down arena: freed once parsed
                header["shared"] = True
            host.receive(header, messages_of(header, messages, replies))
    finally:
        host.close()
        writer.join()
    return 0


if __name__ == "__main__":
    exit_now(main())   # not sys.exit: torch's teardown would keep the parent waiting
