"""The site half of lbfgs and newton: no training, the served model unchanged plus float64 sums over every
training row (exact/grad, exact/loss, exact/rows, exact/hessian); per-row clipping and a noise share under DP;
weight 1 in a secure round."""

from __future__ import annotations

import time

import numpy as np
import pytest

from plexus import objectives
from plexus.config import (
    SUMMING_STRATEGIES,
    DatasetSpec,
    DataSpec,
    DPSpec,
    ModelSpec,
    PolicySpec,
    PrivacySpec,
    RoundConfig,
    SecAggSpec,
    SiteConfig,
    SitesSpec,
    StrategySpec,
)
from plexus.datasets import Split
from plexus.dp import distributed_std
from plexus.errors import ConfigError
from plexus.models import build_job_model, load_numpy_state, state_to_numpy
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import EXACT_GRAD, EXACT_HESSIAN, EXACT_LOSS, EXACT_ROWS, Layout, assemble, decode, dtype_name
from site_agent import agent as agent_module
from site_agent.agent import SiteAgent
from site_agent.local import LOCAL, Gradient, Hessian, local_update, served_layout

from fake_coordinator import FakeCoordinator

ROWS, FEATURES = 40, 5


def _data(classes: int = 2, seed: int = 0) -> Split:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = rng.integers(0, classes, size=ROWS)
    return Split(x_train=x, y_train=y, x_test=x[:5], y_test=y[:5], num_classes=classes, feature_names=())


def _job(strategy: str, *, classes: int = 2, dtype: str = "float64", dp: DPSpec | None = None, secure=False,
         dataset: str = "d", features: int = FEATURES) -> RoundConfig:
    return RoundConfig(name="exact", model=ModelSpec("logistic", {"in_features": features, "num_classes": classes,
                                                                  "dtype": dtype}),
                       data=DataSpec(dataset), rounds=5, strategy=StrategySpec(strategy, {}), sites=SitesSpec(min=3),
                       # clip: secure aggregation must cover the sites' sums (a site refuses to send any it would cut)
                       privacy=PrivacySpec(secure_aggregation=secure, dp=dp, secagg=SecAggSpec(clip=4096)), seed=11)


def _run(job: RoundConfig, data: Split, tmp_path, round_: int = 1):
    model = build_job_model(job)
    before = state_to_numpy(model)
    local = local_update(job, model, before, data, site="a", job_id="j", seed=1, local_steps=0,
                         state_dir=tmp_path, round_=round_)
    return model, before, local


def test_the_registry_maps_lbfgs_to_gradient_and_newton_to_hessian():
    assert type(LOCAL["lbfgs"]) is Gradient and type(LOCAL["newton"]) is Hessian
    assert {"lbfgs", "newton"} <= SUMMING_STRATEGIES


@pytest.mark.parametrize("strategy", ["lbfgs", "newton"])
@pytest.mark.parametrize("classes, dtype", [(2, "float64"), (3, "float64"), (2, "float32")])
def test_the_update_is_the_served_model_unchanged_plus_the_sums_over_every_row(strategy, classes, dtype, tmp_path):
    job, data = _job(strategy, classes=classes, dtype=dtype), _data(classes)
    model, before, local = _run(job, data, tmp_path)
    d = (FEATURES + 1) * classes
    extras = {EXACT_GRAD: ("F64", (d,)), EXACT_LOSS: ("F64", (1,)), EXACT_ROWS: ("F64", (1,))}
    if strategy == "newton":
        extras[EXACT_HESSIAN] = ("F64", (d, d))
    wire = dtype_name(np.dtype(dtype))
    assert {n: (dtype_name(a.dtype), a.shape) for n, a in local.update.items()} == {
        "linear.bias": (wire, (classes,)), "linear.weight": (wire, (classes, FEATURES)), **extras}
    assert all(local.update[n].tobytes() == before[n].tobytes() for n in before)       # Δ = 0
    assert all(a.tobytes() == before[n].tobytes() for n, a in state_to_numpy(model).items())
    x, y = data.x_train, data.y_train
    assert np.array_equal(local.update[EXACT_GRAD], objectives.gradient_sum(model, x, y))
    assert local.update[EXACT_LOSS][0] == objectives.loss_sum(model, x, y)
    assert local.update[EXACT_ROWS][0] == ROWS
    if strategy == "newton":
        assert np.array_equal(local.update[EXACT_HESSIAN], objectives.hessian_sum(model, x, y))
    assert local.result.num_samples == ROWS and local.result.steps == 0
    assert local.result.metrics == {"train_loss": pytest.approx(objectives.loss_sum(model, x, y) / ROWS)}
    assert served_layout(job, model) == Layout.of(before)   # nothing served beside the model
    Layout.of(local.update)   # every tensor can travel


def test_the_gradient_is_taken_at_the_served_weights(tmp_path):
    job, data = _job("lbfgs"), _data()
    model = build_job_model(job)
    at_zero = {n: np.zeros_like(a) for n, a in state_to_numpy(model).items()}
    load_numpy_state(model, at_zero)
    local = local_update(job, model, at_zero, data, site="a", job_id="j", seed=1, local_steps=0, state_dir=tmp_path)
    # At w = 0 every class has p = ½: Σ(p − e_y) ⊗ [x, 1] by hand.
    r = 0.5 - np.eye(2)[data.y_train]
    x = data.x_train.astype(np.float64)
    assert np.allclose(local.update[EXACT_GRAD], np.concatenate([(r.T @ x).ravel(), r.sum(0)]), rtol=1e-14)
    assert local.update[EXACT_LOSS][0] == pytest.approx(ROWS * np.log(2), rel=1e-14)


def test_under_dp_rows_are_clipped_the_loss_is_zero_and_nothing_else_is_sent(tmp_path):
    dp = DPSpec(mode="central", noise_multiplier=1.0, clip_norm=0.5)
    job, data = _job("lbfgs", dp=dp), _data()
    model, before, local = _run(job, data, tmp_path)
    assert set(local.update) == set(before) | {EXACT_GRAD, EXACT_LOSS, EXACT_ROWS}
    assert np.array_equal(local.update[EXACT_GRAD],
                          objectives.gradient_sum(model, data.x_train, data.y_train, clip_norm=0.5))
    assert local.update[EXACT_LOSS].tolist() == [0.0] and local.update[EXACT_ROWS].tolist() == [ROWS]
    assert local.result.metrics == {}
    assert all(local.update[n].tobytes() == before[n].tobytes() for n in before)


def test_distributed_dp_adds_this_sites_noise_share_to_the_gradient_sum(tmp_path):
    dp = DPSpec(mode="distributed", noise_multiplier=2.0, clip_norm=0.5)
    job, data = _job("lbfgs", dp=dp, classes=3), _data(3)
    model, _, first = _run(job, data, tmp_path)
    _, _, second = _run(job, data, tmp_path)
    clipped = objectives.gradient_sum(model, data.x_train, data.y_train, clip_norm=0.5)
    noise = np.stack([first.update[EXACT_GRAD] - clipped, second.update[EXACT_GRAD] - clipped])
    std = distributed_std(2.0, 0.5, 3)   # the share for a sum over sites.min sites
    assert not np.array_equal(noise[0], noise[1])   # fresh, unpredictable noise every time
    assert np.all(noise != 0) and np.abs(noise).max() < 6 * std
    assert 0.4 * std < noise.std() < 2 * std


def test_newton_under_dp_is_refused_with_the_reason(tmp_path):
    job = _job("newton", dp=DPSpec(mode="central", noise_multiplier=1.0, clip_norm=0.5))
    with pytest.raises(ConfigError, match="newton cannot run under privacy.dp.*use strategy lbfgs"):
        _run(job, _data(), tmp_path)


# the agent ------------------------------------------------------------------------------------------------
@pytest.fixture
def agent(kit, tmp_path, monkeypatch):
    """Site "a" with the Cleveland hospital's rows; `handle(job, kind)` runs one task of a job built here (the
    config parser on this branch does not know lbfgs/newton yet, so the agent is handed the job itself)."""
    site = SiteAgent(SiteConfig(
        site="a", coordinator="127.0.0.1:1", kit=kit, state_dir=tmp_path / "state",
        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital="cleveland")},
        policy=PolicySpec(allowed_models=("logistic",))))

    def handle(job: RoundConfig, kind: int) -> FakeCoordinator:
        monkeypatch.setattr(agent_module, "parse_round_config", lambda text, source="": job)
        agent_module.round_config.cache_clear()   # every job here has the same text: parse it anew
        stub = FakeCoordinator(job)
        site.handle(stub, fpb.Task(kind=kind, task_id="t1", job_id="exact", round=1, config_yaml="(built)",
                                   nonce=b"n" * 16, deadline_unix_s=time.time() + 600, seed=7))
        return stub

    return handle


def _sent(stub: FakeCoordinator) -> tuple[fpb.UpdateHeader, dict[str, np.ndarray]]:
    (messages,) = stub.updates
    layout = Layout.from_proto(messages[0].header.manifest)
    return messages[0].header, decode(layout, assemble(layout, (m.chunk for m in messages[1:])))


@pytest.mark.parametrize("strategy", ["lbfgs", "newton"])
def test_the_agent_sends_the_served_model_and_the_sums(agent, strategy):
    job = _job(strategy, dataset="heart-disease", features=13)
    stub = agent(job, fpb.TASK_TRAIN)
    assert stub.results == []
    header, update = _sent(stub)
    served = stub.served()
    assert all(update[n].tobytes() == served[n].tobytes() for n in served)
    assert {EXACT_GRAD, EXACT_LOSS, EXACT_ROWS} <= set(update)
    assert (EXACT_HESSIAN in update) == (strategy == "newton")
    assert header.num_samples == update[EXACT_ROWS][0] > 0


def test_under_distributed_dp_the_agent_adds_no_dp_fedavg_noise_to_the_model(agent):
    dp = DPSpec(mode="distributed", noise_multiplier=1.0, clip_norm=1.0)
    stub = agent(_job("lbfgs", dataset="heart-disease", features=13, dp=dp), fpb.TASK_TRAIN)
    assert stub.results == []
    header, update = _sent(stub)
    served = stub.served()
    assert all(update[n].tobytes() == served[n].tobytes() for n in served)   # DP-FedAvg's share would move them
    assert update[EXACT_LOSS].tolist() == [0.0] and EXACT_HESSIAN not in update
    assert header.num_samples == 1 and dict(header.metrics) == {}


@pytest.mark.parametrize("strategy", ["lbfgs", "newton"])
def test_in_a_secure_round_the_agent_advertises_weight_1(agent, strategy):
    stub = agent(_job(strategy, dataset="heart-disease", features=13, secure=True), fpb.TASK_SECAGG_ADVERTISE)
    assert stub.results == []
    (message,) = stub.secagg
    assert message.advert.num_samples == 1   # not its rows: the rule sums, so a weight would scale its sums
