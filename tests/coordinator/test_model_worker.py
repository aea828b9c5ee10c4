"""Models are built, and ε computed, in a worker process: the coordinator itself never imports torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.model_worker import ModelWorker
from plexus.accounting import epsilon_after
from plexus.errors import ConfigError
from plexus.models import build_model, state_to_numpy

from timing import wait_until


def _dead(pid: int) -> bool:
    """The process has exited: gone, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def worker():
    w = ModelWorker()
    yield w
    w.close()


def test_the_coordinator_process_does_not_import_torch():
    code = ("import sys, coordinator.server, coordinator.engine, coordinator.service, plexus.cli; "
            "print(sorted(m for m in ('torch', 'opacus') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_worker_builds_the_same_weights_as_the_registry(worker, tmp_path):
    got = worker.build("mlp", {"in_features": 5, "hidden": [4], "num_classes": 2}, seed=7, out=tmp_path / "m")
    want = state_to_numpy(build_model("mlp", {"in_features": 5, "hidden": [4], "num_classes": 2}, seed=7))
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_worker_reports_bad_models_as_config_errors_and_keeps_serving(worker, tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'resnet9000'.*logistic"):
        worker.build("resnet9000", {}, seed=0, out=tmp_path / "a")
    with pytest.raises(ConfigError, match="hidden"):
        worker.build("mlp", {"in_features": 5, "hidden": "wide"}, seed=0, out=tmp_path / "b")
    assert worker.epsilon_after(3, 1.1, 1.0, 1e-5) == epsilon_after(3, 1.1, 1.0, 1e-5)


def test_a_dead_worker_is_replaced(worker, tmp_path):
    worker.build("logistic", {"in_features": 3}, seed=0, out=tmp_path / "a")
    pid = worker.pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _dead(pid), 30, "the worker to die")
    assert worker.build("logistic", {"in_features": 3}, seed=0, out=tmp_path / "b")["linear.weight"].shape == (2, 3)
