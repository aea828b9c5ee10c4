"""Suite-wide settings: tests never write into the working directory, and leave no thread, process or log
handler behind."""

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import configuration, settings

from timing import scaled

configuration.set_hypothesis_home_dir(tempfile.mkdtemp(prefix="plexus-hypothesis-"))
settings.register_profile("plexus", database=None)
settings.load_profile("plexus")

# Threads that outlive a test by design: gRPC's process-wide pollers. The one child that does: the
# model worker a coordinator process keeps for all its coordinators (coordinator.model_worker).
_LONG_LIVED_THREADS = ("grpc",)
_LONG_LIVED_CHILD = "coordinator.model_worker"


def _children() -> set[int]:
    """PIDs of this process's live children (from /proc; nothing to report where there is none)."""
    me, found = os.getpid(), set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) == me:
                found.add(int(entry))
    return found


def _leftover_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(_LONG_LIVED_THREADS)]


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """A test stops every thread and process it started (a thread left running writes to closed files)."""
    threads, children = set(threading.enumerate()), _children()
    yield
    deadline = time.monotonic() + scaled(10)
    while (left := _leftover_threads(threads)) and time.monotonic() < deadline:
        left[0].join(0.05)
    while (procs := {p for p in _children() - children if _LONG_LIVED_CHILD not in _cmdline(p)}) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    problems = [f"thread {t.name!r} ({getattr(t, '_target', None)})" for t in left]
    problems += [f"child process {pid}: {_cmdline(pid)}" for pid in procs]
    if problems:
        pytest.fail("the test left running: " + "; ".join(problems))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> SimpleNamespace:
    """One whole `plexus --log-format json demo --rounds 20 --plot ...` (four hospitals), run once for the tests that
    read its outcome (its table, its plot, its JSON logs): workdir, plot, and the finished process (bytes)."""
    base = tmp_path_factory.mktemp("demo-run")
    workdir, plot = base / "demo", base / "demo.png"
    result = subprocess.run([sys.executable, "-m", "plexus", "--log-format", "json", "demo", "--rounds", "20",
                             "--workdir", str(workdir), "--plot", str(plot)],
                            capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    return SimpleNamespace(workdir=workdir, plot=plot, result=result)


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """`plexus.cli.main` routes the root logger to the sys.stderr of its moment, which under capsys is a
    stream closed at the test's end: later tests' threads would log into it. Each test gets the root
    logger's handlers and level back as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"
