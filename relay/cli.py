"""`plexus relay ...`: run a relay, a tier between sites (or relays) and their parent.

Found by the kernel's CLI through the `plexus.commands` entry point `relay` (pyproject.toml).
"""

from __future__ import annotations

from plexus.cli.common import command, existing_file


def add_commands(sub) -> None:
    """The `relay` group under the top-level subparsers `sub`."""
    group = sub.add_parser("relay", help="a relay: aggregates its children for its parent").add_subparsers(
        metavar="ACTION")
    run = command(group, "run", _run, help="run a relay")
    run.add_argument("--config", type=existing_file, required=True)


def _run(args) -> int:
    from plexus.config import load_relay_config
    from plexus.memory import limit_malloc_arenas
    from relay.server import run

    limit_malloc_arenas()
    return run(load_relay_config(args.config))
