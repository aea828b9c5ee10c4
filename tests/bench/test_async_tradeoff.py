"""bench.async_tradeoff's core on a tiny case, synchronous FedAvg only: a real Store and Engine on a virtual
clock, real training, the versions scored from the store's checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.async_tradeoff import (
    accuracy_at_time,
    accuracy_at_updates,
    case_for,
    job_yaml,
    run_one,
    summarise,
    time_to,
)
from plexus.config import parse_round_config


@pytest.fixture(scope="module")
def tiny():
    """--quick's Fashion-MNIST sites (4k images, Dirichlet 0.3, site-0 5× and site-1/2 2× slower), a 4-channel
    cnn, 2 steps per task, 2 rounds, 500 test images."""
    case = case_for("fmnist", True)
    return dataclasses.replace(case, model={"name": "cnn", "args": {"width": 4}}, rounds=2, target=1.01,
                               train={**case.train, "steps": 2}, x_test=case.x_test[:500], y_test=case.y_test[:500])


def test_sync_rounds_run_through_the_engine_on_virtual_time(tiny, tmp_path):
    torch.set_num_threads(1)
    run = run_one(tiny, "sync", 0, tmp_path)
    assert run["job_status"] == "completed", run["job_message"]

    # Every round has all 8 sites' updates, and every round's model was scored from its checkpoint.
    assert [v["version"] for v in run["versions"]] == [0, 1, 2]
    assert [v["updates"] for v in run["versions"]] == [0, 8, 16]
    assert all(0.0 <= v["accuracy"] <= 1.0 for v in run["versions"])
    assert run["updates_accepted"] == 16 and run["refused"] == 0 and run["steps"] == 16 * 2

    # A task takes steps × step_s × slowdown + transfer_s of virtual time; a round waits for the 5× site.
    compute = {}   # site -> the compute part of each of its tasks' virtual durations
    for task in run["tasks"]:
        assert task["steps"] == 2 and task["tau"] == 0
        compute.setdefault(task["site"], []).append(task["end"] - task["start"] - tiny.transfer_s)
    fast = 2 * tiny.step_s
    assert compute["site-0"] == pytest.approx([5 * fast] * 2)
    assert compute["site-1"] == compute["site-2"] == pytest.approx([2 * fast] * 2)
    assert all(compute[f"site-{i}"] == pytest.approx([fast] * 2) for i in range(3, 8))
    slowest = 2 * tiny.step_s * 5 + tiny.transfer_s
    assert [v["t"] for v in run["versions"]] == pytest.approx([0.0, slowest, 2 * slowest])
    assert run["finish_t"] == pytest.approx(2 * slowest)
    starts = sorted({t["start"] for t in run["tasks"]})
    assert starts == pytest.approx([0.0, slowest])   # round 2 opens for everyone once site-0's update is in

    sites = run["sites"]
    assert sites["site-0"]["task_s"] == pytest.approx(slowest) and sites["site-0"]["accepted"] == 2
    assert run["staleness"] == {0: 16}

    # The summaries read the same records.
    assert accuracy_at_updates(run, tiny.updates) == run["versions"][-1]["accuracy"]
    assert accuracy_at_time(run, slowest) == run["versions"][1]["accuracy"]
    assert time_to(run, 0.0) == 0.0 and time_to(run, 1.01) is None
    summary = summarise(tiny, [run])["sync"]
    assert summary["time_to_target"]["values"] == summary["ratio_to_sync"]["values"] == [None]   # 1.01: never
    assert summary["acc_at_sync_finish"]["mean"] == run["versions"][-1]["accuracy"]


@pytest.mark.parametrize("method", ["fedasync", "fedbuff2", "fedbuff4"])
def test_the_asynchronous_configs_are_valid_round_configs(tiny, method):
    cfg = parse_round_config(job_yaml(tiny, method, 0, versions=10), source="bench job")
    assert cfg.asynchronous is not None and cfg.rounds == 10
    assert cfg.asynchronous.staleness.fn == "polynomial" and cfg.asynchronous.staleness.a == 0.5
    assert (cfg.asynchronous.mixing is not None) == (method == "fedasync")
