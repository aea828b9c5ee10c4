"""The `plexus` command, organised by audience: the operator's `pki` (here) and `coordinator run`, hospital
IT's `site ...`, the researcher's and admin's `job`, `sites`, `audit` and `dashboard`, and the `demo`.

The kernel knows no service: the `coordinator` and `site` groups come from the packages that implement them,
found through the `plexus.commands` entry points declared in pyproject.toml (each names a function that
adds its group to the top-level subparsers). After changing them, reinstall (`pip install -e .`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from importlib.metadata import entry_points

from plexus.cli import admin, dashboard, demo, pki
from plexus.cli.common import UsageError
from plexus.errors import PlexusError
from plexus.text import printable

COMMANDS_GROUP = "plexus.commands"
LOG_FORMATS = ["text", "json"]
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); return the exit code (argument errors exit 2)."""
    top = parser()
    if not installed_commands():   # a checkout whose install predates the entry points, or a broken one
        print(f"warning: no {COMMANDS_GROUP} entry points are installed, so the coordinator and site commands are "
              "missing; reinstall plexus (`pip install -e .` in a checkout)", file=sys.stderr)
    args = top.parse_args(argv)
    if not hasattr(args, "run"):
        top.print_help()
        return 2
    from plexus.logs import configure

    level = os.environ.get("PLEXUS_LOG", "INFO")
    if args.log_format not in LOG_FORMATS:   # argparse checks a flag's value, not a default from the environment
        top.error(f"--log-format (or PLEXUS_LOG_FORMAT) is {args.log_format!r}; use one of: {', '.join(LOG_FORMATS)}")
    if level.upper() not in LOG_LEVELS:
        top.error(f"PLEXUS_LOG is {level!r}; use one of: {', '.join(LOG_LEVELS)}")
    os.environ["PLEXUS_LOG_FORMAT"] = args.log_format   # processes this one starts (the demo's) log alike
    configure(args.log_format, level)
    try:
        code = args.run(args) or 0
        sys.stdout.flush()   # here, not at exit, so that a reader that went away is handled below
        return code
    except BrokenPipeError:
        # The reader closed the pipe (`| head -1`): stop quietly. Python's documented recipe: point stdout
        # at devnull so that the flush at exit does not fail once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UsageError as exc:
        args.usage.error(printable(str(exc)))   # argparse's way: usage, then one line, exit 2
    except PlexusError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except OSError as exc:   # a file or port the command needs and cannot have: say which, not a traceback
        print(f"error: {printable(os_error_text(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:
        import grpc

        if isinstance(exc, grpc.RpcError):
            print(f"error: {exc.code().name}: {printable(exc.details() or '')}", file=sys.stderr)
            return 1
        raise


def os_error_text(exc: OSError) -> str:
    """`exc` as one line naming the file(s) it is about: "DIR/x: Is a directory"."""
    what = exc.strerror or str(exc)
    if exc.filename is None:
        return what
    names = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"{names}: {what}"


def parser() -> argparse.ArgumentParser:
    """The whole command line: the kernel's groups and every installed `plexus.commands` group."""
    p = argparse.ArgumentParser(prog="plexus", description="Federated learning across hospitals.")
    p.add_argument("--version", action="version", version=f"plexus {_version()}")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("PLEXUS_LOG_FORMAT") or "text",
                   help="log lines on stderr as text or JSON objects (or PLEXUS_LOG_FORMAT; default text)")
    sub = p.add_subparsers(metavar="COMMAND")
    demo.add_commands(sub)
    pki.add_commands(sub)
    for add in installed_commands().values():
        add(sub)
    admin.add_commands(sub)
    dashboard.add_commands(sub)
    return p


@functools.cache
def installed_commands() -> dict:
    """Name -> the function that adds that command group, for every `plexus.commands` entry point, by name."""
    found = {}
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        found.setdefault(ep.name, ep)   # the same distribution seen twice on sys.path: its first copy wins
    return {name: ep.load() for name, ep in found.items()}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plexus-fl")
    except PackageNotFoundError:   # run from a checkout that was never installed
        from plexus import __version__

        return __version__
