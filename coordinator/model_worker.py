"""Build models in a separate worker process, so the coordinator never imports torch.

torch alone would cost the coordinator more resident memory than the whole
of its own working set (docs/performance.md), and model plug-ins are code the
coordinator need not host. The worker reads one JSON request per line on
stdin, writes the initial weights as a safetensors file, and answers one JSON
line. Nothing is pickled across the boundary.

Every call has a time limit and the worker's address space a cap while it
serves it: a build that takes too long is stopped (the worker is killed and
replaced), and one that needs more memory than the cap is refused, instead of
holding the coordinator up or taking its machine down.

    python -m coordinator.model_worker        (started by ModelWorker; not run by hand)
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from plexus.errors import ConfigError, PlexusError
from plexus.shutdown import exit_now
from plexus.text import bounded


@dataclass(frozen=True)
class ModelLimits:
    """What one call to the worker may take: `timeout_s` of time, and `memory_bytes` of address space."""

    timeout_s: float = 300.0
    memory_bytes: int = 8 << 30


_FIX_TIME = "use a smaller model, or raise model_build_timeout_s in the coordinator's config"
_FIX_MEMORY = "use a smaller model, or raise model_build_memory_bytes in the coordinator's config"


def end_child(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """End a worker that reads requests on its stdin: close that (it exits at EOF), then kill it if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_ending: set[threading.Thread] = set()   # end_child_later's threads still waiting for their child
_ending_lock = threading.Lock()


def end_child_later(proc: subprocess.Popen, then: Callable[[], None] = lambda: None) -> None:
    """end_child (then `then()`) on a thread of its own, for a caller that holds a lock others wait on: a worker
    finishes the operation it is in before it reads the end of its stdin. `wait_ended` joins these threads."""
    def run() -> None:
        try:
            end_child(proc)
            then()
        finally:
            with _ending_lock:
                _ending.discard(thread)
    thread = threading.Thread(target=run, name=f"end-child-{proc.pid}", daemon=True)
    with _ending_lock:
        _ending.add(thread)
    thread.start()


def wait_ended() -> None:
    """Wait for every child end_child_later is ending (each at most end_child's timeout, then killed)."""
    with _ending_lock:
        threads = list(_ending)
    for thread in threads:
        thread.join()


class ModelWorker:
    """A lazily started, reused worker process; thread-safe (one call at a time); restarted if it dies."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The worker process's id while one is started (the first call starts it), else None."""
        proc = self._proc
        return None if proc is None else proc.pid

    def build(self, name: str, args: dict, *, seed: int, out: Path, members: int = 0, split: dict | None = None,
              limits: ModelLimits = ModelLimits()) -> dict[str, np.ndarray]:
        """Initial weights of model `name` (an ensemble of `members` copies when ≥ 2) written to `out`
        (safetensors) and returned; ConfigError if invalid, too slow to build or too large for the cap. `split`
        ({variant, cuts}: a split-learning job's) is checked on the built model: the cuts exist and lie in order,
        and the model declares its input shape."""
        self._call({"op": "build", "name": name, "args": args, "seed": seed, "out": str(out), "members": members,
                    "split": split}, what=f"building model {name!r}", limits=limits)
        return load_file(str(out))

    def _call(self, message: dict, *, what: str, limits: ModelLimits) -> dict:
        timeout_s, memory_bytes = limits.timeout_s, limits.memory_bytes
        request = (json.dumps({**message, "what": what, "memory_bytes": memory_bytes}) + "\n").encode()
        with self._lock:
            for attempt in (1, 2):   # a worker that died since the last call is replaced once
                proc = self._ensure()
                try:
                    proc.stdin.write(request)
                    proc.stdin.flush()
                    break
                except OSError:   # BrokenPipeError: it was gone before this request
                    self._stop_locked()
                    if attempt == 2:
                        raise PlexusError("the model worker process exits as soon as it starts; see the "
                                          "coordinator log") from None
            line = self._read_line(proc, time.monotonic() + timeout_s)
            if line is None:
                self._end_locked(kill=True)
                raise ConfigError(f"{what} took longer than {timeout_s:g} s (model_build_timeout_s), so the model "
                                  f"worker was stopped; {_FIX_TIME}")
            if not line:   # this request took the worker down: do not send it again
                status = self._end_locked(kill=False)
                if status >= 0:
                    raise PlexusError(f"{what}: the model worker process exited (status {status}); its error is "
                                      "in the coordinator's log")
                raise ConfigError(f"{what}: the model worker process was killed ({signal.Signals(-status).name}), "
                                  "most likely for want of memory: the model needs more than the machine has or "
                                  f"model_build_memory_bytes ({_size(memory_bytes)}) allows; {_FIX_MEMORY}")
        reply = json.loads(line)
        if "error" in reply:
            raise ConfigError(reply["error"])
        return reply

    @staticmethod
    def _read_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
        """The worker's next reply line; b"" if it exited first, None if the deadline passed first."""
        fd, line = proc.stdout.fileno(), bytearray()
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if select.select([fd], [], [], remaining)[0]:
                data = os.read(fd, 1 << 16)
                if not data:
                    return b""
                line += data
        return bytes(line)

    def close(self) -> None:
        with self._lock:
            self._stop_locked()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            self._proc = subprocess.Popen([sys.executable, "-m", "coordinator.model_worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env)
        return self._proc

    def _end_locked(self, *, kill: bool) -> int:
        """Stop the worker (kill: at once; else it is exiting already) and return its exit status."""
        proc, self._proc = self._proc, None
        if not kill:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)   # it closed its end of the pipe: it is on its way out
        if proc.poll() is None:
            proc.kill()
        status = proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        return status

    def _stop_locked(self) -> None:
        if self._proc is not None:
            end_child(self._proc)
            self._proc.stdout.close()
            self._proc = None


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes, {nbytes / (1 << 30):.3g} GiB"


_SHARED = ModelWorker()


def shared_worker() -> ModelWorker:
    """One worker per coordinator process (several in-process coordinators share it)."""
    return _SHARED


@contextlib.contextmanager
def _address_space(limit: int):
    """The process's address space capped at `limit` bytes (RLIMIT_AS) for the duration, then restored."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _answer(request: dict) -> dict:
    from safetensors.numpy import save_file

    from plexus.models import build_model, state_to_numpy

    out = Path(request["out"])
    tmp = out.with_suffix(".building")
    try:
        model = build_model(request["name"], request["args"], seed=request["seed"], members=request.get("members", 0))
        if request.get("split"):
            from plexus.errors import ConfigError
            from plexus.split import cut_shapes, split

            try:
                cut_shapes(model, split(model, request["split"]["variant"], list(request["split"]["cuts"])))
            except ConfigError as exc:
                raise ConfigError(f"split: {exc}") from None
        state = state_to_numpy(model)
        save_file(state, str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"ok": True}


def _serve() -> int:
    # torch lives only in this process. Replies go to the original stdout; anything a model plug-in or
    # library prints goes to stderr (the coordinator's log), so it cannot break the protocol.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import plexus.models  # noqa: F401  (torch, imported once, before any cap)

    for line in sys.stdin:
        request = json.loads(line)
        what, limit = request["what"], request["memory_bytes"]
        too_large = (f"{what} needs more memory than the model worker may use: model_build_memory_bytes is "
                     f"{_size(limit)}, of which torch itself takes about 1 GiB; {_FIX_MEMORY}")
        try:
            with _address_space(limit):
                reply = _answer(request)
        except MemoryError:
            reply = {"error": too_large}
        except RuntimeError as exc:   # torch's allocator: "DefaultCPUAllocator: can't allocate memory: ..."
            text = str(exc)
            reply = {"error": f"{too_large} ({bounded(text, 400)})" if "allocate" in text else
                     bounded(f"{what} failed: RuntimeError: {text}")}
        except (ValueError, TypeError) as exc:   # ConfigError is a ValueError
            reply = {"error": bounded(str(exc))}
        except Exception as exc:   # a model plug-in's own error must not take the worker down
            reply = {"error": bounded(f"{what} failed: {type(exc).__name__}: {exc}")}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    exit_now(_serve())   # not sys.exit: torch's teardown would keep the parent waiting
