"""Tests for site_agent.training.train_local_dp_sgd: Opacus DP-SGD, reproducible, accounted across rounds."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plexus.accounting import PrivacyLedger, dp_sgd_epsilon
from plexus.config import DPSGDSpec, PolicySpec, parse_round_config
from plexus.errors import ConfigError
from plexus.models import build_model, state_to_numpy
from site_agent.policy import refusal
from site_agent.training import evaluate, train_local_dp_sgd

# Opacus's per-sample hooks make torch note that the input needs no gradient; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

TRAIN = SimpleNamespace(epochs=2, batch_size=20, optimizer=SimpleNamespace(name="sgd", lr=0.2, momentum=0.0,
                                                                          weight_decay=0.0))
DP_SGD = DPSGDSpec(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 6)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return x, y


def _model(dropout=0.0):
    return build_model("mlp", {"in_features": 6, "hidden": [8], "dropout": dropout}, seed=0)


def test_same_seeds_give_the_same_bits(data):
    runs = []
    for _ in range(2):
        model = _model(dropout=0.2)
        result = train_local_dp_sgd(model, *data, TRAIN, DP_SGD, seed=3, dp_seed=11)
        runs.append((state_to_numpy(model), result))
    (a, ra), (b, rb) = runs
    assert ra == rb
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    other = _model(dropout=0.2)
    train_local_dp_sgd(other, *data, TRAIN, DP_SGD, seed=3, dp_seed=12)
    assert any(not np.array_equal(a[n], v) for n, v in state_to_numpy(other).items())


def test_without_dp_seed_the_noise_is_fresh(data):
    a, b = _model(), _model()
    train_local_dp_sgd(a, *data, TRAIN, DP_SGD, seed=3)
    train_local_dp_sgd(b, *data, TRAIN, DP_SGD, seed=3)
    assert any(not np.array_equal(x, y) for x, y in zip(state_to_numpy(a).values(), state_to_numpy(b).values()))


def test_epsilon_accumulates_across_rounds_and_equals_the_policy_estimate(data):
    ledger = PrivacyLedger()
    model = _model()
    for round_ in (1, 2, 3):
        restored = PrivacyLedger.from_json(ledger.to_json())  # persisted between rounds by the agent
        result = train_local_dp_sgd(model, *data, TRAIN, DP_SGD, seed=round_, ledger=restored, dp_seed=round_)
        ledger = restored
        expected = dp_sgd_epsilon(round_, train_size=100, batch_size=20, epochs=2, noise_multiplier=1.0, delta=1e-5)
        assert result.metrics["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert result.steps == 2 * 5 and result.num_samples == 100
    job = parse_round_config(
        "name: j\nmodel: {name: mlp, args: {in_features: 6, hidden: [8]}}\ndata: {dataset: d}\nrounds: 3\n"
        "train: {epochs: 2, batch_size: 20, optimizer: {name: sgd, lr: 0.2}}\n"
        "privacy: {dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0, delta: 1.0e-5}}\n")
    policy = PolicySpec(allowed_models=("mlp",), max_epsilon=result.metrics["epsilon"])
    assert refusal(policy, job, {"mlp"}, train_size=100) is None
    assert refusal(dataclasses.replace(policy, max_epsilon=result.metrics["epsilon"] * 0.999),
                   job, {"mlp"}, train_size=100) is not None


def test_model_learns_and_is_left_clean(data):
    model = _model()
    before = evaluate(model, *data)["accuracy"]
    sgd = SimpleNamespace(**{**vars(TRAIN.optimizer), "lr": 1.0})
    train_local_dp_sgd(model, *data, SimpleNamespace(**{**vars(TRAIN), "epochs": 4, "optimizer": sgd}),
                       DPSGDSpec(noise_multiplier=0.3, max_grad_norm=1.0), seed=0, dp_seed=0)
    assert evaluate(model, *data)["accuracy"] > max(before, 0.8)
    for param in model.parameters():
        assert not hasattr(param, "grad_sample") and not hasattr(param, "summed_grad")
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    model(torch.zeros(2, 6)).sum().backward()  # a plain model again: no Opacus hooks fire


def test_unsupported_layers_are_a_config_error(data):
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="cannot be trained with DP-SGD"):
        train_local_dp_sgd(model, *data, TRAIN, DP_SGD, seed=0, dp_seed=0)
