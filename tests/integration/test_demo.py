"""`plexus demo` as a user runs it: separate processes, mTLS, a table at the end, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from integration.harness import wait_until


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose; it is its parent's to reap
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.split(") ", 1)[1][0] != "Z"


def _pids(workdir: Path) -> list[int]:
    return [int(line.split()[0]) for line in (workdir / "pids").read_text().splitlines()]


def test_demo_federated_model_is_within_three_points_of_pooled(demo_run):
    """The session's one 20-round demo (conftest demo_run, shared with deploy/test_no_secrets_in_logs.py; it logs
    JSON, which the table on stdout does not depend on: the other demo tests here run with the default text)."""
    workdir, plot, result = demo_run.workdir, demo_run.plot, demo_run.result
    out, err = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    assert result.returncode == 0, out + err
    assert out.count(" 4 sites ") == 20          # every round closed with all four hospitals
    pooled_col = {}
    for label in ("federated (FedAvg)", "pooled (ceiling)", "cleveland alone"):
        row = re.search(re.escape(label) + r"((?:\s+[0-9.]+){6})", out)
        assert row, f"no row {label!r} in:\n{out}"
        values = [float(v) for v in row.group(1).split()]
        pooled_col[label] = values[4]               # accuracy on all sites' held-out rows pooled
    assert pooled_col["federated (FedAvg)"] >= pooled_col["pooled (ceiling)"] - 0.03, out
    assert not [pid for pid in _pids(workdir) if _alive(pid)]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000


def test_demo_ctrl_c_leaves_no_process_behind(tmp_path):
    workdir = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "plexus", "demo", "--rounds", "200", "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        for line in proc.stdout:
            if "round   2/200" in line:
                break
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pids = _pids(workdir)
    assert len(pids) == 5  # the coordinator and four sites were started
    wait_until(lambda: not [pid for pid in pids if _alive(pid)], 15, "the demo's children to exit")


def test_a_failed_demo_keeps_its_temporary_folder_and_says_where(tmp_path):
    """Without --workdir the demo works in a temp dir; when a site agent dies mid-run, the demo fails and keeps
    that folder (PKI, state, logs) instead of removing it with the evidence."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "plexus", "demo", "--rounds", "200"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env)
    try:
        workdir = None
        for line in proc.stdout:
            if line.startswith("plexus demo: federation in "):
                workdir = Path(line.removeprefix("plexus demo: federation in ").split(" (")[0])
            if "round   1/200" in line:
                break
        assert workdir is not None and workdir.parent == tmp_path
        [site] = [int(line.split()[0]) for line in (workdir / "pids").read_text().splitlines()
                  if line.split()[1] == "site-cleveland"]
        os.kill(site, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert "site-cleveland exited with code -9" in err and "Traceback" not in err
    assert f"plexus demo failed; its PKI, state and logs are kept in {workdir} (logs: {workdir / 'logs'})" in err
    assert (workdir / "logs" / "coordinator.log").read_text() and (workdir / "pki" / "ca").is_dir()
    wait_until(lambda: not [pid for pid in _pids(workdir) if _alive(pid)], 15, "the demo's children to exit")
