"""Relays: N sites flat against R relays × N/R sites, every process on this machine (a real federation over mTLS on
127.0.0.1). Per case: the coordinator's model and update bytes per round (its own Prometheus counters, so relay↔site
traffic is not counted), the coordinator process's peak RSS, and the median round time.

    python -m bench.relays --sizes 1M,10M --sites 32 --relays 4 --rounds 4 --out bench/results/relays.json

The workload is bench/plexus_side's: the built-in `vector` model of P float32 parameters, FedAvg, every site
adding a constant and reporting 100 samples (bench/plexus_site.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import Fleet, wait_until
from bench.plexus_side import JOB

REPO = Path(__file__).resolve().parents[1]
_BYTES = re.compile(r'^plexus_model_bytes_total\{direction="(in|out)"\} (\S+)$', re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_bytes(port: int) -> tuple[float, float]:
    """The coordinator's (bytes in, bytes out) of update and model payloads so far."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = dict(_BYTES.findall(text))
    return float(found.get("in", 0)), float(found.get("out", 0))


def run_case(size: int, sites: int, relays: int, rounds: int, workdir: Path, *, timeout_s: float = 1800) -> dict:
    """relays 0: every site dials the coordinator; else `relays` relays of sites/relays sites each."""
    from plexus import pki
    from plexus.admin_client import AdminClient

    root = workdir / "pki"
    pki.init_federation(root, "plexus-bench", hosts=["127.0.0.1"])
    metrics_port = _free_port()
    coord_yaml = root / "coordinator" / "coordinator.yaml"
    coord_yaml.write_text(coord_yaml.read_text().replace('listen: "127.0.0.1:8443"', 'listen: "127.0.0.1:0"')
                          + f"poll_timeout_s: 10\nmetrics_listen: 127.0.0.1:{metrics_port}\n")
    admin = pki.add_admin(root, "bench-operator", role="operator")
    kits = [pki.add_site(root, f"site-{i:02d}") for i in range(sites)]
    relay_kits = [pki.add_relay(root, f"relay-{r}", hosts=["127.0.0.1"]) for r in range(relays)]
    fleet = Fleet(workdir / "logs")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PLEXUS_LOG=os.environ.get("PLEXUS_LOG",
                                                                                                  "WARNING"))
    result: dict = {"size": size, "sites": sites, "relays": relays, "rounds": rounds, "model_bytes": size * 4}
    try:
        fleet.spawn("coordinator", "coordinator", [sys.executable, "-m", "plexus", "coordinator", "run", "--config",
                                                   str(coord_yaml)], env=env, cwd=REPO)
        fleet.start_sampling()
        addr_file = root / "coordinator" / "state" / "coordinator.addr"
        address = wait_until(lambda: addr_file.exists() and addr_file.read_text().strip(), 120,
                             "the coordinator to listen", fleet)
        parents = []
        for r, kit in enumerate(relay_kits):
            port = _free_port()
            (kit / "bench-relay.yaml").write_text(
                f"parent: {address}\nlisten: 127.0.0.1:{port}\nkit: .\nstate_dir: ./state\npoll_timeout_s: 10\n"
                f"rejoin_grace_s: 0\ntier: {{sites_min: {sites // relays}, deadline_s: 600}}\n")
            fleet.spawn(kit.name, "relay", [sys.executable, "-m", "plexus", "relay", "run", "--config",
                                            str(kit / "bench-relay.yaml")], env=env, cwd=REPO)
            parents.append(f"127.0.0.1:{port}")
        for i, kit in enumerate(kits):
            dial = parents[i * relays // sites] if relays else address
            (kit / "site.yaml").write_text(
                f'site: "{kit.name}"\ncoordinator: "{dial}"\nkit: "."\nstate_dir: "./state"\n'
                "datasets: {bench: {kind: npz, path: unused.npz}}\n"
                "policy:\n  allowed_models: [vector]\n  require_secure_aggregation: false\n")
            fleet.spawn(kit.name, "site", [sys.executable, "-m", "bench.plexus_site", "--config",
                                           str(kit / "site.yaml")], env=env, cwd=REPO)
        children = relays or sites
        with AdminClient(address, admin, timeout_s=60) as client:
            wait_until(lambda: sum(s.online for s in client.sites()) >= children
                       and sum(len(s.children) for s in client.sites()) >= (sites if relays else 0), 600,
                       f"{children} children of the coordinator to join", fleet, every_s=0.5)
            job_id = client.submit(JOB.format(size=size, sites=children, rounds=rounds, chunks=4,
                                              deadline=600)).job_id
            closes: dict[int, tuple[float, tuple[float, float]]] = {}
            status = "unknown"
            for event in client.watch(job_id, timeout_s=timeout_s):
                status = event.summary.status
                if event.kind == "round_closed" and event.round <= rounds:
                    closes[event.round] = (time.time(), _model_bytes(metrics_port))
                if status in ("completed", "failed", "aborted"):
                    break
            detail = client.job(job_id)
            if detail.summary.status != "completed":
                raise RuntimeError(f"job ended {detail.summary.status}: {detail.summary.message}")
        train = sorted((r for r in detail.rounds if r.round <= rounds), key=lambda r: r.round)
        periods = [train[i].closed_unix_s - train[i - 1].closed_unix_s for i in range(1, len(train))]
        result["median_round_s"] = statistics.median(periods)
        per_round = [(closes[k][1][0] - closes[k - 1][1][0], closes[k][1][1] - closes[k - 1][1][1])
                     for k in range(2, rounds + 1) if k in closes and k - 1 in closes]
        result["coordinator_bytes_in_per_round"] = statistics.median(b for b, _ in per_round)
        result["coordinator_bytes_out_per_round"] = statistics.median(b for _, b in per_round)
        fleet.sample()
        result["coordinator_peak_rss_mb"] = fleet.peak_hwm.get(fleet.roots["coordinator"].pid, 0) / 1024
        result["relay_peak_rss_mb"] = max((fleet.peak_hwm.get(p.pid, 0) / 1024 for n, p in fleet.roots.items()
                                           if n.startswith("relay-")), default=0.0)
        return result
    finally:
        fleet.stop()


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1_000_000) if text.endswith("M") else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,10M")
    p.add_argument("--sites", type=int, default=32)
    p.add_argument("--relays", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.sites % args.relays:
        p.error("--sites must be a multiple of --relays")
    rows = []
    for size in map(_size, args.sizes.split(",")):
        for relays in (0, args.relays):
            with tempfile.TemporaryDirectory(prefix="plexus-bench-relays-") as work:
                row = run_case(size, args.sites, relays, args.rounds, Path(work))
            rows.append(row)
            shape = f"{args.relays} relays × {args.sites // args.relays}" if relays else f"{args.sites} flat"
            print(f"P={size:>10,} {shape:>16}: round {row['median_round_s']:.2f} s, coordinator in "
                  f"{row['coordinator_bytes_in_per_round'] / 1e6:.1f} MB / out "
                  f"{row['coordinator_bytes_out_per_round'] / 1e6:.1f} MB per round, peak RSS "
                  f"{row['coordinator_peak_rss_mb']:.0f} MB (relay {row['relay_peak_rss_mb']:.0f} MB)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
