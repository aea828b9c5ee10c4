"""Secure aggregation's cost: one federation round with and without it, side by side.

    python -m bench.secagg_cost [--sizes 1M,10M] [--sites 4,8,16] [--rounds 3] [--out secagg.json]

Each (P, N) case runs plain and secure alternately, each in its own network namespace so loopback
byte counts are that federation's alone (see README.md). Round time = time between consecutive
round closes after the first round; bytes = loopback payload per round.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.run import label, netns_available, parse_size, run_child


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,10M")
    ap.add_argument("--sites", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    netns = netns_available()
    if not netns:
        print("note: no network namespaces here; loopback bytes include everything else on the machine")
    rows = []
    with tempfile.TemporaryDirectory(prefix="plexus-secagg-bench-") as tmp:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            for sites in (int(n) for n in args.sites.split(",")):
                pair = {}
                for secure in (False, True):
                    spec = {"kind": "plexus", "size": size, "sites": sites, "rounds": args.rounds, "chunks": 4,
                            "secure": secure, "workdir": str(Path(tmp) / f"{size}-{sites}-{secure}")}
                    pair[secure] = run_child(spec, netns=netns, timeout_s=1800)
                plain, secure = pair[False], pair[True]
                row = {"size": size, "sites": sites, "plain": plain, "secure": secure}
                rows.append(row)
                if "error" in plain or "error" in secure:
                    print(f"{label(size)}x{sites}: error: {plain.get('error') or secure.get('error')}", flush=True)
                    print((plain.get("stderr") or secure.get("stderr") or "")[-1500:])
                    continue
                t = secure["median_round_s"] / plain["median_round_s"]
                b = secure["bytes_per_round"] / plain["bytes_per_round"]
                print(f"{label(size):>4} x {sites:>2} sites  plain {plain['median_round_s']:7.3f}s "
                      f"{plain['bytes_per_round'] / 2**20:8.1f} MiB   secure {secure['median_round_s']:7.3f}s "
                      f"{secure['bytes_per_round'] / 2**20:8.1f} MiB   time x{t:.2f}  bytes x{b:.3f}  "
                      f"coordinator RSS {plain['coordinator_peak_rss_mb']:.0f} / "
                      f"{secure['coordinator_peak_rss_mb']:.0f} MB", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
