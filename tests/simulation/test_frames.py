"""The frames between the simulator and its workers stay in step: whatever the worker's own code prints, and when
the worker is stopped and continued mid-write (Ctrl-Z then fg, a profiler attaching)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from simulation.frames import read_frame
from simulation.pool import ProcessPool
from simulation.simulator import Simulator

ROOT = str(Path(__file__).resolve().parents[2])
MESSAGE = bytes(range(256)) * 16384   # 4 MiB: far more than a pipe holds, so writes block and can be cut short
WRITER = f"""
import sys
sys.path.insert(0, {ROOT!r})
from simulation.frames import write_frame
message = bytes(range(256)) * 16384
for i in range(int(sys.argv[1])):
    write_frame(sys.stdout.buffer, {{"i": i}}, [message, b"small", message])
"""

JOB = """\
name: noisy
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 2
sites: {min: 2, deadline_s: 60}
seed: 1
"""


def test_frames_arrive_whole_when_their_writer_is_stopped_and_continued():
    """Under PYTHONUNBUFFERED=1 (as in the images) sys.stdout.buffer is a raw FileIO: a write a stop cuts short
    returns the part it took, and the rest must still follow."""
    frames = 40
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(frames)], stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    done = threading.Event()

    def stop_and_continue():
        # Until `done`, the writer is not reaped (nothing polls or waits for it), so its PID stays its own: a
        # zombie takes the signals harmlessly.
        while not done.is_set():
            os.kill(writer.pid, signal.SIGSTOP)
            os.kill(writer.pid, signal.SIGCONT)
            time.sleep(0.0005)

    pester = threading.Thread(target=stop_and_continue)
    pester.start()
    try:
        got = []
        while (frame := read_frame(writer.stdout)) is not None:
            header, messages = frame
            assert messages == [MESSAGE, b"small", MESSAGE], header
            got.append(header["i"])
    finally:
        done.set()
        pester.join()
        if writer.poll() is None and got != list(range(frames)):
            writer.kill()
        writer.stdout.close()
    assert got == list(range(frames))
    assert writer.wait(timeout=30) == 0


def test_a_virtual_site_that_prints_to_stdout_does_not_break_the_frames(tmp_path, heart_sites):
    outcome = Simulator([JOB], heart_sites, tmp_path / "state", workers=1, pool=ProcessPool,
                        agent="noisy_agent:NoisyAgent").run()
    assert (outcome.status, outcome.rounds) == ("completed", 2)
    log = (tmp_path / "state").rglob("worker-0.log")
    assert "a stray line from a library" in next(log).read_text()
