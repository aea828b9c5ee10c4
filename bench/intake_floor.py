"""The coordinator's production intake of one update, alone: what a round of `plexus simulate` cannot go below.

    python -m bench.intake_floor [--sizes 1M,10M] [--repeats 7] [--out FILE]

One update of P float32 parameters (4 tensors, values ~0.01) arrives as 1 MiB chunks (the wire's default) and
goes through coordinator.intake.Upload.receive as the servicer hands it: the Receiver's checks (order, size,
finite), the journal (the spool file, flushed per chunk) and the exact fold into a WeightedSum. The parts are
also timed one by one. A simulated round of N sites takes at least N times the whole (the coordinator takes its
updates one at a time), whatever the transport between the workers and the coordinator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from coordinator.aggregate import WeightedSum
from coordinator.intake import Upload
from plexus.wire import DEFAULT_CHUNK_BYTES, Receiver, encode, iter_chunks

SIZES = {"1M": 1_000_000, "10M": 10_000_000}


def _median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(size: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    bounds = [size * i // 4 for i in range(5)]
    state = {f"parts.{i}": (rng.standard_normal(b - a) * 0.01).astype(np.float32)
             for i, (a, b) in enumerate(zip(bounds, bounds[1:]))}
    layout, blob = encode(state)
    chunks = list(iter_chunks(blob, DEFAULT_CHUNK_BYTES))
    max_abs = float(max(np.abs(a).max() for a in state.values()))
    total = WeightedSum(layout, sites=8)
    with tempfile.TemporaryDirectory() as spool:
        journal = Path(spool) / "update.spool"

        def checks():
            receiver = Receiver(layout)
            for offset, data in chunks:
                receiver.feed(offset, data)

        def journal_only():
            with open(journal, "wb") as fh:
                for _, data in chunks:
                    fh.write(data)
                    fh.flush()
            journal.unlink()

        def fold():
            entering = total.begin(100)
            for _, data in chunks:
                entering.add(data, max_abs)
            entering.finish()

        def whole():
            Upload(layout, journal, fold=total.begin(100)).receive(chunks)
            Upload(layout, journal).discard()

        figures = {name: _median_ms(run, repeats) for name, run in
                   (("checks_ms", checks), ("journal_ms", journal_only), ("fold_ms", fold), ("intake_ms", whole))}
    return {"size": size, "bytes": len(blob), "repeats": repeats, **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,10M", help="comma-separated: 1M, 10M")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {sorted(SIZES)}")
    cases = []
    for name in args.sizes.split(","):
        case = measure(SIZES[name], args.repeats)
        cases.append(case)
        print(json.dumps(case), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"what": "intake_floor", "command": "python -m bench.intake_floor " +
                                        " ".join(argv if argv is not None else sys.argv[1:]), "cases": cases},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
