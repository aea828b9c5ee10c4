"""The pooled and site-alone baselines (site_agent.baselines): what the demo and the benchmarks compare with."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from plexus.config import parse_round_config
from plexus.datasets import heart_disease
from plexus.demo import DEMO_ROUND_CONFIG
from plexus.models import build_job_model, state_to_numpy
from site_agent.baselines import compare, pooled, train_centrally
from site_agent.training import train_local


def test_pooled_stacks_every_sites_rows_in_order():
    a, b = heart_disease("cleveland"), heart_disease("va")
    both = pooled([a, b])
    assert np.array_equal(both.x_train, np.concatenate([a.x_train, b.x_train]))
    assert np.array_equal(both.y_test, np.concatenate([a.y_test, b.y_test]))
    assert (both.num_classes, both.feature_names) == (a.num_classes, a.feature_names)
    with pytest.raises(ValueError, match="at least one"):
        pooled([])


def test_train_centrally_is_one_seeded_train_local_per_seed():
    job = parse_round_config(DEMO_ROUND_CONFIG.format(rounds=2, sites=1))
    s = heart_disease("hungary")
    want = build_job_model(job)
    for seed in (0, 1):
        train_local(want, s.x_train, s.y_train, job.train, seed=seed)
    got = state_to_numpy(train_centrally(job, s.x_train, s.y_train, seeds=[0, 1]))
    assert all(np.array_equal(got[k], v) for k, v in state_to_numpy(want).items())
    other = state_to_numpy(train_centrally(job, s.x_train, s.y_train, seeds=[1, 0]))
    assert not all(np.array_equal(other[k], v) for k, v in got.items())


def test_the_demos_comparison_process_prints_the_scores_compare_gives(tmp_path):
    job_yaml = DEMO_ROUND_CONFIG.format(rounds=2, sites=2)
    job = parse_round_config(job_yaml)
    state = state_to_numpy(build_job_model(job))
    (tmp_path / "job.yaml").write_text(job_yaml)
    save_file(state, str(tmp_path / "m.safetensors"))
    done = subprocess.run([sys.executable, "-m", "site_agent.baselines", "--job", str(tmp_path / "job.yaml"),
                           "--model", str(tmp_path / "m.safetensors"), "--hospitals", "va,hungary", "--rounds", "2"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    want = compare(job, state, {h: heart_disease(h) for h in ("va", "hungary")}, seeds=range(2))
    assert got == want and list(got) == ["federated", "pooled", "va", "hungary"]
    assert set(got["va"]) == {"va", "hungary", "pooled", "pooled_auc"}
