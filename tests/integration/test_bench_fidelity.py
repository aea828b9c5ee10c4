"""bench/strategies.py simulates the round engine in process; a real federation must end with the same bits."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from plexus.config import DatasetSpec, parse_round_config
from plexus.datasets import load_dataset

from integration.harness import HOSPITAL_OF

FOUR = ("a", "b", "c", "d")
JOB = """\
name: fidelity-{strategy}
model: {{name: logistic, args: {{in_features: 13, num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: 3
strategy: {{name: {strategy}, args: {args}}}
sites: {{min: 4, deadline_s: 60}}
train: {{epochs: 1, batch_size: 16, optimizer: {{name: sgd, lr: 0.05}}}}
seed: 11
"""


def _bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "strategies.py"
    spec = importlib.util.spec_from_file_location("bench_strategies", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("strategy, args", [("fedadam", "{eta: 0.05}"), ("scaffold", "{}"),
                                            ("trimmed_mean", "{beta: 0.25}")])
def test_the_benchmark_simulation_gives_the_models_a_real_federation_gives(federation, tmp_path, strategy, args):
    for name in FOUR:
        federation.start_site(name)
    federation.wait_online(*FOUR)
    text = JOB.format(strategy=strategy, args=args)
    admin = federation.admin()
    job_id = admin.submit(text).job_id
    assert federation.wait_job(job_id, timeout=120) == "completed"
    _, real = admin.download(job_id)

    bench = _bench()
    sites = {name: load_dataset(DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[name])) for name in FOUR}
    first = sites["a"]
    task = bench.Task(name="heart-disease", sites=sites, x_test=first.x_test, y_test=first.y_test,
                      model={}, optimizer={}, batch_size=16, rounds=3, epochs=1)
    simulated = bench.simulate(task, parse_round_config(text), job_id, tmp_path / "sim")
    assert sorted(simulated) == sorted(real)
    for name in real:
        assert np.asarray(simulated[name]).tobytes() == real[name].tobytes(), name
