"""A simulation worker: the site agents of some virtual sites, run by the real `SiteAgent` code.

The simulator hands a worker its sites once and then their tasks. A task runs `SiteAgent.handle` in a thread
of its own with a stub whose calls travel back to the simulator as frames (simulation/frames.py) and wait for
its reply; the simulator answers them from the coordinator's own servicer. One task computes at a time: a
task waiting for a reply lets the next one compute, so a reply the simulator holds back (virtual time has not
reached it) never stalls the worker. A site's data is loaded once, by its agent, and kept for the run.

Run as `python -m simulation.worker`: frames in on stdin, frames out on stdout, logs on stderr.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import sys
import threading
from pathlib import Path

import grpc

from plexus.config import load_site_config
from plexus.inproc import LocalRpcError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from simulation.frames import read_frame, write_frame

log = logging.getLogger("plexus.simulation")

# The calls a task ends with: the site's answer, which reaches the coordinator at the task's virtual arrival.
ANSWERS = ("SubmitUpdate", "SecAgg", "ReportResult")
_REPLY_TYPES = {"Join": fpb.JoinReply, "FetchModel": fpb.ModelMessage, "SubmitUpdate": fpb.SubmitReply,
                "SecAgg": fpb.ResultReply, "ReportResult": fpb.ResultReply}


class SiteHost:
    """The virtual sites of one worker. `receive` takes the simulator's frames; `outgoing` gives this host's
    (calls, and `done` once a task or join has ended), None once closed. Thread-safe."""

    def __init__(self):
        self._configs: dict[str, dict] = {}
        self._agents: dict = {}
        self._waiting: dict[int, _Reply] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._compute = threading.Semaphore(1)
        self._out: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []

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
            waiting.give(header, messages)
        else:
            raise ValueError(f"unknown frame op {op!r}")

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
        try:
            agent = self._agent(site)
            calls = _Calls(self, site)
            if header["op"] == "join":
                calls.call("Join", agent.join_request())
            else:
                agent.handle(calls, fpb.Task.FromString(messages[0]))
        except Exception as exc:   # reported with the task; the site's log (stderr) has the traceback
            log.exception("site %s: %s failed", site, header["op"])
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self._compute.release()
        self._out.put(({"op": "done", "site": site, "of": header["op"], "task": header.get("task", ""),
                        "error": error}, []))

    def _agent(self, site: str):
        agent = self._agents.get(site)
        if agent is None:
            # torch and the site's code load with a worker's first task, once
            from site_agent.agent import SiteAgent

            spec = self._configs[site]
            config = dataclasses.replace(load_site_config(Path(spec["config"])), emulation=None)
            agent = self._agents[site] = SiteAgent(config)
        return agent

    def call(self, site: str, method: str, requests: list[bytes]) -> list[bytes]:
        """Send one call to the simulator and wait for its reply, computing nothing meanwhile."""
        reply = _Reply()
        with self._lock:
            call_id = next(self._ids)
            self._waiting[call_id] = reply
        self._out.put(({"op": "call", "call": call_id, "site": site, "method": method}, requests))
        self._compute.release()   # another task computes while this one waits
        try:
            header, messages = reply.wait()
        finally:
            self._compute.acquire()
        if "error" in header:
            raise LocalRpcError(grpc.StatusCode[header["error"]["code"]], header["error"]["details"])
        return messages


class _Reply:
    def __init__(self):
        self._done = threading.Event()
        self._value: tuple[dict, list[bytes]] | None = None

    def give(self, header: dict, messages: list[bytes]) -> None:
        self._value = (header, messages)
        self._done.set()

    def wait(self) -> tuple[dict, list[bytes]]:
        self._done.wait()
        return self._value


class _Calls:
    """The Federation stub a virtual site's agent calls: each call a frame to the simulator."""

    def __init__(self, host: SiteHost, site: str):
        self._host, self._site = host, site

    def call(self, method: str, request):
        messages = request if isinstance(request, list) else [request]
        replies = self._host.call(self._site, method, [m.SerializeToString() for m in messages])
        parsed = [_REPLY_TYPES[method].FromString(r) for r in replies]
        return iter(parsed) if method == "FetchModel" else parsed[0]

    def Join(self, request, timeout=None):
        return self.call("Join", request)

    def FetchModel(self, request, timeout=None):
        return self.call("FetchModel", request)

    def SubmitUpdate(self, messages, timeout=None):
        return self.call("SubmitUpdate", list(messages))

    def SecAgg(self, request, timeout=None):
        return self.call("SecAgg", request)

    def ReportResult(self, request, timeout=None):
        return self.call("ReportResult", request)


def main() -> int:
    """Serve one simulator over stdin/stdout until it says stop or goes away."""
    from plexus.logs import configure

    configure("text", os.environ.get("PLEXUS_LOG", "INFO"))
    frames_in, frames_out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # a stray print must not land among the frames
    host = SiteHost()

    def send():
        while (frame := host.outgoing()) is not None:
            write_frame(frames_out, *frame)

    writer = threading.Thread(target=send, name="frames-out")
    writer.start()
    try:
        while (frame := read_frame(frames_in)) is not None and frame[0].get("op") != "stop":
            host.receive(*frame)
    finally:
        host.close()
        writer.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
