"""Idle coordinator cost: CPU (fraction of one core) and context switches per second of a real coordinator
(`python -m plexus coordinator run`, mTLS on 127.0.0.1) while N sites are connected and long-polling
NextTask with no job to run. The goal is at most 1 % of a core for every N.

    python -m bench.idle_cpu [--sites 0,4,32] [--window 10] [--out idle.json]

The pollers are raw gRPC clients in this process (one thread and one channel per site, each with its own
site certificate), as cheap as a site can be, so only the coordinator's own cost is measured: its process
CPU time (utime + stime over all its threads, /proc/PID/stat) and the voluntary and involuntary context
switches summed over its threads (/proc/PID/task/*/status) across the window.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from plexus import pki, transport
from plexus.proto.plexus.v1 import federation_pb2 as fpb, federation_pb2_grpc

REPO = Path(__file__).resolve().parents[1]

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (every thread), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches summed over the process's live threads."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:   # the thread ended meanwhile
            continue
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def poll_forever(kit: Path, address: str, stop: threading.Event, joined: threading.Event) -> None:
    """One idle site: Join, then long-poll NextTask until stopped (the coordinator says how long to wait)."""
    with transport.channel(pki.load_kit(kit), address) as channel:
        stub = federation_pb2_grpc.FederationStub(channel)
        wait_s = stub.Join(fpb.JoinRequest(agent_version="bench-idle"), timeout=30).poll_timeout_s
        joined.set()
        while not stop.is_set():
            try:
                stub.NextTask(fpb.NextTaskRequest(wait_s=wait_s), timeout=wait_s + 15)
            except grpc.RpcError:
                if not stop.is_set():
                    raise


def measure(root: Path, sites: int, window_s: float) -> dict:
    coord_yaml = root / "coordinator" / "coordinator.yaml"
    env = dict(os.environ, PLEXUS_LOG="WARNING")
    state = root / "coordinator" / "state"
    (state / "coordinator.addr").unlink(missing_ok=True)
    log = open(root / f"coordinator-{sites}.log", "wb")
    # cwd: `python -m` puts it first on sys.path, so the coordinator runs this checkout's code.
    coordinator = subprocess.Popen([sys.executable, "-m", "plexus", "coordinator", "run", "--config", str(coord_yaml)],
                                   env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    stop, threads = threading.Event(), []
    try:
        addr_file = state / "coordinator.addr"
        deadline = time.monotonic() + 120
        while not (addr_file.exists() and addr_file.read_text().strip()):
            if coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start; see {log.name}")
            time.sleep(0.1)
        address = addr_file.read_text().strip()
        joined = []
        for i in range(sites):
            event = threading.Event()
            kit = root / "sites" / f"site-{i:02d}"
            thread = threading.Thread(target=poll_forever, args=(kit, address, stop, event), daemon=True)
            thread.start()
            threads.append(thread)
            joined.append(event)
        for event in joined:
            if not event.wait(60):
                raise RuntimeError("a site did not join within 60 s")
        time.sleep(2.0)   # settle: every poller is inside its long-poll
        cpu0, switches0, t0 = cpu_seconds(coordinator.pid), context_switches(coordinator.pid), time.monotonic()
        time.sleep(window_s)
        cpu1, switches1, t1 = cpu_seconds(coordinator.pid), context_switches(coordinator.pid), time.monotonic()
        elapsed = t1 - t0
        return {"sites": sites, "window_s": round(elapsed, 2), "cpu_core_fraction": (cpu1 - cpu0) / elapsed,
                "context_switches_per_s": (switches1 - switches0) / elapsed}
    finally:
        stop.set()
        coordinator.send_signal(signal.SIGTERM)
        try:
            coordinator.wait(20)
        except subprocess.TimeoutExpired:
            coordinator.kill()
            coordinator.wait()
        log.close()
        for thread in threads:
            thread.join(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="0,4,32", help="comma-separated numbers of idle sites")
    parser.add_argument("--window", type=float, default=10.0, help="measurement window in seconds")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    counts = [int(n) for n in args.sites.split(",")]
    with tempfile.TemporaryDirectory(prefix="plexus-idle-") as tmp:
        root = Path(tmp)
        pki.init_federation(root, "plexus-idle", hosts=["127.0.0.1"])
        coord_yaml = root / "coordinator" / "coordinator.yaml"
        coord_yaml.write_text(coord_yaml.read_text().replace('listen: "127.0.0.1:8443"', 'listen: "127.0.0.1:0"'))
        for i in range(max(counts)):
            pki.add_site(root, f"site-{i:02d}")
        results = []
        print(f"{'sites':>5}  {'CPU (core)':>10}  {'ctx switches/s':>14}", flush=True)
        for n in counts:
            row = measure(root, n, args.window)
            results.append(row)
            print(f"{n:>5}  {row['cpu_core_fraction']:>9.2%}  {row['context_switches_per_s']:>14.0f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["cpu_core_fraction"] <= 0.01 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
