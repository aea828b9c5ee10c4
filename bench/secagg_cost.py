"""Secure aggregation's cost: one federation round with and without it, side by side.

    python -m bench.secagg_cost [--sizes 1M,10M] [--sites 4,8,16] [--rounds 3] [--codec none,int8,randk]
                                [--randk-fraction 0.1] [--downlink delta8] [--out secagg.json]

Each (P, N) case runs plain and secure alternately, each in its own network namespace so loopback
byte counts are that federation's alone (see README.md). Round time = time between consecutive
round closes after the first round; bytes = loopback payload per round.

--codec runs the secure round once per uplink codec (compression.uplink; int8 masks in 8 bits, fp16 in
16, randk a fraction of the entries in 32) and compares each with the uncompressed secure round: the
whole round's bytes (the model download included, which the uplink codec does not shrink) and the
secure protocol's (shares, masked inputs, reveals: from the share phase's event to the round's close).
--downlink also serves the model compressed (fp16 or delta8) in every secure run but the uncompressed one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.run import label, netns_available, parse_size, run_child

SECURE_CODECS = ("none", "int8", "fp16", "randk")


def compression_of(codec: str, fraction: float, downlink: str) -> str | None:
    """The job's compression block for uplink `codec` and the downlink codec (None: no block at all, as before)."""
    parts = []
    if codec != "none":
        parts.append(f"uplink: {{codec: randk, fraction: {fraction}}}" if codec == "randk" else
                     f"uplink: {{codec: {codec}}}")
    if downlink != "none":
        parts.append(f"downlink: {{codec: {downlink}}}")
    return f"{{{', '.join(parts)}}}" if parts else None


def mib(value) -> str:
    return "—" if value is None else f"{value / 2**20:8.2f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,10M")
    ap.add_argument("--sites", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codec", default="none", help=f"uplink codecs of the secure runs, of {', '.join(SECURE_CODECS)}")
    ap.add_argument("--randk-fraction", type=float, default=0.1)
    ap.add_argument("--downlink", default="none", choices=("none", "fp16", "delta8"),
                    help="the served model's codec in the compressed secure runs (the baseline stays uncompressed)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    codecs = args.codec.split(",")
    unknown = sorted(set(codecs) - set(SECURE_CODECS))
    if unknown:
        ap.error(f"--codec {', '.join(unknown)}: secure aggregation takes {', '.join(SECURE_CODECS)}")
    if "none" not in codecs:
        codecs.insert(0, "none")   # the uncompressed secure round: what the others are compared with
    if args.downlink != "none":   # "none" stays the uncompressed baseline; its compressed-downlink run is its own
        codecs = ["none"] + [f"{c}+{args.downlink}" for c in codecs]
    netns = netns_available()
    if not netns:
        print("note: no network namespaces here; loopback bytes include everything else on the machine")
    rows = []
    with tempfile.TemporaryDirectory(prefix="plexus-secagg-bench-") as tmp:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            for sites in (int(n) for n in args.sites.split(",")):
                runs = {}
                for name in ["plain", *codecs]:
                    secure = name != "plain"
                    uplink, _, downlink = name.partition("+")
                    spec = {"kind": "plexus", "size": size, "sites": sites, "rounds": args.rounds, "chunks": 4,
                            "secure": secure, "workdir": str(Path(tmp) / f"{size}-{sites}-{name}"),
                            "compression": compression_of(uplink, args.randk_fraction, downlink or "none")
                            if secure else None}
                    runs[name] = run_child(spec, netns=netns, timeout_s=1800)
                row = {"size": size, "sites": sites, "plain": runs["plain"], "secure": runs["none"],
                       "codecs": {c: runs[c] for c in codecs}}
                rows.append(row)
                failed = [r for r in runs.values() if "error" in r]
                if failed:
                    print(f"{label(size)}x{sites}: error: {failed[0]['error']}", flush=True)
                    print((failed[0].get("stderr") or "")[-1500:])
                    continue
                plain, secure = runs["plain"], runs["none"]
                t = secure["median_round_s"] / plain["median_round_s"]
                b = secure["bytes_per_round"] / plain["bytes_per_round"]
                print(f"{label(size):>4} x {sites:>2} sites  plain {plain['median_round_s']:7.3f}s "
                      f"{plain['bytes_per_round'] / 2**20:8.1f} MiB   secure {secure['median_round_s']:7.3f}s "
                      f"{secure['bytes_per_round'] / 2**20:8.1f} MiB   time x{t:.2f}  bytes x{b:.3f}  "
                      f"coordinator RSS {plain['coordinator_peak_rss_mb']:.0f} / "
                      f"{secure['coordinator_peak_rss_mb']:.0f} MB", flush=True)
                for codec in codecs:
                    r = runs[codec]
                    ratios = "  ".join(
                        f"{what} x{r[key] / secure[key]:.3f}" for what, key in (
                            ("round", "bytes_per_round"), ("protocol", "protocol_bytes_per_round"))
                        if r.get(key) and secure.get(key))
                    name = codec.replace("randk", f"randk {args.randk_fraction:g}")
                    print(f"      secure {name:<10} {r['median_round_s']:7.3f}s  round {mib(r['bytes_per_round'])}  "
                          f"protocol {mib(r.get('protocol_bytes_per_round'))}   vs none: {ratios}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
