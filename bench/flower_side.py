"""One Flower case: SuperLink + N SuperNodes (deployment engine, insecure, loopback) running
bench/flower_app via `flwr run`, measured exactly like the Plexus side.

The Flower venv lives in /tmp/plexus-bench-flwr-venv and is created here if missing
(python -m venv; pip install flwr numpy). It is never part of Plexus' own environment.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Fleet, lo_counters, payload, wait_until

VENV = Path(os.environ.get("PLEXUS_BENCH_FLWR_VENV", "/tmp/plexus-bench-flwr-venv"))
APP = Path(__file__).resolve().parent / "flower_app"
SUPERLINK_PORT = 8000          # fixed ports are safe: every case runs in its own network namespace
SUPERNODE_BASE_PORT = 9100


def ensure_venv(log=print) -> tuple[bool, str]:
    """(available, version or reason). Creates the venv on first use."""
    bins = [VENV / "bin" / b for b in ("flower-superlink", "flower-supernode", "flwr")]
    if not all(b.exists() for b in bins):
        log(f"installing Flower into its own venv {VENV} (python -m venv; pip install flwr numpy) ...")
        try:
            if not (VENV / "bin" / "python").exists():
                subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
            subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "flwr", "numpy"], check=True,
                           timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except (subprocess.SubprocessError, OSError) as exc:
            return False, f"could not install Flower into {VENV}: {exc}"
    try:
        out = subprocess.run([str(VENV / "bin" / "python"), "-c", "import flwr, numpy; print(flwr.__version__)"],
                             capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        return False, f"Flower venv {VENV} is broken: {exc}"
    return True, out


def _env(home: Path) -> dict:
    env = dict(os.environ)
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(key, None)
    env.update(PATH=f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}", FLWR_HOME=str(home),
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    return env


def run_case(size: int, sites: int, rounds: int, workdir: Path, *, chunks: int = 4, timeout_s: float = 900) -> dict:
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{SUPERLINK_PORT}"\n'
        "insecure = true\n")
    env = _env(home)
    stamps = workdir / "stamps.jsonl"
    app = workdir / "flower_app"   # a private copy: flwr builds the FAB from this folder
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    bin_ = VENV / "bin"
    fleet = Fleet(workdir / "logs")
    result: dict = {"system": "flower", "size": size, "sites": sites, "rounds": rounds, "chunks": chunks,
                    "model_bytes": size * 4}
    try:
        fleet.spawn("superlink", "superlink", [str(bin_ / "flower-superlink"), "--insecure",
                                               "--disable-runtime-dependency-installation",
                                               "--host", "127.0.0.1", "--port", str(SUPERLINK_PORT)],
                    env=env, cwd=workdir)
        fleet.start_sampling()
        wait_until(lambda: _listening(SUPERLINK_PORT), 120, "the SuperLink to listen", fleet, every_s=0.2)
        t_sites = time.monotonic()
        for i in range(sites):
            fleet.spawn(f"supernode-{i:02d}", "supernode",
                        [str(bin_ / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{SUPERLINK_PORT}",
                         "--port", str(SUPERNODE_BASE_PORT + i), "--node-config", f"partition-id={i}"],
                        env=env, cwd=workdir)
        wait_until(lambda: all(_listening(SUPERNODE_BASE_PORT + i) for i in range(sites)), 300,
                   f"{sites} SuperNodes to start", fleet, every_s=0.2)
        result["join_s"] = time.monotonic() - t_sites
        lo0 = lo_counters()
        run_cfg = (f'num-server-rounds={rounds} size={size} chunks={chunks} num-sites={sites} '
                   f'stamp-file="{stamps}"')
        fleet.spawn("flwr-run", "cli", [str(bin_ / "flwr"), "run", str(app), "bench", "--run-config", run_cfg,
                                        "--stream"], env=env, cwd=workdir)
        # Round boundaries: the ServerApp appends {"round": k, "t": ...} after round k's aggregation.
        seen: dict[int, tuple[float, tuple[int, int]]] = {}
        end = time.monotonic() + timeout_s
        while len(seen) < rounds + 1:
            if time.monotonic() > end:
                raise TimeoutError(f"flower run did not finish {rounds} rounds within {timeout_s:.0f}s")
            if stamps.exists():
                for line in stamps.read_text().splitlines():
                    rec = json.loads(line)
                    if rec["round"] not in seen:
                        seen[rec["round"]] = (rec["t"], lo_counters())
            if fleet.roots["flwr-run"].poll() is not None and len(seen) < rounds + 1:
                time.sleep(0.5)
                if not stamps.exists() or len(stamps.read_text().splitlines()) < rounds + 1:
                    tail = (workdir / "logs" / "flwr-run.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"flwr run ended before {rounds} rounds; its log ends:\n{tail}")
            fleet.check_alive([n for n in fleet.roots if n != "flwr-run"])
            time.sleep(0.02)
        lo1 = lo_counters()
        times = [seen[k][0] for k in range(rounds + 1)]
        periods = [times[k] - times[k - 1] for k in range(1, rounds + 1)]
        result["round_period_s"] = periods
        result["median_round_s"] = statistics.median(periods[1:]) if len(periods) > 1 else periods[0]
        per_round = []
        for k in range(2, rounds + 1):
            (b1, p1), (b0, p0) = seen[k][1], seen[k - 1][1]
            per_round.append(payload(b1 - b0, p1 - p0))
        result["loopback_payload_per_round"] = per_round
        result["bytes_per_round"] = statistics.median(per_round) if per_round else None
        result["loopback_job_total"] = payload(lo1[0] - lo0[0], lo1[1] - lo0[1])
        wait_until(lambda: fleet.roots["flwr-run"].poll() is not None, 60, "flwr run to exit", every_s=0.2)
        result["status"] = "completed"
        fleet.sample()
        # The "coordinator" of Flower is the SuperLink plus its SuperExec and the ServerApp it spawns.
        result["coordinator_peak_rss_mb"] = fleet.peak_mb({"superlink"})
        result["sites_peak_rss_mb"] = fleet.peak_mb({"supernode"})
        result["federation_peak_total_rss_mb"] = fleet.peak_total_rss_kb / 1024
        result["federation_sum_peak_rss_mb"] = fleet.peak_mb()
        result["server_processes"] = {f"{fleet.name.get(pid, '?')}[{pid}]": round(h / 1024, 1)
                                      for pid, h in fleet.peak_hwm.items() if fleet.role[pid] == "superlink"}
        return result
    finally:
        fleet.stop()


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1].decode(errors="replace")
    except (OSError, IndexError):
        return ""


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
