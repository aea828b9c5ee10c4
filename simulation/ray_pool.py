"""The virtual sites as Ray actors: `plexus simulate --backend ray [--ray-address ADDRESS]`.

Each actor hosts a SiteHost (simulation/worker.py), as a worker process does; frames (simulation/frames.py)
travel as one `bytes` object per call. Plexus hands Ray nothing else and parses what comes back as frames, but
Ray itself moves objects between its processes with pickle: run it only on a Ray cluster you control (your own
machines), never one that others can reach. Plexus must be installed on every node, at the same version.
"""

from __future__ import annotations

import io
import threading

from simulation.frames import read_frame, write_frame
from simulation.worker import SiteHost, set_threads

DRAIN_WAIT_S = 0.5   # how long one drain call waits for a first frame


def ray_pool(address: str | None):
    """A pool factory (as simulation.simulator.Simulator takes one) for Ray at `address` (None: a local Ray
    instance, started here and shut down with the pool)."""
    try:
        import ray  # noqa: F401 — the extra is optional: say how to get it before anything starts
    except ImportError:
        from plexus.errors import ConfigError

        raise ConfigError("--backend ray needs Ray: pip install 'plexus-fl[ray]'") from None

    def make(count, logs, inbox, *, threads: int = 1):
        return RayPool(count, inbox, address=address, threads=threads)
    return make


class _Host:
    """The actor: a SiteHost behind two calls, `receive(frame)` and `drain() -> frames`."""

    def __init__(self, threads: int):
        import logging

        logging.basicConfig(level=logging.WARNING)
        set_threads(threads)
        self.host = SiteHost()
        self._closed = False

    def receive(self, frame: bytes) -> None:
        header, messages = read_frame(io.BytesIO(frame))
        if header.get("op") == "stop":
            self.host.close()
            return
        self.host.receive(header, messages)

    def drain(self) -> list[bytes] | None:
        """The frames this host has sent since the last drain (waiting DRAIN_WAIT_S for one); None once closed."""
        import queue

        frames = []
        try:
            frame = self.host.outgoing(timeout=DRAIN_WAIT_S)
            while True:
                if frame is None:
                    return frames or None
                frames.append(_encode(*frame))
                frame[1].clear()   # the sender's list: an update's bytes go now, not when its task ends
                frame = self.host.outgoing(timeout=0)
        except queue.Empty:
            return frames


class RayPool:
    """`count` actors on the Ray cluster at `address`; each actor's frames are drained by a thread here."""

    def __init__(self, count: int, inbox, *, address: str | None, threads: int = 1):
        import ray

        self._ray = ray
        self._own = not ray.is_initialized()
        if self._own:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        available = int(ray.cluster_resources().get("CPU", 0))
        if count > available:
            if self._own:
                ray.shutdown()
            from plexus.errors import ConfigError

            raise ConfigError(f"--workers {count} is more than the Ray cluster's {available} CPUs; give --workers "
                              f"{max(available, 1)} or fewer")
        actor = ray.remote(num_cpus=1, max_concurrency=2)(_Host)
        self._actors = [actor.remote(threads) for _ in range(count)]
        self._inbox = inbox
        self._closing = False
        self._threads = [threading.Thread(target=self._drain, args=(i,), daemon=True, name=f"ray-drain-{i}")
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _drain(self, index: int) -> None:
        actor = self._actors[index]
        try:
            while (frames := self._ray.get(actor.drain.remote())) is not None:
                for frame in frames:
                    self._inbox.put((index, *read_frame(io.BytesIO(frame))))
        except Exception as exc:   # the actor died: the simulation ends with the reason
            if not self._closing:
                self._inbox.put((index, None, [f"Ray actor {index} ended: {type(exc).__name__}: {exc}"]))

    def send(self, worker: int, header: dict, messages: list[bytes] = ()) -> None:
        self._ray.get(self._actors[worker].receive.remote(_encode(header, list(messages))))

    def close(self) -> None:
        self._closing = True
        for actor in self._actors:
            try:
                self._ray.get(actor.receive.remote(_encode({"op": "stop"}, [])), timeout=60)
            except Exception:   # noqa: BLE001 — it is killed below either way
                pass
        for thread in self._threads:
            thread.join(timeout=10)
        for actor in self._actors:
            self._ray.kill(actor)
        if self._own:
            self._ray.shutdown()


def _encode(header: dict, messages: list[bytes]) -> bytes:
    out = io.BytesIO()
    write_frame(out, header, messages)
    return out.getvalue()
