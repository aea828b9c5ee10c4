"""bench.wan's relay: a shaped link takes about bytes / rate, a round trip takes at least the RTT, bytes arrive
intact and in order, and each direction is counted. The bands are wide: this runs on shared 2-core machines."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from bench.wan import Shape, TokenBucket, Wan, parse_duration, parse_rate

RATE = 20e6      # bits/s
RTT = 0.040      # s


class Server:
    """A one-connection TCP server on 127.0.0.1:0 in a thread: `handle(conn)` serves it."""

    def __init__(self, handle):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(handle,), daemon=True)
        self.thread.start()

    def _run(self, handle):
        try:
            conn, _ = self.sock.accept()
            with conn:
                conn.settimeout(10)
                self.result = handle(conn)
        except BaseException as exc:   # reported by join()
            self.error = exc

    def join(self):
        self.thread.join(10)
        self.sock.close()
        if self.error is not None:
            raise self.error
        return self.result


def sink(conn):
    """Read to EOF; answer with the SHA-256 of what came (32 bytes)."""
    digest, n = hashlib.sha256(), 0
    while chunk := conn.recv(1 << 16):
        digest.update(chunk)
        n += len(chunk)
    conn.sendall(digest.digest())
    return n


def echo(conn):
    while chunk := conn.recv(1 << 16):
        conn.sendall(chunk)


def test_a_2mb_transfer_through_20mbit_takes_about_0_8_s_and_arrives_intact():
    payload = os.urandom(2_000_000)
    server = Server(sink)
    with Wan() as wan:
        port = wan.link("site-a", ("127.0.0.1", server.port), up=Shape.wan(RATE, RTT), down=Shape.wan(RATE, RTT))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            t0 = time.perf_counter()
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while len(answer) < 32 and (chunk := s.recv(64)):
                answer += chunk
            elapsed = time.perf_counter() - t0
        assert server.join() == len(payload)
        assert answer == hashlib.sha256(payload).digest()   # every byte, in order
        # 2e6 bytes × 8 / 20e6 bits/s = 0.8 s, plus RTT/2 there and RTT/2 for the answer.
        assert 0.6 <= elapsed <= 1.6, elapsed
        deadline = time.monotonic() + 5
        while wan.counters()["site-a"]["down"] < 32 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert wan.counters() == {"site-a": {"up": len(payload), "down": 32}}


def test_a_small_echo_takes_at_least_the_rtt():
    server = Server(echo)
    with Wan() as wan:
        port = wan.link("site-b", ("127.0.0.1", server.port), up=Shape.wan(RATE, RTT), down=Shape.wan(RATE, RTT))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for i in range(5):
                t0 = time.perf_counter()
                s.sendall(b"ping %d" % i)
                got = b""
                while len(got) < 6:
                    got += s.recv(64)
                times.append(time.perf_counter() - t0)
                assert got == b"ping %d" % i
        server.join()
        assert min(times) >= RTT, times
        assert max(times) < RTT + 0.5, times
        assert wan.totals() == {"up": 30, "down": 30}


def test_an_unshaped_link_only_counts():
    server = Server(sink)
    with Wan() as wan:
        port = wan.link("site-c", ("127.0.0.1", server.port))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            t0 = time.perf_counter()
            s.sendall(b"x" * 1_000_000)
            s.shutdown(socket.SHUT_WR)
            assert len(s.recv(64)) > 0
            assert time.perf_counter() - t0 < 1.0
        assert server.join() == 1_000_000


def test_the_token_bucket_serialises_reservations_at_the_rate():
    now = [0.0]
    bucket = TokenBucket(1000.0, 100, clock=lambda: now[0])
    assert bucket.reserve(100) == 0.0            # the burst leaves at once
    assert bucket.reserve(500) == pytest.approx(0.5)
    assert bucket.reserve(500) == pytest.approx(1.0)
    now[0] = 5.0                                 # idle: tokens refill up to the burst only
    assert bucket.reserve(100) == 5.0
    assert bucket.reserve(100) == pytest.approx(5.1)


def test_rates_and_durations_parse():
    assert parse_rate("20mbit") == 20e6 and parse_rate("20Mbit/s") == 20e6 and parse_rate("500kbit") == 5e5
    assert parse_rate("2e7") == 2e7 and parse_rate("none") is None
    assert parse_duration("40ms") == pytest.approx(0.04) and parse_duration("0.5s") == 0.5
    with pytest.raises(ValueError):
        parse_rate("fast")
