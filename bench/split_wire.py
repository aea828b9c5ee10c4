"""Split learning against FedAvg on a real federation, each site behind its own network link: bytes per epoch per
site as the link's counters see them, site-side compute per epoch, the server's compute and hop, final accuracy.

    python -m bench.split_wire --data heart-disease --epochs 5 --out bench/results/split_wire.json
    python -m bench.split_wire --data fashion-mnist --epochs 1 --out bench/results/split_wire.json

Needs root (network namespaces and veth pairs). What runs:
- Network namespaces `plxb-coord` and `plxb-site-K` (K = 1..N), each with `lo` up; site K is wired to the
  coordinator's namespace by its own veth pair `plxb-cK` (coordinator side, 10.231.K.1/30) / `plxb-sK` (site side,
  10.231.K.2/30), `gso_max_segs 1` on both ends (unless --gso) so that the counters see every TCP segment as its
  own packet with its own headers, as a 1500-byte-MTU link carries it (Ethernet's preamble, gap and FCS, 24 bytes
  a frame, are not counted). Every namespace and process the bench made is removed at the end, on error and on
  Ctrl-C too.
- A federation PKI (plexus.pki) whose coordinator certificate names every 10.231.K.1; the coordinator as
  `plexus coordinator run` in plxb-coord, listening on 0.0.0.0:PORT there (its Prometheus port on 127.0.0.1 there);
  site K as `plexus site run --threads 1` in plxb-site-K, dialling 10.231.K.1:PORT.
- The admin side (submit, job status, reading the counters) is this script run again inside plxb-coord
  (`--_helper`), over 127.0.0.1 there, so admin traffic never crosses a site's veth.
- Per site, per job: the coordinator-side veth's rx_bytes (site -> coordinator, "up") and tx_bytes ("down") from
  /sys/class/net/plxb-cK/statistics, read at submit, at every change of the job's current_round (each epoch's
  close) and 2 s after the job ends. They count everything on the link: Ethernet/IP/TCP headers, TLS, HTTP/2, the
  sites' long polls, keepalives, the model fetches and the Split streams. An idle baseline (sites connected, no
  job) is measured first; its rate times each job's duration is reported and subtracted in its own column.
- From the coordinator's SQLite store after it stops: per site and epoch the "wire" metrics (the Split messages'
  protobuf payload bytes as the coordinator counted them), "train" site_compute_s, "eval" accuracy, the "split"
  server_compute_s / hop_s_per_batch / server_batches, and the tasks' issued -> finished times. FedAvg reports no
  compute time: its per-epoch site time is the training task's wall time (fetch, evaluation of the incoming model,
  one local epoch, upload), plus the same local epoch timed alone in this process after the federation stops
  (site_agent.training.train_local, 1 torch thread, each site's rows, job seed) as its site compute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODES = ("fedavg", "splitfed-u-shaped", "splitfed-vanilla", "sequential-u-shaped", "sequential-vanilla",
         "synchronous-u-shaped", "synchronous-vanilla")
CUTS = {"cnn": {"vanilla": ["block1"], "u-shaped": ["block1", "features"]},
        "mlp": {"vanilla": ["hidden1"], "u-shaped": ["hidden1", "hidden2"]}}
HOSPITALS = ("cleveland", "hungary", "switzerland", "va")
COORD_NS = "plxb-coord"
LR, MOMENTUM, BATCH = 0.02, 0.9, 32   # bench/split.py's SGD (lr 0.02, momentum 0.9); batch 32 (--batch) for every mode
REPO = Path(__file__).resolve().parent.parent


def site_ns(k: int) -> str:
    return f"plxb-site-{k}"


def coord_ip(k: int) -> str:
    return f"10.231.{k}.1"


def veth(k: int) -> str:
    return f"plxb-c{k}"


# ---------------------------------------------------------------------------------------------- the network


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def make_network(sites: int, segment: bool = True) -> None:
    remove_network(sites)   # leftovers of an interrupted run of this bench (its own names only)
    sh("ip", "netns", "add", COORD_NS)
    sh("ip", "-n", COORD_NS, "link", "set", "lo", "up")
    for k in range(1, sites + 1):
        ns = site_ns(k)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", veth(k), "netns", COORD_NS, "type", "veth", "peer", "name", f"plxb-s{k}", "netns", ns)
        sh("ip", "-n", COORD_NS, "addr", "add", f"{coord_ip(k)}/30", "dev", veth(k))
        sh("ip", "-n", ns, "addr", "add", f"10.231.{k}.2/30", "dev", f"plxb-s{k}")
        if segment:   # every TCP segment its own packet, as on a 1500-byte-MTU link (no 64 kB GSO packets)
            sh("ip", "-n", COORD_NS, "link", "set", veth(k), "gso_max_segs", "1")
            sh("ip", "-n", ns, "link", "set", f"plxb-s{k}", "gso_max_segs", "1")
        sh("ip", "-n", COORD_NS, "link", "set", veth(k), "up")
        sh("ip", "-n", ns, "link", "set", f"plxb-s{k}", "up")


def remove_network(sites: int) -> list[str]:
    """Delete this bench's namespaces (the veths go with them); the names that failed to go."""
    existing = set(sh("ip", "netns", "list", check=False).stdout.split())
    left = []
    for ns in [COORD_NS] + [site_ns(k) for k in range(1, max(sites, 64) + 1)]:
        if ns in existing and sh("ip", "netns", "del", ns, check=False).returncode != 0:
            left.append(ns)
    return left


# ---------------------------------------------------------------------------------------------- processes


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


class Procs:
    """Processes this bench started, each its own session (so its children, e.g. the coordinator's compute
    worker, go with it); stopped by their process group's ID, which is the PID we got."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, []

    def start(self, name: str, ns: str, *args: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                             env=child_env(), cwd=REPO, start_new_session=True)
        log.close()
        self.procs.append((name, p))
        return p

    def stop_all(self) -> None:
        for name, p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError, PermissionError):   # the group's stragglers
                os.killpg(p.pid, signal.SIGKILL)
        self.procs = []


# ---------------------------------------------------------------------------------------------- jobs


def job_yaml(mode: str, data: str, epochs: int, sites: int, seed: int, batch: int = BATCH) -> str:
    model = ("{name: cnn, args: {width: 16}}" if data == "fashion-mnist" else
             "{name: mlp, args: {in_features: 13, hidden: [32, 16], num_classes: 2}}")
    head = (f"name: wire-{mode}\nmodel: {model}\ndata: {{dataset: {data}}}\nrounds: {epochs}\n"
            f"sites: {{min: {sites}, deadline_s: 3600}}\nseed: {seed}\n")
    opt = f"optimizer: {{name: sgd, lr: {LR}, momentum: {MOMENTUM}}}"
    if mode == "fedavg":
        return head + f"strategy: {{name: fedavg}}\ntrain: {{epochs: 1, batch_size: {batch}, {opt}}}\n"
    schedule, variant = mode.split("-", 1)
    cuts = CUTS["cnn" if data == "fashion-mnist" else "mlp"][variant]
    return head + (f"mode: split\nsplit: {{variant: {variant}, cuts: [{', '.join(cuts)}], schedule: {schedule}, "
                   f"batch_timeout_s: 600}}\ntrain: {{batch_size: {batch}, {opt}}}\n")


def dataset_entry(data: str, k: int, sites: int, limit: int | None) -> dict:
    if data == "heart-disease":
        return {"kind": "heart-disease", "hospital": HOSPITALS[k - 1]}
    entry = {"kind": "fashion-mnist", "sites": sites, "index": k - 1, "alpha": 0.3}
    if limit:
        entry["limit"] = limit
    return entry


# ---------------------------------------------------------------------------------------------- the helper
# Runs inside plxb-coord: the admin client over 127.0.0.1 there, and the veths' counters of that namespace.


def counters(sites: int) -> dict[str, list[int]]:
    out = {"up": [], "down": [], "up_packets": [], "down_packets": []}
    for k in range(1, sites + 1):
        base = Path("/sys/class/net") / veth(k) / "statistics"
        read = lambda name: int((base / name).read_text())   # noqa: E731
        out["up"].append(read("rx_bytes"))
        out["down"].append(read("tx_bytes"))
        out["up_packets"].append(read("rx_packets"))
        out["down_packets"].append(read("tx_packets"))
    return out


def model_bytes(metrics_port: int) -> dict[str, float]:
    """The coordinator's own payload counter for model fetches and update uploads (plexus_model_bytes_total)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("plexus_model_bytes_total{"):
            direction = line.split('direction="', 1)[1].split('"', 1)[0]
            out[direction] = float(line.rsplit(" ", 1)[1])
    return out


def helper(spec_path: str) -> int:
    from plexus.admin_client import AdminClient

    spec = json.loads(Path(spec_path).read_text())
    sites, names = spec["sites"], spec["site_names"]
    out = {"idle": None, "jobs": []}
    with AdminClient(spec["address"], Path(spec["kit"]), timeout_s=30) as client:
        deadline = time.monotonic() + 120
        while {s.site for s in client.sites() if s.online} != set(names):
            if time.monotonic() > deadline:
                raise SystemExit(f"sites not online after 120 s: {[s.site for s in client.sites() if s.online]}")
            time.sleep(0.5)
        time.sleep(3)   # let the Joins' and first polls' bytes pass
        c0, t0 = counters(sites), time.time()
        print(f"[helper] idle baseline: {spec['idle_s']} s with {sites} sites connected, no job", flush=True)
        time.sleep(spec["idle_s"])
        c1, t1 = counters(sites), time.time()
        out["idle"] = {"seconds": t1 - t0, "before": c0, "after": c1}
        for job in spec["jobs"]:
            time.sleep(2)
            mb0 = model_bytes(spec["metrics_port"])
            snaps = [{"round": 0, "t": time.time(), **counters(sites)}]
            job_id = client.submit(job["yaml"]).job_id
            print(f"[helper] {job['mode']}: job {job_id} submitted", flush=True)
            current, status = 0, "queued"
            while True:
                summary = client.job(job_id).summary
                status = summary.status
                if summary.current_round != current:
                    current = summary.current_round
                    snaps.append({"round": current, "t": time.time(), **counters(sites)})
                    print(f"[helper] {job['mode']}: round {current} closed at {snaps[-1]['t'] - snaps[0]['t']:.1f} s",
                          flush=True)
                if status in ("completed", "failed", "aborted"):
                    break
                if time.time() - snaps[0]["t"] > spec["job_timeout_s"]:
                    client.abort(job_id)
                    status = "timed out (aborted)"
                    break
                time.sleep(0.1)
            ended = time.time()
            time.sleep(2)   # the last replies, TLS records and ACKs
            end = {"round": -1, "t": time.time(), **counters(sites)}
            mb1 = model_bytes(spec["metrics_port"])
            out["jobs"].append({"mode": job["mode"], "job_id": job_id, "status": status,
                                "message": client.job(job_id).summary.message, "submitted": snaps[0]["t"],
                                "ended": ended, "snapshots": snaps, "end": end,
                                "model_bytes": {d: mb1.get(d, 0) - mb0.get(d, 0) for d in ("in", "out")}})
            print(f"[helper] {job['mode']}: {status} in {ended - snaps[0]['t']:.1f} s", flush=True)
            Path(spec["result"]).write_text(json.dumps(out))
    Path(spec["result"]).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------------------- the store


def read_store(db: Path, job_id: str) -> dict:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        metrics = con.execute("SELECT round, site, kind, name, value FROM metrics WHERE job_id = ?",
                              (job_id,)).fetchall()
        tasks = con.execute("SELECT round, site, kind, status, issued, finished FROM tasks WHERE job_id = ?",
                            (job_id,)).fetchall()
        rounds = con.execute("SELECT round, kind, status, opened, closed FROM rounds WHERE job_id = ?",
                             (job_id,)).fetchall()
    return {"metrics": metrics, "tasks": tasks, "rounds": rounds}


def offline_fedavg_compute(data: str, sites: int, limit: int | None, seed: int, epochs: int) -> list[float]:
    """One FedAvg local epoch per site, timed alone in this process (1 torch thread): the site compute a FedAvg
    round costs, which FedAvg's sites do not report. Each site starts from the job's initial model."""
    import torch

    from plexus.config import DatasetSpec, parse_round_config
    from plexus.datasets import load_for_job
    from plexus.models import build_job_model
    from site_agent.training import train_local

    torch.set_num_threads(1)
    cfg = parse_round_config(job_yaml("fedavg", data, epochs, sites, seed))
    out = []
    for k in range(1, sites + 1):
        split = load_for_job(DatasetSpec(**dataset_entry(data, k, sites, limit)), cfg.data)
        if k == 1:   # warm-up (torch's first calls), untimed
            train_local(build_job_model(cfg), split.x_train[:256], split.y_train[:256], cfg.train, seed=seed)
        model = build_job_model(cfg)
        started = time.perf_counter()
        train_local(model, split.x_train, split.y_train, cfg.train, seed=seed)
        out.append(time.perf_counter() - started)
    return out


# ---------------------------------------------------------------------------------------------- summary


def summarize(job: dict, store: dict, idle: dict, sites: int, site_names: list[str], epochs: int,
              offline: list[float] | None) -> dict:
    snaps, end = job["snapshots"], job["end"]
    duration = job["ended"] - job["submitted"]
    idle_rate = {d: [(idle["after"][d][i] - idle["before"][d][i]) / idle["seconds"] for i in range(sites)]
                 for d in ("up", "down")}
    total = {d: [end[d][i] - snaps[0][d][i] for i in range(sites)] for d in ("up", "down", "up_packets",
                                                                              "down_packets")}
    per_epoch_raw = {d: sum(total[d]) / sites / epochs for d in ("up", "down")}
    idle_job = {d: sum(idle_rate[d]) / sites * (end["t"] - snaps[0]["t"]) / epochs for d in ("up", "down")}
    # Each closed epoch's bytes (snapshot at the round's close minus the previous one), mean over sites.
    closes = [s for s in snaps[1:] if s["round"] >= 1]
    epoch_bytes = []
    prev = snaps[0]
    for s in closes:
        epoch_bytes.append({d: sum(s[d][i] - prev[d][i] for i in range(sites)) / sites for d in ("up", "down")})
        prev = s
    m = store["metrics"]

    def per_round(kind: str, name: str, site: str | None = None) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for r, s, k, n, v in m:
            if k == kind and n == name and (site is None or s == site):
                out.setdefault(r, []).append(v)
        return out

    mean = lambda xs: sum(xs) / len(xs) if xs else None   # noqa: E731
    # Final accuracy: the last round's eval, weighted by the rows each site evaluated.
    acc_rows = {}
    for r, s, k, n, v in m:
        if k == "eval" and n in ("accuracy", "num_samples"):
            acc_rows.setdefault(r, {}).setdefault(s, {})[n] = v
    last = max(acc_rows) if acc_rows else None
    accuracy = None
    if last is not None:
        ev = [e for e in acc_rows[last].values() if "accuracy" in e and "num_samples" in e]
        accuracy = sum(e["accuracy"] * e["num_samples"] for e in ev) / sum(e["num_samples"] for e in ev)
    split = job["mode"] != "fedavg"
    wire = {}
    if split:
        for name in ("train_bytes_up", "train_bytes_down", "eval_bytes_up", "eval_bytes_down"):
            wire[name] = sum(sum(v) for v in per_round("wire", name).values()) / sites / epochs
        wire["payload_up"] = wire["train_bytes_up"] + wire["eval_bytes_up"]
        wire["payload_down"] = wire["train_bytes_down"] + wire["eval_bytes_down"]
    else:   # the coordinator's model-byte counter: updates in, models out (all sites together)
        wire["payload_up"] = job["model_bytes"]["in"] / sites / epochs
        wire["payload_down"] = job["model_bytes"]["out"] / sites / epochs
    compute = per_round("train", "site_compute_s")
    site_compute = mean([mean(v) for v in compute.values()]) if compute else None
    # Training tasks' wall time (issued -> finished) per site and epoch; split's training kind is split_train.
    train_kinds = ("split_train",) if split else ("train",)
    walls = [f - i for r, s, k, st, i, f in store["tasks"] if k in train_kinds and f is not None and i is not None]
    out = {
        "mode": job["mode"], "job_id": job["job_id"], "status": job["status"], "message": job["message"],
        "seconds": duration, "epochs_closed": len(closes),
        "netns_bytes_per_epoch_per_site": per_epoch_raw,
        "idle_bytes_per_epoch_per_site": idle_job,
        "netns_net_of_idle_per_epoch_per_site": {d: per_epoch_raw[d] - idle_job[d] for d in ("up", "down")},
        "netns_bytes_by_epoch": epoch_bytes,
        "netns_total_by_site": {site_names[i]: {d: total[d][i] for d in total} for i in range(sites)},
        "mean_packet_bytes": {d: sum(total[d]) / max(1, sum(total[f"{d}_packets"])) for d in ("up", "down")},
        "coordinator_payload_per_epoch_per_site": wire,
        "site_compute_s_per_epoch": site_compute,
        "site_compute_s_by_site": {s: mean([v for r, ss, k, n, v in m if k == "train" and n == "site_compute_s"
                                            and ss == s]) for s in site_names} if split else None,
        "fedavg_offline_site_compute_s_per_epoch": mean(offline) if (offline and not split) else None,
        "train_task_wall_s_per_epoch": mean(walls),
        "final_accuracy": accuracy, "final_eval_round": last,
    }
    if split:
        out["server_compute_s_per_epoch"] = mean([sum(v) for v in per_round("split", "server_compute_s").values()])
        out["hop_s_per_batch"] = mean([v[0] for v in per_round("split", "hop_s_per_batch").values()])
        out["server_batches_per_epoch"] = mean([v[0] for v in per_round("split", "server_batches").values()])
        out["site_batches_per_epoch"] = sum(sum(v) for v in per_round("train", "batches").values()) / epochs
    out["metrics"] = [list(x) for x in m]
    out["tasks"] = [list(x) for x in store["tasks"]]
    out["rounds"] = [list(x) for x in store["rounds"]]
    return out


def mb(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x / 1e6:,.2f}" if x >= 1e5 else f"{x / 1e3:,.1f} kB"


def table(rows: list[dict], data: str, epochs: int) -> str:
    lines = [f"{data}, {epochs} epoch(s), per site per epoch (mean over sites); MB = 10^6 bytes",
             "",
             "| mode | up, netns (MB) | down, netns (MB) | idle share | up, payload (MB) | down, payload (MB) | "
             "netns / payload | site compute (s) | train task wall (s) | server compute (s) | hop / batch (ms) | "
             "job wall / epoch (s) | final accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        raw, idle, pay = (r["netns_bytes_per_epoch_per_site"], r["idle_bytes_per_epoch_per_site"],
                          r["coordinator_payload_per_epoch_per_site"])
        share = (idle["up"] + idle["down"]) / max(1, raw["up"] + raw["down"])
        compute = r["site_compute_s_per_epoch"]
        if compute is None and r.get("fedavg_offline_site_compute_s_per_epoch") is not None:
            compute_s = f"{r['fedavg_offline_site_compute_s_per_epoch']:.3f}*"
        else:
            compute_s = "" if compute is None else f"{compute:.3f}"
        fmt = lambda v, f: "" if v is None else format(v, f)   # noqa: E731
        lines.append(
            f"| {r['mode']}{'' if r['status'] == 'completed' else ' (' + r['status'] + ')'} | {mb(raw['up'])} | "
            f"{mb(raw['down'])} | {share:.1%} | {mb(pay['payload_up'])} | {mb(pay['payload_down'])} | "
            f"{(raw['up'] + raw['down']) / max(1, pay['payload_up'] + pay['payload_down']):.3f} | {compute_s} | "
            f"{fmt(r['train_task_wall_s_per_epoch'], '.3f')} | {fmt(r.get('server_compute_s_per_epoch'), '.3f')} | "
            f"{fmt(None if r.get('hop_s_per_batch') is None else r['hop_s_per_batch'] * 1e3, '.2f')} | "
            f"{r['seconds'] / epochs:.1f} | "
            f"{fmt(None if r['final_accuracy'] is None else r['final_accuracy'] * 100, '.2f')} % |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def machine() -> dict:
    import torch

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "")
    commit = sh("git", "-C", str(REPO), "rev-parse", "HEAD", check=False).stdout.strip()
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "commit": commit, "loadavg_at_start": os.getloadavg()}


def run(args) -> int:
    from plexus import pki

    sites = args.sites
    if args.data == "heart-disease" and sites != 4:
        raise SystemExit("heart-disease has exactly 4 hospitals: --sites 4")
    if not 1 <= sites <= 250:
        raise SystemExit("--sites must be 1..250")
    modes = [m.strip() for m in args.modes.split(",")] if args.modes else list(MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; use {', '.join(MODES)}")
    if os.geteuid() != 0:
        raise SystemExit("network namespaces need root")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="plxb-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    print(f"work folder: {work}", flush=True)
    info = machine()
    started = time.time()

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):   # SIGINT too where a shell left it ignored
        signal.signal(signum, on_signal)
    procs = Procs(logs)
    site_names = list(HOSPITALS) if args.data == "heart-disease" else [f"site{k}" for k in range(1, sites + 1)]
    result_path = work / "helper.json"
    try:
        make_network(sites, segment=not args.gso)
        root = work / "pki"
        pki.init_federation(root, "plxb-bench", hosts=[coord_ip(k) for k in range(1, sites + 1)], port=args.port)
        admin = pki.add_admin(root, "bench", role="operator")
        coord_cfg = root / "coordinator" / "coordinator.yaml"
        text = coord_cfg.read_text()
        if f'listen: "0.0.0.0:{args.port}"' not in text:
            raise SystemExit(f"unexpected coordinator listen address in {coord_cfg}:\n{text}")
        coord_cfg.write_text(text + f'metrics_listen: "127.0.0.1:{args.metrics_port}"\n')
        for k, name in enumerate(site_names, start=1):
            kit = pki.add_site(root, name)
            entry = json.dumps(dataset_entry(args.data, k, sites, args.limit))
            (kit / "site.yaml").write_text(
                f'site: "{name}"\ncoordinator: "{coord_ip(k)}:{args.port}"\nkit: "."\nstate_dir: "./state"\n'
                f'datasets:\n  {args.data}: {entry}\npolicy: {{allowed_models: [cnn, mlp]}}\n')
        state = root / "coordinator" / "state"
        coordinator = procs.start("coordinator", COORD_NS, "-m", "plexus", "coordinator", "run", "--config",
                                  str(coord_cfg))
        deadline = time.monotonic() + 90
        while not (state / "coordinator.addr").exists():
            if coordinator.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the coordinator did not start; see {logs / 'coordinator.log'}")
            time.sleep(0.2)
        for k, name in enumerate(site_names, start=1):
            procs.start(f"site-{name}", site_ns(k), "-m", "plexus", "site", "run", "--config",
                        str(root / "sites" / name / "site.yaml"), "--threads", "1")
        spec = {"address": f"127.0.0.1:{args.port}", "kit": str(admin), "sites": sites, "site_names": site_names,
                "idle_s": args.idle_s, "metrics_port": args.metrics_port, "result": str(result_path),
                "job_timeout_s": args.job_timeout_s,
                "jobs": [{"mode": m, "yaml": job_yaml(m, args.data, args.epochs, sites, args.seed, args.batch)}
                         for m in modes]}
        (work / "helper-spec.json").write_text(json.dumps(spec, indent=1))
        helper_proc = subprocess.run(["ip", "netns", "exec", COORD_NS, sys.executable, "-m", "bench.split_wire",
                                      "--_helper", str(work / "helper-spec.json")], env=child_env(), cwd=REPO)
        if helper_proc.returncode != 0:
            raise SystemExit(f"the admin helper failed (exit {helper_proc.returncode}); logs in {logs}")
    finally:
        procs.stop_all()
        left = remove_network(sites)
        if left:
            print(f"could not delete namespaces: {left}", file=sys.stderr)
    helped = json.loads(result_path.read_text())
    offline = None
    if "fedavg" in modes and not args.no_offline:
        print("FedAvg: timing one local epoch per site in this process (1 thread)", flush=True)
        offline = offline_fedavg_compute(args.data, sites, args.limit, args.seed, args.epochs)
    db = work / "pki" / "coordinator" / "state" / "plexus.db"
    rows = [summarize(job, read_store(db, job["job_id"]), helped["idle"], sites, site_names, args.epochs, offline)
            for job in helped["jobs"]]
    idle = helped["idle"]
    idle_rate = {d: sum(idle["after"][d][i] - idle["before"][d][i] for i in range(sites)) / sites / idle["seconds"]
                 for d in ("up", "down")}
    report = table(rows, args.data, args.epochs)
    print()
    print(report)
    print(f"\nidle baseline: {idle_rate['up']:.0f} B/s up, {idle_rate['down']:.0f} B/s down per site "
          f"(over {idle['seconds']:.0f} s, sites connected, no job)")
    if offline is not None:
        print("* FedAvg site compute: one local epoch timed alone in this process after the run "
              f"(per site: {', '.join(f'{x:.4f}' for x in offline)} s)")
    entry = {"command": " ".join([os.path.basename(sys.executable), "-m", "bench.split_wire", *sys.argv[1:]]),
             "machine": info, "data": args.data, "sites": sites, "site_names": site_names, "epochs": args.epochs,
             "limit": args.limit, "seed": args.seed, "gso_max_segs_1": not args.gso, "lr": LR, "momentum": MOMENTUM,
             "batch_size": args.batch,
             "idle": {"seconds": idle["seconds"], "bytes_per_s_per_site": idle_rate,
                      "by_site": {site_names[i]: {d: idle["after"][d][i] - idle["before"][d][i]
                                                  for d in ("up", "down", "up_packets", "down_packets")}
                                  for i in range(sites)}},
             "note": args.note, "fedavg_offline_site_compute_s": offline, "wall_s": time.time() - started,
             "loadavg_at_end": os.getloadavg(), "modes": rows, "table": report,
             "jobs": {j["mode"]: yaml for j, yaml in zip(helped["jobs"], [s["yaml"] for s in spec["jobs"]])}}
    if args.out:
        out = Path(args.out)
        existing = json.loads(out.read_text()) if out.exists() else {}
        existing[args.data] = entry   # one file, one entry per dataset
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(existing, indent=1) + "\n")
        print(f"wrote {out} [{args.data}]")
    return 0 if all(r["status"] == "completed" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=("fashion-mnist", "heart-disease"), default="heart-disease")
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--epochs", type=int, default=None, help="default: 1 for fashion-mnist, 5 for heart-disease")
    p.add_argument("--modes", default="", help=f"comma-separated, default all: {','.join(MODES)}")
    p.add_argument("--out", default="")
    p.add_argument("--limit", type=int, default=None, help="fashion-mnist: the first N training images only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=BATCH, help=f"train.batch_size of every job (default {BATCH})")
    p.add_argument("--idle-s", type=float, default=60.0, help="idle baseline window (default 60 s)")
    p.add_argument("--port", type=int, default=18443)
    p.add_argument("--metrics-port", type=int, default=18444)
    p.add_argument("--job-timeout-s", type=float, default=1800.0)
    p.add_argument("--gso", action="store_true",
                   help="keep the veths' segmentation offload (then one counted packet may be a 64 kB GSO packet)")
    p.add_argument("--no-offline", action="store_true", help="skip timing FedAvg's local epoch in process")
    p.add_argument("--workdir", default="")
    p.add_argument("--note", default="", help="a remark stored with the results")
    p.add_argument("--show", default="", metavar="JSON", help="print the tables of an earlier --out file and exit")
    p.add_argument("--_helper", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._helper:
        return helper(args._helper)
    if args.show:
        for data, entry in json.loads(Path(args.show).read_text()).items():
            print(table(entry["modes"], data, entry["epochs"]) + "\n")
        return 0
    if args.epochs is None:
        args.epochs = 1 if args.data == "fashion-mnist" else 5
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted; processes stopped and namespaces removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
