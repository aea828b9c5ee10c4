"""A userspace WAN emulator: one TCP relay per site, each direction shaped to a rate and delayed.

    python -m bench.wan --upstream 127.0.0.1:8443 [--listen 127.0.0.1:0] [--rate 20mbit] [--rtt 40ms]

Why userspace: this kernel has no `netem` qdisc, so the delay cannot come from `tc`; and one `tbf` on a
namespace's `lo` would shape every site and both directions together (one shared 20 Mbit/s), not a link per
site. So each site dials its own relay (127.0.0.1:port) instead of the coordinator, and the relay forwards
the raw TCP bytes (mutual TLS passes through untouched: the relay never sees plaintext) to the coordinator.

Each direction of a link is a FIFO: a chunk read from one side takes tokens from a token bucket of `rate`
bytes/s (burst `burst_bytes`; a chunk larger than the tokens left waits for them, so departures follow the
link's serialisation), then arrives `delay_s` (RTT/2) after it departed; chunks are written in the order
they were read, never reordered. The bytes a direction holds (queued or "in flight") are capped at the
link's bandwidth-delay product plus a 256 KiB queue, so a fast sender is held back by TCP, as a real
bottleneck would hold it, rather than buffered here without bound.

Every link counts the bytes it delivered each way (`up`: site -> coordinator, `down`: coordinator -> site):
TCP payload, i.e. TLS records, HTTP/2 framing and data. The rate applies to that payload too (a real link's
20 Mbit/s also carries the TCP/IP headers, ~3-5 % more).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass

READ_BYTES = 16 << 10        # one chunk: 6.5 ms of a 20 Mbit/s link, so delivery is smooth at that rate
QUEUE_BYTES = 256 << 10      # the bottleneck's queue, beyond the bytes in flight
UNSHAPED_BYTES = 4 << 20     # what an unlimited direction holds at most


@dataclass(frozen=True)
class Shape:
    """One direction of a link: a rate in bits/s (None: unlimited) and a one-way delay in seconds."""

    rate_bps: float | None = None
    delay_s: float = 0.0
    burst_bytes: int = READ_BYTES

    def __post_init__(self):
        if self.rate_bps is not None and not self.rate_bps > 0:
            raise ValueError(f"rate_bps must be > 0 or None (unlimited), got {self.rate_bps!r}")
        if not self.delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s!r}")
        if self.burst_bytes < 1:
            raise ValueError(f"burst_bytes must be >= 1, got {self.burst_bytes!r}")

    @classmethod
    def wan(cls, rate_bps: float | None, rtt_s: float) -> Shape:
        """A direction of a symmetric link with this round-trip time (each direction delays RTT/2)."""
        return cls(rate_bps=rate_bps, delay_s=rtt_s / 2)

    @property
    def hold_bytes(self) -> int:
        """The most bytes this direction holds: bandwidth × delay in flight, plus the queue."""
        if self.rate_bps is None:
            return UNSHAPED_BYTES
        return int(self.rate_bps / 8 * self.delay_s) + QUEUE_BYTES


class TokenBucket:
    """`rate` bytes/s, at most `burst` banked; a reservation larger than the tokens left runs into debt, repaid
    at the rate, so successive reservations depart one after another like bytes serialised onto a wire."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.at = clock()

    def reserve(self, n: int) -> float:
        """Take n bytes' worth of tokens; the clock time at which those bytes have left."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return now if self.tokens >= 0 else now + -self.tokens / self.rate


class Link:
    """One site's relay: listens on 127.0.0.1, forwards every connection to `upstream`, shapes, counts."""

    def __init__(self, name: str, upstream: tuple[str, int], up: Shape, down: Shape):
        self.name = name
        self.upstream = upstream
        self.shape = {"up": up, "down": down}
        # One bucket per direction, shared by every connection of the link (it is one wire).
        self.buckets: dict[str, TokenBucket | None] = {"up": None, "down": None}   # made on the loop (its clock)
        self.bytes = {"up": 0, "down": 0}
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        clock = asyncio.get_running_loop().time
        self.buckets = {d: None if s.rate_bps is None else TokenBucket(s.rate_bps / 8, s.burst_bytes, clock=clock)
                        for d, s in self.shape.items()}
        self.server = await asyncio.start_server(self._serve, host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _serve(self, site_r: asyncio.StreamReader, site_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            coord_r, coord_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            site_w.close()
            return
        for w in (site_w, coord_w):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pumps = [asyncio.create_task(self._pump("up", site_r, coord_w)),
                 asyncio.create_task(self._pump("down", coord_r, site_w))]
        try:
            done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() for t in done if not t.cancelled()):
                for t in pending:
                    t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except asyncio.CancelledError:   # Wan.close(): end quietly (asyncio would log a cancelled handler)
            for t in pumps:
                t.cancel()
        finally:
            for w in (site_w, coord_w):
                w.close()

    async def _pump(self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read -> reserve the link -> deliver after the delay, in order; half-close when the source does."""
        shape, bucket = self.shape[direction], self.buckets[direction]
        loop = asyncio.get_running_loop()
        queue: collections.deque = collections.deque()   # (delivery time on loop.time(), bytes or None: EOF)
        held = 0
        room, ready = asyncio.Event(), asyncio.Event()
        room.set()

        async def take():
            nonlocal held
            while True:
                await room.wait()
                data = await reader.read(READ_BYTES)
                if not data:
                    queue.append((0.0, None))
                    ready.set()
                    return
                departs = loop.time() if bucket is None else bucket.reserve(len(data))
                queue.append((departs + shape.delay_s, data))
                held += len(data)
                if held >= shape.hold_bytes:
                    room.clear()
                ready.set()

        async def deliver():
            nonlocal held
            while True:
                await ready.wait()
                at, data = queue.popleft()
                if not queue:
                    ready.clear()
                if data is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                self.bytes[direction] += len(data)
                held -= len(data)
                if held < shape.hold_bytes:
                    room.set()

        tasks = [asyncio.create_task(take()), asyncio.create_task(deliver())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
        for t in tasks:   # re-raise a failure (a reset connection) so the other direction is ended too
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()

    def counters(self) -> dict[str, int]:
        return dict(self.bytes)


class Wan:
    """The relays of one federation, on an event loop in a background thread. A context manager."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.links: dict[str, Link] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, name="plexus-bench-wan", daemon=True)

    def __enter__(self) -> Wan:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def link(self, name: str, upstream: tuple[str, int], *, up: Shape = Shape(), down: Shape = Shape(),
             host: str = "127.0.0.1", port: int = 0) -> int:
        """Open a relay to `upstream` named `name` (a site); the port it listens on."""
        if name in self.links:
            raise ValueError(f"link {name!r} exists already")
        link = Link(name, upstream, up, down)
        self.links[name] = link
        return self._call(link.start(host, port))

    def counters(self) -> dict[str, dict[str, int]]:
        """{link: {"up": bytes, "down": bytes}} delivered so far (read on the loop's thread: a consistent set)."""
        async def snap():
            return {name: link.counters() for name, link in self.links.items()}
        return self._call(snap())

    def totals(self) -> dict[str, int]:
        """Bytes delivered so far, summed over the links: {"up": ..., "down": ...}."""
        per = self.counters()
        return {d: sum(c[d] for c in per.values()) for d in ("up", "down")}

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop():
            for link in self.links.values():
                if link.server is not None:
                    link.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._call(stop(), timeout_s=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


_RATE_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str) -> float | None:
    """'20mbit', '20Mbit/s', '500kbit', '2e7' (bits/s) -> bits/s; 'none'/'unlimited' -> None."""
    t = text.strip().lower().removesuffix("/s").removesuffix("ps")
    if t in ("none", "unlimited", "inf"):
        return None
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([kmg]?bit)?", t)
    if not m:
        raise ValueError(f"rate {text!r}: write it like 20mbit, 500kbit or 2e7 (bits/s), or none")
    return float(m.group(1)) * _RATE_UNITS[m.group(2) or ""]


def parse_duration(text: str) -> float:
    """'40ms', '0.04s', '0.04' (s) -> seconds."""
    m = re.fullmatch(r"([0-9.]+)\s*(s|ms|us)?", text.strip().lower())
    if not m:
        raise ValueError(f"duration {text!r}: write it like 40ms or 0.04s")
    return float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="host:port every connection is forwarded to")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0: any free port)")
    ap.add_argument("--rate", default="20mbit", help="each direction's rate (e.g. 20mbit; none: unlimited)")
    ap.add_argument("--rtt", default="40ms", help="round-trip time; each direction delays half of it")
    args = ap.parse_args(argv)
    shape = Shape.wan(parse_rate(args.rate), parse_duration(args.rtt))
    host, port = _address(args.listen)
    with Wan() as wan:
        port = wan.link("relay", _address(args.upstream), up=shape, down=shape, host=host, port=port)
        print(f"relaying {host}:{port} -> {args.upstream} at {args.rate} each way, RTT {args.rtt}; Ctrl-C ends",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        c = wan.counters()["relay"]
        print(f"delivered: up {c['up']} bytes, down {c['down']} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
