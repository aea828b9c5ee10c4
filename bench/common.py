"""Shared measurement plumbing for the side-by-side benchmark (Plexus and Flower measured the same way).

- Processes: every process a case starts is tracked with all its descendants (walked in /proc), and is
  ended by PID (SIGTERM, then SIGKILL after a grace period). Nothing is killed by name.
- Memory: a sampler thread reads VmHWM/VmRSS of every tracked process every 0.2 s. VmHWM is the kernel's
  own peak-RSS high-water mark, so short-lived children (Flower's per-message ClientApp/ServerApp
  processes) are captured as long as they live through one sample; "total" is the peak of the summed
  VmRSS over simultaneous samples.
- Loopback bytes: each case runs in its own network namespace (`unshare -n`, see run.py), so the
  namespace's `lo` counters in /proc/self/net/dev count exactly the federation's traffic and nothing
  else on the machine. Payload is estimated as bytes - packets * 66 (14 B link + 20 B IP + 32 B TCP
  header with timestamps); both are recorded.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

HEADER_BYTES = 66


def lo_counters() -> tuple[int, int]:
    """(bytes, packets) received on lo in this process's network namespace."""
    for line in Path("/proc/self/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            fields = rest.split()
            return int(fields[0]), int(fields[1])
    return 0, 0


def payload(delta_bytes: int, delta_packets: int) -> int:
    return max(0, delta_bytes - delta_packets * HEADER_BYTES)


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int, kids: dict[int, list[int]] | None = None) -> list[int]:
    kids = kids if kids is not None else _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _program(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        prog = argv[1] if len(argv) > 1 and argv[0].endswith(b"python") or b"python3" in argv[0] else argv[0]
        return Path(prog.decode(errors="replace")).name
    except (OSError, IndexError):
        return ""


def proc_mem_kb(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) in KiB; (0, 0) for a gone or zombie process."""
    hwm = rss = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    except OSError:
        pass
    return hwm, rss


def proc_pss_kb(pid: int) -> int:
    """Proportional set size in KiB (shared pages split among the processes that map them); 0 for a gone one."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Fleet:
    """The processes of one case, grouped by role, with a memory sampler."""

    def __init__(self, logs: Path, interval_s: float = 0.2):
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.roots: dict[str, subprocess.Popen] = {}
        self.role_of_root: dict[int, str] = {}
        self.peak_hwm: dict[int, int] = {}     # pid -> max VmHWM seen (KiB)
        self.role: dict[int, str] = {}
        self.name: dict[int, str] = {}          # pid -> program name, taken when first seen
        self.peak_total_rss_kb = 0
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True)
        self._lock = threading.Lock()

    def spawn(self, name: str, role: str, argv: list[str], env: dict | None = None, cwd: Path | None = None):
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
        log.close()
        with self._lock:
            self.roots[name] = proc
            self.role_of_root[proc.pid] = role
        return proc

    def start_sampling(self) -> None:
        self._thread.start()

    def sample(self) -> None:
        kids = _children_map()
        total = 0
        with self._lock:
            roots = list(self.role_of_root.items())
        for root, role in roots:
            for pid in descendants(root, kids):
                hwm, rss = proc_mem_kb(pid)
                if hwm == 0:
                    continue
                total += rss
                if pid not in self.role:
                    self.role[pid] = role
                    self.name[pid] = _program(pid)
                if hwm > self.peak_hwm.get(pid, 0):
                    self.peak_hwm[pid] = hwm
        self.peak_total_rss_kb = max(self.peak_total_rss_kb, total)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a process vanishing mid-walk; the next sample catches up
                pass

    def peak_mb(self, roles: set[str] | None = None) -> float:
        """Sum over processes of the given roles of their peak RSS (VmHWM), MiB."""
        return sum(h for pid, h in self.peak_hwm.items() if roles is None or self.role[pid] in roles) / 1024

    def check_alive(self, names: list[str] | None = None) -> None:
        for name, proc in self.roots.items():
            if (names is None or name in names) and proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every tracked process and descendant (by PID), then SIGKILL what is left."""
        try:
            self.sample()
        except Exception:
            pass
        self._stop.set()
        kids = _children_map()
        pids = []
        for proc in self.roots.values():
            pids.extend(descendants(proc.pid, kids))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.roots.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.roots.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def wait_until(predicate, timeout_s: float, what: str, fleet: Fleet | None = None, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if fleet is not None:
            fleet.check_alive()
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def tls_loopback_throughput(cert: Path, key: Path, ca: Path, client_cert: Path, client_key: Path,
                            total_bytes: int = 512 << 20, block: int = 1 << 20) -> float:
    """Bytes/s of one mutual-TLS stream over 127.0.0.1 (OpenSSL via Python's ssl), sender in a child process.

    This is the 'physical' rate one TCP+TLS connection moves bytes on this machine with the federation's
    own certificates (ECDSA P-256; cipher negotiated by OpenSSL, normally AES-GCM).
    """
    srv_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    srv_ctx.load_cert_chain(str(cert), str(key))
    srv_ctx.load_verify_locations(str(ca))
    srv_ctx.verify_mode = ssl.CERT_REQUIRED
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # child: the sender
        try:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.load_cert_chain(str(client_cert), str(client_key))
            ctx.load_verify_locations(str(ca))
            with socket.create_connection(("127.0.0.1", port)) as raw, \
                    ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                buf = os.urandom(block)
                sent = 0
                while sent < total_bytes:
                    s.sendall(buf)
                    sent += block
                s.recv(1)
        finally:
            os._exit(0)
    try:
        listener.settimeout(60)
        conn, _ = listener.accept()
        with srv_ctx.wrap_socket(conn, server_side=True) as s:
            got = 0
            buf = bytearray(block)
            start = None
            while got < total_bytes:
                n = s.recv_into(buf)
                if n == 0:
                    break
                if start is None:
                    start = time.perf_counter()
                got += n
            elapsed = time.perf_counter() - start
            s.sendall(b"x")
        return got / elapsed
    finally:
        listener.close()
        os.waitpid(pid, 0)
