"""bench.compression's in-process loop: `none` is bench.strategies' FedAvg bit for bit, every codec of the
benchmark runs a round through the site's and the coordinator's code and sends what it should, and the cases
make valid round configs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from bench import compression, strategies
from plexus.config import parse_round_config

ROUNDS = 2


@pytest.fixture(scope="module")
def heart():
    """The heart hospitals with the benchmark's MLP; 2 rounds."""
    torch.set_num_threads(1)
    return dataclasses.replace(compression.task_for("heart", False), rounds=ROUNDS)


def heart_job(task, block: dict | None = None):
    train = {"epochs": task.epochs, "batch_size": task.batch_size, "optimizer": task.optimizer}
    text = strategies.JOB.format(strategy="fedavg", model=json.dumps(task.model), dataset=task.name, rounds=ROUNDS,
                                 args="{}", train=json.dumps(train), seed=0)
    return parse_round_config(text + (f"compression: {json.dumps(block)}\n" if block else ""))


def test_none_is_bench_strategies_fedavg_bit_for_bit(heart, tmp_path):
    job = heart_job(heart)
    ours, stats = compression.simulate(heart, job, "job-a", tmp_path / "a")
    theirs = strategies.simulate(heart, job, "job-a", tmp_path / "b")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert np.array_equal(ours[name], theirs[name]), name
    model = sum(a.nbytes for a in ours.values())
    assert stats == [{"up": 4 * model, "down": 4 * model}] * ROUNDS   # 4 hospitals, the whole model each way


def test_the_cases_make_the_round_configs_the_spec_describes():
    assert compression.compression_block("none") is None and compression.compression_block("sa:none") is None
    assert compression.compression_block("topk") == {"uplink": {"codec": "topk", "fraction": 0.01}}
    assert compression.compression_block("sa:randk", 0.1) == {"uplink": {"codec": "randk", "fraction": 0.1}}
    assert compression.compression_block("int8/delta8") == {"uplink": {"codec": "int8"},
                                                            "downlink": {"codec": "delta8"}}
    assert compression.compression_block("int4/delta4") == {"uplink": {"codec": "int4"},
                                                            "downlink": {"codec": "delta4"}}
    with pytest.raises(ValueError):
        compression.compression_block("zip")
    fed = compression.federation("heart", 3)
    job = parse_round_config(compression.job_yaml(fed, "sa:none", rounds=2))
    assert job.privacy.secure_aggregation and job.sites.min == 3 and job.model.name == "mlp"
    assert compression.model_bytes(compression.federation("heart-wide").model) >= 40_000_000   # >= 10M float32


needs_compression = pytest.mark.skipif(compression.compression_available() is not None,
                                       reason=str(compression.compression_available()))


@needs_compression
@pytest.mark.parametrize("case", [c for c in compression.CODECS if c != "none"]
                         + ["int8/delta8", "none/fp16", "int4", "int4/delta4"])
def test_every_codec_runs_and_sends_less_than_none(heart, tmp_path, case):
    job = heart_job(heart, compression.compression_block(case))
    _, stats = compression.simulate(heart, job, "job-c", tmp_path)
    whole = 4 * compression.model_bytes(heart.model)   # none: each of the 4 hospitals moves the model each way
    up, _, down = case.partition("/")
    for r in stats:
        if up in ("fp16", "int8", "int4", "topk", "randk"):   # smaller by construction; adacomp's depends on Δ
            assert 0 < r["up"] < whole
    if down not in ("", "none"):                       # delta8 too from round 1: the chain starts from zeros
        assert all(0 < r["down"] < whole for r in stats)
    for variant in (case, f"sa:{case}") if up in compression.SECURE_CODECS else (case,):
        parse_round_config(compression.job_yaml(compression.federation("heart", 4), variant, rounds=2))
