"""Build models in a separate worker process, so the coordinator never imports torch.

torch alone costs the coordinator ~240 MB of resident memory, more than the
whole of its own working set, and model plug-ins are code the coordinator
need not host. The worker reads one JSON request per line on stdin, writes the
initial weights as a safetensors file, and answers one JSON line. Nothing is
pickled across the boundary.

    python -m coordinator.model_worker        (started by ModelWorker; not run by hand)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from plexus.errors import ConfigError, PlexusError

_TIMEOUT_S = 600


class ModelWorker:
    """A lazily started, reused worker process; thread-safe; restarted if it dies."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def build(self, name: str, args: dict, *, seed: int, out: Path, members: int = 0) -> dict[str, np.ndarray]:
        """Initial weights of model `name` (an ensemble of `members` copies when ≥ 2) written to `out`
        (safetensors) and returned; ConfigError if invalid."""
        self._call({"op": "build", "name": name, "args": args, "seed": seed, "out": str(out), "members": members})
        return load_file(str(out))

    def epsilon_after(self, rounds: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """plexus.accounting.epsilon_after (Opacus's RDP accountant), computed where torch may live."""
        return self._call({"op": "epsilon", "rounds": rounds, "noise_multiplier": noise_multiplier,
                           "sample_rate": sample_rate, "delta": delta})["epsilon"]

    def _call(self, message: dict) -> dict:
        request = json.dumps(message)
        with self._lock:
            for attempt in (1, 2):   # a worker that died since the last call is replaced once
                proc = self._ensure()
                try:
                    proc.stdin.write(request + "\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                except (BrokenPipeError, OSError):
                    line = ""
                if line:
                    break
                self._stop_locked()
                if attempt == 2:
                    raise PlexusError("the model worker process exited; see the coordinator log")
        reply = json.loads(line)
        if "error" in reply:
            raise ConfigError(reply["error"])
        return reply

    def close(self) -> None:
        with self._lock:
            self._stop_locked()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            self._proc = subprocess.Popen([sys.executable, "-m", "coordinator.model_worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        return self._proc

    def _stop_locked(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.stdin.close()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None


_SHARED = ModelWorker()


def shared_worker() -> ModelWorker:
    """One worker per coordinator process (several in-process coordinators share it)."""
    return _SHARED


def _serve() -> int:
    # torch lives only in this process.
    from safetensors.numpy import save_file

    from plexus.accounting import epsilon_after
    from plexus.models import build_model, state_to_numpy

    for line in sys.stdin:
        try:
            request = json.loads(line)
            if request["op"] == "epsilon":
                reply = {"epsilon": epsilon_after(request["rounds"], request["noise_multiplier"],
                                                  request["sample_rate"], request["delta"])}
            else:
                state = state_to_numpy(build_model(request["name"], request["args"], seed=request["seed"],
                                                   members=request.get("members", 0)))
                out = Path(request["out"])
                tmp = out.with_suffix(".building")
                save_file(state, str(tmp))
                os.replace(tmp, out)
                reply = {"ok": True}
        except (ValueError, TypeError) as exc:   # ConfigError is a ValueError
            reply = {"error": str(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
