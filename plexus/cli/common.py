"""What every command group of the `plexus` CLI shares: argument types that refuse bad values while parsing
(exit 2, one line), the tables the commands print, and the audit log's printout."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from plexus.errors import PlexusError
from plexus.text import printable


class UsageError(PlexusError):
    """A command line that cannot run as given (arguments that contradict each other): exit 2, like argparse."""


MAX_COUNT = 2**62   # a round or entry count any store holds; larger ones are typos, refused before they overflow


def command(actions, name: str, run, **kwargs) -> argparse.ArgumentParser:
    """A leaf command under `actions` that runs `run(args)`; its parser reports a UsageError from `run`."""
    parser = actions.add_parser(name, **kwargs)
    parser.set_defaults(run=run, usage=parser)
    return parser


def existing_file(text: str) -> Path:
    """An argparse type: a file that is there to be read."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the file in it")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file; check the path")
    return path


def output_file(text: str) -> Path:
    """An argparse type: a file to write, in a folder that is there and writable (what is at the path is replaced
    only once the new file is whole)."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("is empty; give the file to write, e.g. -o model.safetensors")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path in it, e.g. {path / 'out'}")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its folder {folder} does not exist; make it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: its folder {folder} is not writable by this user")
    return path


def int_in(low: int, high: int | None = None, *, why: str = ""):
    """An argparse type: an integer in [low, high] (no upper bound when high is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {bounds}{why}")
        return value

    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0; write e.g. --timeout 60")
    return value


def audit_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every audit-log printout takes."""
    p.add_argument("--verify", action="store_true", help="check the hash chain; exit 1 if it was tampered with")
    p.add_argument("--limit", type=int_in(0, MAX_COUNT), default=0, help="only the last N entries (default: all)")
    return p


def print_audit(entries: list[dict], count: int, verify: bool, problem: str, as_json: bool) -> int:
    """Audit entries as a table or JSON; exit code 1 when verification found `problem`."""
    if as_json:
        out = {"count": count, "entries": entries}
        if verify:
            out.update(verified=not problem, problem=problem)
        print(json.dumps(out, indent=2))
    else:
        table(["seq", "time", "actor", "action", "subject", "details"], [
            {"seq": e["seq"], "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["at"])),
             "actor": e["actor"], "action": e["action"], "subject": e["subject"],
             "details": json.dumps(e["details"], sort_keys=True, separators=(",", ":"))} for e in entries])
        if verify and not problem:
            print(f"\nverified: {count} entries, hash chain intact")
    if problem:
        print(f"audit log verification FAILED: {printable(problem)}", file=sys.stderr)
        return 1
    return 0


def table(columns: list[str], rows: list[dict]) -> None:
    """Rows as aligned columns; every cell is made printable, as most hold text from sites or the coordinator."""
    cells = [[printable(str(r.get(c, ""))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())

