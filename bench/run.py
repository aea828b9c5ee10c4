"""Plexus vs Flower, side by side, one command.

    python -m bench.run [--quick] [--sizes 1M,10M,50M] [--sites 2,8] [--rounds 5] [--out results.json]
                        [--scale] [--large] [--no-flower] [--chunks 4]

Each case (system, P, N) runs in a child process inside its own network namespace (`unshare -n`), so the
namespace's loopback counters count that federation's bytes and nothing else. Cases alternate
Plexus, Flower, Plexus, Flower ... See bench/README.md for the columns and caveats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plexus.config import MIN_SECURE_COHORT

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MARK = "@@BENCH-RESULT@@"
MB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KMG" else text) * mult)


def label(size: int) -> str:
    return f"{size / 1e6:g}M" if size >= 10 ** 6 else f"{size / 1e3:g}K"


# --- child side -------------------------------------------------------------------------------------
def child(spec: dict) -> dict:
    kind = spec["kind"]
    workdir = Path(spec["workdir"])
    if kind == "tls":
        from bench.common import tls_loopback_throughput
        from plexus import pki

        root = workdir / "tls-pki"
        pki.init_federation(root, "plexus-bench-tls", hosts=["127.0.0.1"])
        site = pki.add_site(root, "tls-probe")
        c = root / "coordinator"
        rates = [tls_loopback_throughput(c / "cert.pem", c / "key.pem", c / "ca.pem", site / "cert.pem",
                                         site / "key.pem", total_bytes=spec.get("bytes", 512 * MB))
                 for _ in range(spec.get("repeats", 3))]
        return {"tls_bytes_per_s": max(rates), "all": rates}
    if kind == "plexus":
        from bench import plexus_side

        return plexus_side.run_case(spec["size"], spec["sites"], spec["rounds"], workdir, chunks=spec["chunks"],
                                    secure=spec.get("secure", False), settings=spec.get("settings"),
                                    compression=spec.get("compression"))
    if kind == "flower":
        from bench import flower_side

        return flower_side.run_case(spec["size"], spec["sites"], spec["rounds"], workdir, chunks=spec["chunks"])
    if kind == "compression":
        from bench import compression

        return compression.run_case(spec)
    if kind == "aggregate":
        from bench import aggregate_speed

        return aggregate_speed.measure(spec["size"], repeats=spec.get("repeats", 3))
    raise ValueError(kind)


# --- parent side ------------------------------------------------------------------------------------
def netns_available() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    try:
        return subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_child(spec: dict, *, netns: bool, timeout_s: float) -> dict:
    argv = [sys.executable, "-m", "bench.run", "--case", json.dumps(spec)]
    if netns:
        argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()   # the case's own finally-block is gone with it; its Fleet children are in its session
        out, err = proc.communicate()
        return {"error": f"case timed out after {timeout_s:.0f}s", "stderr": err[-3000:]}
    for line in out.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"error": f"case exited with code {proc.returncode}", "stderr": (err or out)[-3000:]}


def fmt_s(v):
    return "—" if v is None else (f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s")


def fmt_mb(v):
    return "—" if v is None else f"{v:.0f} MB"


def fmt_bytes(v):
    return "—" if v is None else f"{v / MB:.1f} MiB"


def ratio(a, b):
    return "—" if a is None or b in (None, 0) else f"{a / b:.3f}"


def ok(flag):
    return "—" if flag is None else ("ok" if flag else "MISS")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1M and 10M with N=2 only")
    ap.add_argument("--sizes", default="1M,10M,50M")
    ap.add_argument("--sites", default="2,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=4, help="tensors per model (both systems)")
    ap.add_argument("--out", type=Path, default=Path("bench-results.json"))
    ap.add_argument("--no-flower", action="store_true", help="Plexus only")
    ap.add_argument("--scale", action="store_true",
                    help="also: Plexus round time and coordinator RSS for N in 2,8,16,32 (P=1M, 3 rounds)")
    ap.add_argument("--secure", action="store_true",
                    help="also: each case on Plexus with secure aggregation on (rows 'plexus+sa', and SA/plain)")
    ap.add_argument("--large", action="store_true",
                    help="also: Plexus with a 2.56 GB model (640M float32), 2 sites, 2 rounds")
    ap.add_argument("--case-timeout", type=float, default=1500)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                    help="a Plexus coordinator config key for every case, e.g. --set stream_window_bytes=262144 "
                         "--set max_transfers=4; chunk_bytes applies to the sites' uploads too (repeatable)")
    ap.add_argument("--at-commit", metavar="REV",
                    help="benchmark the product as committed at REV (git archive into a temp folder, plus this "
                         "bench/), not the working tree: stable numbers while others edit the tree")
    ap.add_argument("--case", help=argparse.SUPPRESS)   # one case's spec (JSON), in a child process
    args = ap.parse_args(argv)
    if args.at_commit:
        return rerun_at_commit(args.at_commit, argv if argv is not None else sys.argv[1:])

    if args.case:
        result = child(json.loads(args.case))
        print(MARK + json.dumps(result), flush=True)
        return 0

    settings = {}
    for item in args.settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--set {item!r}: expected KEY=VALUE, e.g. --set stream_window_bytes=262144")
        settings[key.strip()] = value.strip()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    site_counts = [int(n) for n in args.sites.split(",")]
    if args.quick:
        sizes, site_counts = [s for s in sizes if s <= 10 ** 7] or [10 ** 6, 10 ** 7], [2]
    workroot = Path(tempfile.mkdtemp(prefix="plexus-bench-"))
    netns = netns_available()
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    say(f"plexus bench: workdir {workroot}; {os.cpu_count()} CPUs; "
        f"{'private network namespace per case' if netns else 'NO netns: loopback counters are machine-wide'}")

    flower_ok, flower_info = False, "--no-flower given"
    if not args.no_flower:
        from bench import flower_side

        flower_ok, flower_info = flower_side.ensure_venv(say)
        say(f"flower: {'flwr ' + flower_info if flower_ok else 'SKIPPED: ' + flower_info}")

    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0], "netns": netns,
                    "flower": flower_info if flower_ok else None, "flower_skipped": None if flower_ok else flower_info,
                    "rounds": args.rounds, "chunks": args.chunks, "settings": settings, "cases": [], "extras": {}}
    n = [0]

    def case(spec, timeout=args.case_timeout):
        n[0] += 1
        spec = dict(spec, workdir=str(workroot / f"{n[0]:02d}-{spec['kind']}"), chunks=args.chunks,
                    settings=settings)
        Path(spec["workdir"]).mkdir(parents=True)
        t0 = time.monotonic()
        res = run_child(spec, netns=netns, timeout_s=timeout)
        res["wall_s"] = time.monotonic() - t0
        return res

    say("measuring loopback mutual-TLS throughput (3 × 512 MiB, federation certificates) ...")
    tls = case({"kind": "tls"}, timeout=600)
    tls_rate = tls.get("tls_bytes_per_s")
    report["tls"] = tls
    say(f"  loopback TLS: {tls_rate / 1e9:.2f} GB/s" if tls_rate else f"  FAILED: {tls}")

    say("aggregation micro-benchmark (WeightedSum.fold vs np.copyto, 50M float32) ...")
    agg = case({"kind": "aggregate", "size": 50_000_000}, timeout=900)
    report["extras"]["aggregate"] = agg
    if "ratio" in agg:
        say(f"  fold {agg['fold_gb_s']:.3f} GB/s, memcpy {agg['memcpy_gb_s']:.2f} GB/s, "
            f"ratio {agg['ratio']:.4f} (goal ≥ 0.5: {ok(agg['ratio'] >= 0.5)})")

    for size in sizes:
        for sites in site_counts:
            pair = {}
            for system in ("plexus", "plexus+sa", "flower"):
                if system == "flower" and not flower_ok or system == "plexus+sa" and not args.secure:
                    continue
                if system == "plexus+sa" and sites < MIN_SECURE_COHORT:   # refused: a sum over too few sites
                    say(f"case {label(size)} × {sites} sites: plexus+sa skipped (needs {MIN_SECURE_COHORT}+ sites)")
                    continue
                say(f"case {label(size)} × {sites} sites: {system} ...")
                res = case({"kind": system.split("+")[0], "size": size, "sites": sites, "rounds": args.rounds,
                            "secure": system == "plexus+sa"})
                res["system"] = system
                res.setdefault("size", size)
                res.setdefault("sites", sites)
                pair[system] = res
                if "error" in res:
                    say(f"  {system} FAILED: {res['error']}\n{res.get('stderr', '')[-1500:]}")
                else:
                    say(f"  median round {fmt_s(res['median_round_s'])}, coordinator peak "
                        f"{fmt_mb(res['coordinator_peak_rss_mb'])}, "
                        f"total {fmt_mb(res['federation_peak_total_rss_mb'])}, "
                        f"{fmt_bytes(res['bytes_per_round'])}/round  ({res['wall_s']:.0f}s wall)")
                report["cases"].append(res)
            args.out.write_text(json.dumps(report, indent=2))

    if args.scale:
        report["extras"]["scale"] = []
        for sites in (2, 8, 16, 32):
            say(f"scale: plexus 1M × {sites} sites, 3 rounds ...")
            res = case({"kind": "plexus", "size": 10 ** 6, "sites": sites, "rounds": 3})
            report["extras"]["scale"].append(res)
            if "error" in res:
                say(f"  FAILED: {res['error']}\n{res.get('stderr', '')[-1500:]}")
            else:
                say(f"  {res['sites']} separate site processes joined in {res['join_s']:.1f}s; "
                    f"median round {fmt_s(res['median_round_s'])}; coordinator peak "
                    f"{fmt_mb(res['coordinator_peak_rss_mb'])}")
            args.out.write_text(json.dumps(report, indent=2))
    if args.large:
        say("large: plexus 640M float32 (2.56 GB) × 2 sites, 2 rounds ...")
        res = case({"kind": "plexus", "size": 640_000_000, "sites": 2, "rounds": 2}, timeout=3600)
        report["extras"]["large"] = res
        args.out.write_text(json.dumps(report, indent=2))

    print_tables(report, tls_rate, say)
    args.out.write_text(json.dumps(report, indent=2))
    say(f"\nresults: {args.out.resolve()}  (logs and PKI of every case: {workroot})")
    return 0


def rerun_at_commit(rev: str, argv: list[str]) -> int:
    repo = REPO
    src = Path(tempfile.mkdtemp(prefix="plexus-bench-src-"))
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    shutil.rmtree(src / "bench", ignore_errors=True)
    shutil.copytree(HERE, src / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--at-commit":
            skip = True
        elif a.startswith("--out="):   # the rerun's cwd is src: results still land where the caller said
            rest += ["--out", a.removeprefix("--out=")]
        elif not a.startswith("--at-commit="):
            rest.append(a)
    out = [i for i, a in enumerate(rest) if a == "--out"]
    if not out:
        rest += ["--out", str(Path("bench-results.json").resolve())]
    else:
        rest[out[0] + 1] = str(Path(rest[out[0] + 1]).resolve())
    short = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], capture_output=True,
                           text=True).stdout.strip()
    print(f"benchmarking {rev} ({short}) from {src}", flush=True)
    return subprocess.run([sys.executable, "-m", "bench.run", *rest], cwd=src).returncode   # src's product first


def goals(p: dict, f: dict | None, tls_rate: float | None) -> dict:
    model = p["model_bytes"]
    must_move = 2 * p["sites"] * model
    floor = must_move / tls_rate if tls_rate else None
    g = {"floor_s": floor, "must_move": must_move}
    g["vs_flower"] = None if not f or "error" in f else p["median_round_s"] <= 0.05 * f["median_round_s"]
    g["vs_floor"] = None if floor is None else p["median_round_s"] <= 3 * floor + 0.05
    g["rss"] = p["coordinator_peak_rss_mb"] * MB <= 3 * model + 150 * MB
    g["wire"] = None if p.get("bytes_per_round") is None else p["bytes_per_round"] <= 1.05 * must_move
    return g


def print_tables(report: dict, tls_rate, say) -> None:
    by = {}
    for c in report["cases"]:
        by.setdefault((c["size"], c["sites"]), {})[c["system"]] = c
    say("\n" + "=" * 118)
    flower = f"flwr {report['flower']}" if report["flower"] else f"Flower skipped: {report['flower_skipped']}"
    say(f"Plexus vs Flower ({flower}); "
        f"{report['rounds']} rounds, trivial training, {report['chunks']} tensors; median round after the first; "
        f"loopback TLS {tls_rate / 1e9:.2f} GB/s" if tls_rate else "")
    head = f"{'case':<9}{'system':<10}{'round':>10}{'coord peak':>12}{'fed total':>11}{'bytes/round':>14}" \
           f"{'×(2·N·model)':>14}{'floor':>10}"
    say(head)
    say("-" * len(head))
    rows = []
    for (size, sites), pair in sorted(by.items()):
        p, sa, f = pair.get("plexus"), pair.get("plexus+sa"), pair.get("flower")
        g = goals(p, f, tls_rate) if p and "error" not in p else {}
        for name, r in (("plexus", p), ("plexus+sa", sa), ("flower", f)):
            if r is None:
                continue
            if "error" in r:
                say(f"{label(size) + '×' + str(sites):<9}{name:<10}  FAILED: {r['error']}")
                continue
            must = 2 * sites * r["model_bytes"]
            say(f"{label(size) + '×' + str(sites):<9}{name:<10}{fmt_s(r['median_round_s']):>10}"
                f"{fmt_mb(r['coordinator_peak_rss_mb']):>12}{fmt_mb(r['federation_peak_total_rss_mb']):>11}"
                f"{fmt_bytes(r['bytes_per_round']):>14}{ratio(r['bytes_per_round'], must):>14}"
                f"{fmt_s(g.get('floor_s')) if name == 'plexus' else '':>10}"
                + (f"   (+ model worker {fmt_mb(r['model_worker_peak_rss_mb'])})"
                   if r.get("model_worker_peak_rss_mb") else ""))
        if p and sa and "error" not in p and "error" not in sa:
            say(f"{'':<9}{'SA/plain':<10}{ratio(sa['median_round_s'], p['median_round_s']):>10}"
                f"{ratio(sa['coordinator_peak_rss_mb'], p['coordinator_peak_rss_mb']):>12}"
                f"{ratio(sa['federation_peak_total_rss_mb'], p['federation_peak_total_rss_mb']):>11}"
                f"{ratio(sa['bytes_per_round'], p['bytes_per_round']):>14}")
        if p and f and "error" not in p and "error" not in f:
            say(f"{'':<9}{'P/F':<10}{ratio(p['median_round_s'], f['median_round_s']):>10}"
                f"{ratio(p['coordinator_peak_rss_mb'], f['coordinator_peak_rss_mb']):>12}"
                f"{ratio(p['federation_peak_total_rss_mb'], f['federation_peak_total_rss_mb']):>11}"
                f"{ratio(p['bytes_per_round'], f['bytes_per_round']):>14}")
        if g:
            rows.append((label(size) + "×" + str(sites), g, p))
    say("\nGoals (Plexus):  round ≤ 0.05×Flower | round ≤ 3×floor+50ms | coord RSS ≤ 3×model+150MB | "
        "bytes/round ≤ 1.05×(2·N·model)")
    for name, g, p in rows:
        limit = (3 * p["model_bytes"] + 150 * MB) / MB
        floor_limit = 3 * g["floor_s"] + 0.05 if g["floor_s"] else None
        say(f"  {name:<9} {ok(g['vs_flower']):>5} | {ok(g['vs_floor']):>5} (≤ {fmt_s(floor_limit)}) | "
            f"{ok(g['rss']):>5} (≤ {limit:.0f} MB) | {ok(g['wire']):>5}")
    extras = report["extras"]
    if extras.get("aggregate", {}).get("ratio") is not None:
        a = extras["aggregate"]
        say(f"\nAggregation: WeightedSum.fold {a['fold_gb_s']:.3f} GB/s vs np.copyto {a['memcpy_gb_s']:.2f} GB/s "
            f"= {a['ratio']:.4f} (goal ≥ 0.5: {ok(a['ratio'] >= 0.5)})")
    if extras.get("scale"):
        say("\nScale (Plexus, P=1M, 3 rounds): N, join time of N site processes, median round, coordinator peak")
        for r in extras["scale"]:
            if "error" in r:
                say(f"  N={r.get('sites')}: FAILED {r['error']}")
            else:
                say(f"  N={r['sites']:>3}  join {r['join_s']:6.1f}s  round {fmt_s(r['median_round_s']):>9}  "
                    f"coord {fmt_mb(r['coordinator_peak_rss_mb']):>8}  status {r['status']}")
    if extras.get("large"):
        r = extras["large"]
        if "error" in r:
            say(f"\nLarge model: FAILED {r['error']}")
        else:
            limit = (3 * r["model_bytes"] + 150 * MB) / MB
            say(f"\nLarge model 2.56 GB × 2: {r['status']}, round {fmt_s(r['median_round_s'])}, coordinator peak "
                f"{fmt_mb(r['coordinator_peak_rss_mb'])} (bound {limit:.0f} MB: "
                f"{ok(r['coordinator_peak_rss_mb'] <= limit)})")


if __name__ == "__main__":
    sys.exit(main())
