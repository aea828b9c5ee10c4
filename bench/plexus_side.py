"""One Plexus case: a real federation over mTLS on 127.0.0.1 (coordinator + N site processes)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import Fleet, lo_counters, payload, wait_until

REPO = Path(__file__).resolve().parents[1]

JOB = """\
name: bench-{size}-{sites}
model: {{name: vector, args: {{size: {size}, chunks: {chunks}}}}}
data: {{dataset: bench}}
strategy: {{name: fedavg}}
rounds: {rounds}
sites: {{min: {sites}, deadline_s: {deadline}}}
seed: 0
"""


def make_pki(root: Path, sites: int, *, settings: dict | None = None):
    """A federation's PKI; `settings` are extra coordinator config keys (bench/run.py --set)."""
    from plexus import pki

    pki.init_federation(root, "plexus-bench", hosts=["127.0.0.1"])
    coord_yaml = root / "coordinator" / "coordinator.yaml"
    coord_yaml.write_text(coord_yaml.read_text().replace('listen: "127.0.0.1:8443"', 'listen: "127.0.0.1:0"')
                          + "poll_timeout_s: 10\n"
                          + "".join(f"{key}: {value}\n" for key, value in (settings or {}).items()))
    admin = pki.add_admin(root, "bench-operator", role="operator")
    kits = [pki.add_site(root, f"site-{i:02d}") for i in range(sites)]
    return coord_yaml, admin, kits


SECURE = "privacy: {secure_aggregation: true, secagg: {phase_timeout_s: 600}}\n"


def run_case(size: int, sites: int, rounds: int, workdir: Path, *, chunks: int = 4, timeout_s: float = 900,
             deadline_s: float = 600, secure: bool = False, settings: dict | None = None,
             compression: str | None = None) -> dict:
    """`compression`: the job's compression block as YAML flow (e.g. "{uplink: {codec: int8}}"); None: none."""
    from plexus.admin_client import AdminClient

    root = workdir / "pki"
    coord_yaml, admin_kit, kits = make_pki(root, sites, settings=settings)
    site_chunk = ["--chunk-bytes", str((settings or {})["chunk_bytes"])] if "chunk_bytes" in (settings or {}) else []
    fleet = Fleet(workdir / "logs")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PLEXUS_LOG=os.environ.get("PLEXUS_LOG", "WARNING"))
    result: dict = {"system": "plexus", "size": size, "sites": sites, "rounds": rounds, "chunks": chunks,
                    "model_bytes": size * 4, "secure": secure, "compression": compression}
    try:
        # cwd: `python -m` puts it first on sys.path, so every process runs this checkout's code
        # (bench/run.py --at-commit: the archived one), not the caller's cwd nor the editable install.
        fleet.spawn("coordinator", "coordinator",
                    [sys.executable, "-m", "plexus", "coordinator", "run", "--config", str(coord_yaml)], env=env,
                    cwd=REPO)
        fleet.start_sampling()
        addr_file = root / "coordinator" / "state" / "coordinator.addr"
        address = wait_until(lambda: addr_file.exists() and addr_file.read_text().strip(), 120,
                             "the coordinator to listen", fleet)
        t_sites = time.monotonic()
        for kit in kits:
            (kit / "site.yaml").write_text(
                f'site: "{kit.name}"\ncoordinator: "{address}"\nkit: "."\nstate_dir: "./state"\n'
                "datasets: {bench: {kind: npz, path: unused.npz}}\n"
                "policy:\n  allowed_models: [vector]\n  require_secure_aggregation: false\n")
            fleet.spawn(kit.name, "site", [sys.executable, "-m", "bench.plexus_site",
                                           "--config", str(kit / "site.yaml"), *site_chunk], env=env, cwd=REPO)
        with AdminClient(address, admin_kit, timeout_s=60) as client:
            wait_until(lambda: sum(s.online for s in client.sites()) >= sites, 300,
                       f"{sites} sites to join", fleet, every_s=0.25)
            result["join_s"] = time.monotonic() - t_sites
            lo0 = lo_counters()
            job_id = client.submit(JOB.format(size=size, sites=sites, rounds=rounds, chunks=chunks,
                                              deadline=deadline_s) + (SECURE if secure else "")
                                   + (f"compression: {compression}\n" if compression else "")).job_id
            closes: dict[int, tuple[float, tuple[int, int]]] = {}
            phases: dict[tuple[int, str], tuple[int, int]] = {}   # (round, "secagg_mask", ...) -> lo counters
            status = "unknown"
            end = time.monotonic() + timeout_s
            for event in client.watch(job_id, timeout_s=timeout_s):
                status = event.summary.status
                if event.kind == "round_closed" and event.round <= rounds:
                    closes[event.round] = (time.time(), lo_counters())
                elif event.kind.startswith("secagg_"):   # a secure round's next phase opened
                    phases[(event.round, event.kind)] = lo_counters()
                if status in ("completed", "failed", "aborted") or time.monotonic() > end:
                    break
            lo1 = lo_counters()
            detail = client.job(job_id)
            result["status"] = detail.summary.status
            result["message"] = detail.summary.message
            if detail.summary.status != "completed":
                raise RuntimeError(f"plexus job ended {detail.summary.status}: {detail.summary.message}")
        train = sorted((r for r in detail.rounds if r.round <= rounds), key=lambda r: r.round)
        engine_times = [r.closed_unix_s - r.opened_unix_s for r in train]
        periods = [train[i].closed_unix_s - train[i - 1].closed_unix_s for i in range(1, len(train))]
        result["round_open_to_close_s"] = engine_times
        result["round_period_s"] = periods
        # After the first round: rounds 2..R, each measured close(k-1) -> close(k), the same
        # definition as Flower's (time between consecutive end-of-round stamps).
        result["median_round_s"] = statistics.median(periods) if periods else engine_times[0]
        per_round = []
        for k in range(2, rounds + 1):
            if k in closes and k - 1 in closes:
                (b1, p1), (b0, p0) = closes[k][1], closes[k - 1][1]
                per_round.append(payload(b1 - b0, p1 - p0))
        result["loopback_payload_per_round"] = per_round
        result["bytes_per_round"] = statistics.median(per_round) if per_round else None
        if secure:
            # Within each round after the first, from the share phase opening (an event) to the round's close: the
            # secure protocol's bytes (shares, masked inputs, reveals), without the model download and the adverts
            # before it. (The mask phase's own event can reach this client after fast sites began uploading, so
            # the masked inputs are not split out by events.)
            protocol = [payload(closes[k][1][0] - phases[(k, "secagg_share")][0],
                                closes[k][1][1] - phases[(k, "secagg_share")][1])
                        for k in range(2, rounds + 1) if k in closes and (k, "secagg_share") in phases]
            result["protocol_bytes_per_round"] = statistics.median(protocol) if protocol else None
        result["loopback_job_total"] = payload(lo1[0] - lo0[0], lo1[1] - lo0[1])
        fleet.sample()
        # The coordinator process itself, and apart from it its model-worker child (torch lives
        # there, used at submit time only): the goal is about the process that holds the rounds.
        coordinator_pid = fleet.roots["coordinator"].pid
        result["coordinator_peak_rss_mb"] = fleet.peak_hwm.get(coordinator_pid, 0) / 1024
        result["coordinator_with_worker_peak_rss_mb"] = fleet.peak_mb({"coordinator"})
        result["model_worker_peak_rss_mb"] = result["coordinator_with_worker_peak_rss_mb"] - \
            result["coordinator_peak_rss_mb"]
        result["sites_peak_rss_mb"] = fleet.peak_mb({"site"})
        result["federation_peak_total_rss_mb"] = fleet.peak_total_rss_kb / 1024
        result["federation_sum_peak_rss_mb"] = fleet.peak_mb()
        return result
    finally:
        fleet.stop()
