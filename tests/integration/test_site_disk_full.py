"""A site whose audit log cannot be written (full disk) says so and keeps serving; it never turns zombie."""

from __future__ import annotations

import os
import queue
import resource
import signal
import subprocess
import sys
import threading

import pytest

from plexus import pki
from site_agent.audit import SiteAudit

from integration.harness import heart_job, wait_until
from integration.rogue import rogue_federation

# Every file the site process writes may grow to 32 KiB: the audit log's write-ahead log reaches it after
# three entries, and the kernel then fails the write (EFBIG), as a full disk fails it with ENOSPC.
FILE_LIMIT = 32 << 10


@pytest.fixture
def rogue(tmp_path):
    with rogue_federation(tmp_path, "disk-test") as coordinator:
        yield coordinator


def _limited():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


class Output:
    """The process's merged stdout/stderr, read on a thread (a pipe: no file size limit applies)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line.decode(errors="replace"))

    def text(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        self._thread.join(10)


def test_site_reports_an_unwritable_audit_log_and_keeps_serving(rogue, tmp_path):
    kit = tmp_path / "pki" / "sites" / "a"
    state = tmp_path / "state"
    SiteAudit(state).close()   # an existing log: the agent opens it, then its writes start failing
    config = kit / "site.yaml"
    config.write_text(f'site: a\ncoordinator: "{rogue.address}"\nkit: "."\nstate_dir: "{state}"\n'
                      "datasets:\n  heart-disease: {kind: heart-disease, hospital: cleveland}\n"
                      "policy: {allowed_models: [logistic]}\n")
    proc = subprocess.Popen([sys.executable, "-m", "plexus", "site", "run", "--config", str(config), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=_limited)
    output = Output(proc)
    try:
        job = heart_job(name="diskfull", rounds=20)
        answers = []
        for round_ in range(1, 7):
            try:
                answers.append(rogue.ask("diskfull-0123abcd", job, round_=round_, timeout=90))
            except queue.Empty:
                pytest.fail(f"the site stopped answering after {answers} (alive: {proc.poll() is None}):\n"
                            f"{output.text()[-3000:]}")
            if answers[-1].what == "RESULT_FAILED":
                break
        failed = answers[-1]
        assert failed.what == "RESULT_FAILED" and "audit log" in failed.reason, answers
        assert str(tmp_path) not in failed.reason   # no local paths go to the coordinator
        # Still serving: the next task is answered too, and the process is alive.
        assert rogue.ask("diskfull-0123abcd", job, round_=round_ + 1, timeout=90).what == "RESULT_FAILED"
        assert proc.poll() is None
        wait_until(lambda: " ERROR " in output.text() and "audit log" in output.text(), 30, "an ERROR in the log")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        output.close()


def test_site_whose_audit_log_cannot_be_opened_exits_with_a_clear_error(tmp_path):
    pki.init_federation(tmp_path / "pki", "disk-test", hosts=["127.0.0.1"])
    kit = pki.add_site(tmp_path / "pki", "a")
    state = tmp_path / "state"
    (state / "audit.db").mkdir(parents=True)   # a path that is a directory, not a database
    config = kit / "site.yaml"
    config.write_text(f'site: a\ncoordinator: "127.0.0.1:9"\nkit: "."\nstate_dir: "{state}"\n')
    result = subprocess.run([sys.executable, "-m", "plexus", "site", "run", "--config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "error: " in result.stderr and "audit log" in result.stderr and "Traceback" not in result.stderr
