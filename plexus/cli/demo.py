"""`plexus demo`: the command line of a whole local federation (the run itself is plexus.demo)."""

from __future__ import annotations

from pathlib import Path

from plexus.cli.common import UsageError, command, int_in


def add_commands(sub) -> None:
    """The `demo` command under the top-level subparsers `sub`."""
    demo = command(sub, "demo", _demo, help="run a whole local federation (4 hospitals, mTLS, heart disease)")
    demo.add_argument("--sites", type=_sites, default=4, help="number of hospitals, 1-4 (default 4)")
    demo.add_argument("--rounds", type=int_in(1), default=20, help="federated rounds (default 20)")
    demo.add_argument("--workdir", type=Path, help="keep PKI, state and logs here (default: a temp dir)")
    demo.add_argument("--plot", type=Path, metavar="FILE.png", help="also plot the job's metrics to this PNG")
    demo.add_argument("--secure-aggregation", action="store_true",
                      help="run the job with secure aggregation: the coordinator sees only the sum")


def _sites(text: str) -> int:
    from plexus.datasets import HOSPITALS

    return int_in(1, len(HOSPITALS), why=" (one site per hospital in the data)")(text)


def _demo(args) -> int:
    from plexus.config import MIN_SECURE_COHORT
    from plexus.demo import run_demo

    if args.secure_aggregation and args.sites < MIN_SECURE_COHORT:
        raise UsageError(f"--secure-aggregation needs --sites {MIN_SECURE_COHORT} or more: a sum over fewer "
                         "sites would tell the coordinator their updates")
    return run_demo(sites=args.sites, rounds=args.rounds, workdir=args.workdir, secure=args.secure_aggregation,
                    plot=args.plot)
