"""`plexus simulate` ends with the models a real federation over mTLS ends with, bit for bit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.intake import Upload
from plexus.config import DatasetSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.datasets import load_dataset
from simulation.pool import ProcessPool
from simulation.simulator import Simulator, final_model

from integration.harness import HOSPITAL_OF

FOUR = ("a", "b", "c", "d")
JOB = """\
name: same-{name}
model: {{name: {model}, args: {{in_features: 13, num_classes: 2{hidden}}}}}
data: {{dataset: heart-disease}}
rounds: 3
strategy: {{name: {strategy}, args: {args}}}
sites: {{min: 4, deadline_s: 60}}
train: {{epochs: 1, batch_size: 16, optimizer: {{name: sgd, lr: 0.05}}}}
seed: 11
{extra}"""

# Each strategy the issue names, secure aggregation, a compressed job and an asynchronous one. The asynchronous
# job takes one update per site per version (buffer 4 of 4 sites, max_per_buffer 1), so that the real
# federation's result does not depend on which site happens to answer first.
JOBS = {
    "fedavg": dict(strategy="fedavg"),
    "fedadam": dict(strategy="fedadam", args="{eta: 0.05}"),
    "scaffold": dict(strategy="scaffold"),
    "trimmed": dict(strategy="trimmed_mean", args="{beta: 0.25}"),
    "secure": dict(strategy="fedavg", extra="privacy: {secure_aggregation: true, secagg: {clip: 4.0}}\n"),
    "compressed": dict(strategy="fedavg", model="mlp", hidden=", hidden: [16]",
                       extra="compression: {uplink: {codec: topk, fraction: 0.1}, downlink: {codec: delta8}}\n"),
    "async": dict(strategy="fedavg", extra="asynchronous: {buffer: 4, max_per_buffer: 1}\n"),
    # 70k parameters: its updates (280 KB) come to the simulator through the workers' shared memory
    "wide": dict(strategy="fedavg", model="mlp", hidden=", hidden: [256, 256]"),
}


def job_text(name: str) -> str:
    spec = {"model": "logistic", "hidden": "", "args": "{}", "extra": "", **JOBS[name]}
    return JOB.format(name=name, **spec)


def site_configs(policy: PolicySpec) -> dict[str, SiteConfig]:
    """The federation's four sites as the simulation takes them: their datasets and policy."""
    return {name: SiteConfig(site=name, coordinator="unused.invalid:1", kit=Path("unused"), policy=policy,
                             datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[name])})
            for name in FOUR}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """The seven jobs simulated on the four sites in worker processes: job name -> final model."""
    state = tmp_path_factory.mktemp("simulated") / "state"
    pools = []

    def pool(*args, **kwargs):
        pools.append(ProcessPool(*args, **kwargs))
        return pools[-1]

    journals = []   # for each upload the simulator took: whether its stream stood for its journal (no spool file)
    real = Upload.receive

    def receive(self, chunks, **kwargs):
        journals.append(kwargs.get("replay") is not None)
        return real(self, chunks, **kwargs)

    # the federation's sites train in this process, with its torch threads: the wide layers' sums depend on them
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Upload, "receive", receive)
        outcome = Simulator([job_text(name) for name in JOBS],
                            site_configs(PolicySpec(allowed_models=("logistic", "mlp"))),
                            state, workers=2, pool=pool, threads=torch.get_num_threads()).run()
    assert [status for _, status, _ in outcome.jobs] == ["completed"] * len(JOBS)
    assert len(journals) >= 3 * 4 * len(JOBS) and all(journals)
    # the wide job's 3 rounds x 4 updates, at least, came through shared memory, and its models to the 2 workers
    assert pools[0].shared_bytes["up"] >= 3 * 4 * 69_000 * 4
    assert pools[0].shared_bytes["down"] >= 3 * 2 * 69_000 * 4
    return {name: final_model(state, job_id) for name, (job_id, _, _) in zip(JOBS, outcome.jobs)}


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_a_simulation_ends_with_the_models_a_real_federation_ends_with(federation, simulated):
    for name in FOUR:
        federation.start_site(name)
    federation.wait_online(*FOUR)
    admin = federation.admin()
    for name in JOBS:
        job_id = admin.submit(job_text(name)).job_id
        assert federation.wait_job(job_id, timeout=120) == "completed", name
        real = admin.download(job_id)[1]
        assert same_bits(simulated[name], real), name


def test_ray_actors_give_the_bits_worker_processes_give(tmp_path, simulated):
    """A local Ray instance, started for the test and shut down with it (the pool's own)."""
    from simulation.ray_pool import ray_pool

    outcome = Simulator([job_text("fedavg")], site_configs(PolicySpec(allowed_models=("logistic",))),
                        tmp_path / "ray", workers=2, pool=ray_pool(None)).run()
    assert outcome.status == "completed"
    assert same_bits(final_model(tmp_path / "ray", outcome.job_id), simulated["fedavg"])


def _bench_strategies():
    path = Path(__file__).resolve().parents[2] / "bench" / "strategies.py"
    spec = importlib.util.spec_from_file_location("bench_strategies", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["fedadam", "scaffold", "trimmed"])
def test_the_strategy_benchmarks_own_rounds_give_the_simulated_models(simulated, tmp_path, name):
    """bench/strategies.py runs its many seeds through a round loop of its own; it must end where `plexus
    simulate` does, which the first test holds to a real federation."""
    bench = _bench_strategies()
    sites = {site: load_dataset(DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[site])) for site in FOUR}
    task = bench.Task(name="heart-disease", sites=sites, x_test=sites["a"].x_test, y_test=sites["a"].y_test,
                      model={}, optimizer={}, batch_size=16, rounds=3, epochs=1)
    loop = bench.simulate(task, parse_round_config(job_text(name)), name, tmp_path / "bench")
    assert same_bits({k: np.asarray(v) for k, v in loop.items()}, simulated[name])
