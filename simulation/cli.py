"""`plexus simulate JOB.yaml`: the job on virtual sites in this machine's processes (simulation/README)."""

from __future__ import annotations


def add_commands(sub) -> None:
    p = sub.add_parser("simulate", help="run a job on virtual sites on this machine")
    p.set_defaults(run=lambda args: 2)
