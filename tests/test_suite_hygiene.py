"""The suite's own guards: a test that leaves a thread or a process running, or whose thread dies, fails;
a log handler a test installed is removed after it."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


def _run(pytester, monkeypatch, body: str):
    monkeypatch.setenv("PLEXUS_TEST_TIME_SCALE", "0.1")   # the guard's 10 s grace becomes 1 s
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini('[pytest]\nfilterwarnings = error::pytest.PytestUnhandledThreadExceptionWarning\n')
    pytester.makepyfile(body)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider")


def test_a_thread_left_running_fails_the_test(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, """
import threading
stop = threading.Event()
def test_leaks():
    threading.Thread(target=stop.wait, name="forgotten", daemon=True).start()
def test_cleans_up():
    stop.set()
""")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*the test left running: thread 'forgotten'*"])


def test_a_child_process_left_running_fails_the_test(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, """
import subprocess, sys
procs = []
def test_leaks():
    procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
def test_cleans_up():
    procs[0].kill(); procs[0].wait()
""")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*the test left running: child process*time.sleep(60)*"])


def test_a_thread_that_dies_fails_the_test(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, """
import threading
def test_thread_raises():
    t = threading.Thread(target=lambda: 1 / 0)
    t.start(); t.join()
""")
    result.assert_outcomes(failed=1)


def test_a_log_handler_a_test_installed_on_captured_stderr_is_gone_after_it(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, """
import logging, sys
from plexus.logs import configure
def test_cli_routes_logs_to_captured_stderr(capsys):
    configure()                      # what plexus.cli.main does, onto capsys's stream
def test_a_later_test_logs_nowhere_closed():
    assert not [h for h in logging.getLogger().handlers if getattr(h, "plexus", False)]
    logging.getLogger("later").error("into a stream that is still open")
""")
    result.assert_outcomes(passed=2)
    assert "Logging error" not in result.stderr.str() + result.stdout.str()
