"""README.md's "Running a real federation", run as written: every command of its block, in order, in a fresh
directory, with the coordinator and the three sites as processes on this machine."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from safetensors.numpy import load_file

from plexus.config import load_site_config

from integration.harness import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The shell lines of the section's code block, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Running a real federation"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]


def as_here(line: str, port: int) -> str:
    """The one machine stands in for the coordinator's host; the example is named by its path in the checkout."""
    return (line.replace("--host coordinator.example.org", "--host 127.0.0.1").replace("--port 8443", f"--port {port}")
            .replace("examples/", f"{REPO}/examples/"))


def test_the_readme_federation_runs_as_written(tmp_path, procs):
    work = tmp_path / "work"
    work.mkdir()
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    commands = readme_commands()
    assert commands[0].startswith("plexus pki init fed ") and "--port 8443" in commands[0]
    job_id = None
    for line in (as_here(line, port) for line in commands):
        if line.startswith("export "):
            key, value = line.removeprefix("export ").split("=", 1)
            env[key] = value
            continue
        argv = shlex.split(line.replace("ID", job_id) if job_id else line)
        assert argv[0] == "plexus", line
        if argv[-1] == "&":
            name = "coordinator" if argv[1] == "coordinator" else Path(argv[-2]).parent.name
            procs.start(name, *argv[1:-1], env=env, cwd=work)
            continue
        done = subprocess.run([sys.executable, "-m", "plexus", *argv[1:]], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, done.stderr
        if argv[1:3] == ["job", "submit"]:
            job_id = re.match(r"submitted job (\S+)", done.stdout).group(1)
            assert "job_completed" in done.stdout, done.stdout
        if argv[1:3] == ["job", "show"]:
            assert "status: completed" in done.stdout, done.stdout
        if argv[1:3] == ["sites", "list"]:
            online = re.findall(r"^(\S+)\s+True\s+\S+ \S+\s+heart-disease\s", done.stdout, re.M)
            assert sorted(online) == ["cleveland", "hungary", "va"], done.stdout

    fed = work / "fed"
    coordinator = (fed / "coordinator" / "coordinator.yaml").read_text()
    assert f'listen: "127.0.0.1:{port}"' in coordinator   # where the kits dial
    for site in ("cleveland", "hungary", "va"):
        assert load_site_config(fed / "sites" / site / "site.yaml").datasets["heart-disease"].hospital == site
    assert (fed / "coordinator" / "state" / "plexus.db").exists()   # beside its config, not in the cwd
    assert load_file(str(work / "model.safetensors"))
    wait_until(lambda: "certificate of site 'cleveland' (serial" in procs.log("coordinator")
               and "has been revoked" in procs.log("coordinator"), 60, "the coordinator to refuse the revoked site")
