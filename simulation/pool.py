"""Where the virtual sites run: worker processes on this machine, or Ray actors on a Ray cluster.

A pool hosts `count` workers (simulation/worker.py's SiteHost) and carries frames both ways: `send(worker,
header, messages)` to one, and every frame a worker sends lands on the simulator's `inbox` as (worker,
header, messages); a worker that ends unexpectedly puts (worker, None, [reason]) there. Large messages go
through shared memory (simulation/arena.py) both ways: a worker's answers reach the inbox as memoryviews,
the worker's again once the call is replied to or held (`arena.owned` copies them out); a large reply is
placed in the worker's down arena and freed when the worker says so.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from simulation import arena
from simulation.frames import read_frame, write_frame


class ProcessPool:
    """`count` processes running `python -m simulation.worker`, frames over their stdin and stdout, each one's
    log in `logs/worker-N.log`; torch trains with `threads` threads in each."""

    def __init__(self, count: int, logs: Path, inbox: queue.Queue, *, threads: int = 1):
        self.count, self._inbox = count, inbox
        self._procs: list[subprocess.Popen] = []
        self._locks: list[threading.Lock] = []
        self._readers: list[threading.Thread] = []
        self._arenas: list[arena.ArenaReader | None] = []   # each worker's answers (up), if shared memory is there
        self._down: list[arena.ArenaWriter | None] = []     # large replies to each worker
        self._closing = False
        logs.mkdir(parents=True, exist_ok=True)
        self._env = {**os.environ, "PLEXUS_SIMULATION_THREADS": str(threads)}
        try:
            for index in range(count):
                self._start(index, logs / f"worker-{index}.log")
        except BaseException:
            self.close()
            raise

    def _start(self, index: int, log_path: Path) -> None:
        env, fds = self._env, ()
        if arena.SUPPORTED:
            up, down = (arena.create(f"plexus-simulation-worker-{index}-{way}") for way in ("up", "down"))
            self._arenas.append(arena.ArenaReader(up))
            self._down.append(arena.ArenaWriter(down))
            env, fds = {**env, arena.ENV: str(up), arena.DOWN_ENV: str(down)}, (up, down)
        else:   # every message in its frame
            self._arenas.append(None)
            self._down.append(None)
        with open(log_path, "ab") as log:   # the child keeps its own descriptor
            proc = subprocess.Popen([sys.executable, "-m", "simulation.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=env, close_fds=True, pass_fds=fds)
        self._procs.append(proc)
        self._locks.append(threading.Lock())
        reader = threading.Thread(target=self._read, args=(index, proc, log_path, self._arenas[-1]), daemon=True,
                                  name=f"simulation-worker-{index}")
        self._readers.append(reader)
        reader.start()

    def _read(self, index: int, proc: subprocess.Popen, log_path: Path, shared: arena.ArenaReader | None) -> None:
        try:
            while (frame := read_frame(proc.stdout)) is not None:
                header, messages = frame
                if shared is not None and header.get("op") == "free":   # the worker parsed a reply in its down arena
                    self._down[index].release(int(header["call"]))
                    continue
                self._inbox.put((index, header, arena.messages_of(header, messages, shared)))
            reason = "it closed its output"
        except Exception as exc:   # FrameError, OSError, MemoryError...: the simulator must hear of it, not wait
            reason = f"its output could not be read ({type(exc).__name__}: {exc})"
        if not self._closing:
            try:
                status = f"exit status {proc.wait(timeout=5)}"
            except subprocess.TimeoutExpired:   # alive, but its frames cannot be trusted: close() ends it
                status = "still running"
            self._inbox.put((index, None, [f"simulation worker {index} (PID {proc.pid}) failed: {reason}, {status}; "
                                           f"its log is {log_path}"]))

    @property
    def shared_bytes(self) -> dict[str, int]:
        """The bytes that went through the workers' shared memory instead of their pipes: answers (up), replies
        (down)."""
        return {"up": sum(shared.read for shared in self._arenas if shared is not None),
                "down": sum(down.placed for down in self._down if down is not None)}

    def send(self, worker: int, header: dict, messages: list[bytes] = ()) -> None:
        down = self._down[worker]
        if down is not None and header.get("op") == "reply" and (where := down.place(header["call"], messages)):
            header, messages = {**header, "arena": where}, []
        with self._locks[worker]:
            write_frame(self._procs[worker].stdin, header, list(messages))

    def close(self) -> None:
        """Ask every worker to stop, wait for it (a few seconds), then end any still running."""
        self._closing = True
        for index, proc in enumerate(self._procs):
            try:
                with self._locks[index]:
                    write_frame(proc.stdin, {"op": "stop"})
                proc.stdin.close()
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        for proc in self._procs:
            proc.stdout.close()
        for shared in (*self._arenas, *self._down):
            if shared is not None:
                shared.close()
