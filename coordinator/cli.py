"""`plexus coordinator ...`: the operator's command that runs the coordinator service.

Found by the kernel's CLI through the `plexus.commands` entry point `coordinator` (pyproject.toml).
"""

from __future__ import annotations

from plexus.cli.common import command, existing_file


def add_commands(sub) -> None:
    """The `coordinator` group under the top-level subparsers `sub`."""
    coord = sub.add_parser("coordinator", help="the coordinator service").add_subparsers(metavar="ACTION")
    run = command(coord, "run", _run, help="run the coordinator")
    run.add_argument("--config", type=existing_file, required=True)


def _run(args) -> int:
    from coordinator.server import run
    from plexus.config import load_coordinator_config
    from plexus.memory import set_up_coordinator

    set_up_coordinator()   # before gRPC starts its threads
    return run(load_coordinator_config(args.config))
