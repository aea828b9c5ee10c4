"""`plexus coordinator run` and `plexus site run` stop within seconds of SIGTERM/SIGINT, in any state.

The kernel may hand a process-directed signal to any thread; the tests also send it to a
non-main thread (tgkill), which is what used to leave both processes running forever.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordinator.server import Coordinator
from plexus import pki
from plexus.config import CoordinatorConfig
from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import RawSite, free_port, scaled, wait_until

STOPS_WITHIN_S = 15.0   # "a few seconds" on an idle machine; generous for a loaded test runner
STARTS_WITHIN_S = 120.0


class Federation:
    """Kits from `plexus pki` in tmp_path and the real commands as subprocesses, each logging to a file."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        pki.init_federation(root, "shutdown-test", hosts=["127.0.0.1"], port=self.port)
        self.coordinator_config = root / "coordinator" / "coordinator.yaml"
        # Long polls stay open for seconds, so a signal finds calls in flight.
        self.coordinator_config.write_text(self.coordinator_config.read_text() + "poll_timeout_s: 10\n")
        kit = pki.add_site(root, "a")
        self.site_config = kit / "site.yaml"
        self.site_config.write_text(
            f'site: a\ncoordinator: "127.0.0.1:{self.port}"\nkit: "."\n'
            "datasets:\n  heart-disease: {kind: heart-disease, hospital: cleveland}\n"
            "policy: {allowed_models: [logistic]}\n")
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.root / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "plexus", *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.procs.append(proc)
        return proc

    def start_coordinator(self) -> subprocess.Popen:
        proc = self.start("coordinator", "coordinator", "run", "--config", str(self.coordinator_config))
        self.wait_log("coordinator", "listening on port")
        return proc

    def start_site(self) -> subprocess.Popen:
        return self.start("site", "site", "run", "--config", str(self.site_config), "--threads", "1")

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, name: str, text: str) -> None:
        wait_until(lambda: text in self.log(name), STARTS_WITHIN_S, f"{text!r} in the {name} log")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def fed(tmp_path):
    federation = Federation(tmp_path / "pki")
    yield federation
    federation.close()


def _threads(pid: int, sig: int) -> set[int]:
    """The process's threads other than the main one that do not block `sig` now."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue   # ended while we looked
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        if int(tid) != pid and not blocked & (1 << (sig - 1)):
            found.add(int(tid))
    return found


def _signal(proc: subprocess.Popen, sig: int, target: str) -> None:
    """Send `sig` to the process, or to one of its long-lived threads other than the main one.

    gRPC starts and ends a set of threads with each channel (a site redialling a coordinator that
    is down makes a new set every back-off). A thread being created or ending blocks every signal
    (glibc), and a signal sent to that one thread dies with it, which the kernel never does to a
    process-directed signal, the case this emulates. So the signal goes to a thread that was there
    a moment ago too and does not block it.
    """
    if target == "process":
        proc.send_signal(sig)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "tgkill"):
        pytest.skip("this libc has no tgkill() to send a signal to one thread")

    def sent() -> bool:
        before = _threads(proc.pid, sig)
        time.sleep(0.5)
        for tid in sorted(before & _threads(proc.pid, sig)):
            if libc.tgkill(proc.pid, tid, sig) == 0:
                return True
            if ctypes.get_errno() != errno.ESRCH:
                raise OSError(ctypes.get_errno(), "tgkill failed")
        return False

    wait_until(sent, 10, "a long-lived thread besides the main one to take the signal")


def _stops(proc: subprocess.Popen, name: str, target: str) -> float:
    sig = signal.Signals[name]
    started = time.monotonic()
    _signal(proc, sig, target)
    try:
        code = proc.wait(timeout=STOPS_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {STOPS_WITHIN_S}s after {name} to its {target}")
    assert code == 0, f"exit status {code} after {name}"
    return time.monotonic() - started


@pytest.mark.parametrize(("sig", "target"), [("SIGTERM", "thread"), ("SIGINT", "process")])
def test_coordinator_stops_with_a_site_long_polling(fed, sig, target):
    coordinator = fed.start_coordinator()
    fed.start_site()
    fed.wait_log("site", "joined federation")
    _stops(coordinator, sig, target)


@pytest.mark.parametrize(("sig", "target"), [("SIGTERM", "thread"), ("SIGINT", "thread"),
                                             ("SIGTERM", "process")])
def test_site_stops_while_idle_polling(fed, sig, target):
    fed.start_coordinator()
    site = fed.start_site()
    fed.wait_log("site", "joined federation")
    _stops(site, sig, target)


@pytest.mark.parametrize(("sig", "target"), [("SIGTERM", "thread"), ("SIGINT", "process")])
def test_site_stops_while_the_coordinator_is_down(fed, sig, target):
    site = fed.start_site()
    fed.wait_log("site", "UNAVAILABLE")   # dialling, backing off, dialling again
    _stops(site, sig, target)


def test_revoked_site_retries_rarely_with_an_error_and_the_coordinator_logs_the_refusal(fed):
    pki.revoke(fed.root, "a")
    fed.start_coordinator()
    site = fed.start_site()
    fed.wait_log("site", "has been revoked")
    fed.wait_log("coordinator", "refused Join")
    refusal = next(line for line in fed.log("site").splitlines() if "has been revoked" in line)
    assert " ERROR " in refusal and "UNAUTHENTICATED" in refusal and "retrying in 60.0s" in refusal, refusal
    assert "ask the federation operator for a new kit" in refusal
    assert "revoked" in fed.log("coordinator")
    _stops(site, "SIGTERM", "thread")   # and a stop during the long wait is prompt
    assert fed.log("site").count("has been revoked") == 1


def test_stopping_answers_a_waiting_long_poll_at_once(pki_root, tmp_path):
    """Not after its poll_timeout_s (nor the grace period it held, waiting): `systemctl stop` takes no minutes."""
    coordinator = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", kit=pki_root / "coordinator",
                                                state_dir=tmp_path / "state", crl=pki_root / "coordinator" / "crl.pem",
                                                poll_timeout_s=60, max_workers=8, max_calls_per_identity=4))
    coordinator.start()
    site = RawSite(pki_root / "sites" / "a", f"127.0.0.1:{coordinator.port}")
    answers = []
    poll = threading.Thread(target=lambda: answers.append(
        site.stub.NextTask(fpb.NextTaskRequest(wait_s=60), timeout=scaled(100))))
    try:
        site.join()
        poll.start()
        wait_until(lambda: coordinator.engine.polling_sites == 1, 10, "the site's long poll to wait")
        started = time.monotonic()
        coordinator.stop(grace=scaled(10))
        took = time.monotonic() - started
    finally:
        poll.join(scaled(100))
        site.close()
    assert took < scaled(5), f"stop took {took:.1f}s"
    assert [a.kind for a in answers] == [fpb.TASK_NONE]
