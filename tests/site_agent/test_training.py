from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plexus.datasets import heart_disease
from plexus.errors import ConfigError
from plexus.models import build_model, state_to_numpy
from site_agent.training import TrainResult, evaluate, roc_auc, train_local

from overlap import overlapping


def _train(epochs=5, batch_size=32, name="adam", lr=0.01, momentum=0.0, weight_decay=0.0):
    return SimpleNamespace(
        epochs=epochs,
        batch_size=batch_size,
        optimizer=SimpleNamespace(name=name, lr=lr, momentum=momentum, weight_decay=weight_decay),
    )


@pytest.fixture(scope="module")
def cleveland():
    return heart_disease("cleveland")


# roc_auc


def test_roc_auc_perfect_and_inverted():
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.9, 0.8, 0.2, 0.1])) == 0.0


def test_roc_auc_hand_computed():
    # Pairs (pos, neg): 0.8>0.4 yes, 0.8>0.3 yes, 0.35>0.4 no, 0.35>0.3 yes -> 3/4
    assert roc_auc(np.array([0, 1, 0, 1]), np.array([0.4, 0.8, 0.3, 0.35])) == pytest.approx(0.75)


def test_roc_auc_ties_count_half():
    # Pairs: (0.5 vs 0.5) tie = 1/2, (0.5 vs 0.1) = 1, (0.9 vs 0.5) = 1, (0.9 vs 0.1) = 1 -> 3.5/4
    assert roc_auc(np.array([1, 0, 1, 0]), np.array([0.5, 0.5, 0.9, 0.1])) == pytest.approx(0.875)
    assert roc_auc(np.array([0, 1, 0, 1]), np.full(4, 0.3)) == pytest.approx(0.5)


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=60)
    scores = rng.integers(0, 6, size=60).astype(float)  # many ties
    pos, neg = scores[y == 1], scores[y == 0]
    expected = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert roc_auc(y, scores) == pytest.approx(expected)


def test_roc_auc_rejects_one_class_and_bad_input():
    with pytest.raises(ValueError, match="one class"):
        roc_auc(np.array([1, 1]), np.array([0.2, 0.3]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        roc_auc(np.array([0, 2]), np.array([0.2, 0.3]))
    with pytest.raises(ValueError, match="equal length"):
        roc_auc(np.array([0, 1]), np.array([0.2]))


# train_local / evaluate


def test_training_lowers_loss_on_cleveland(cleveland):
    model = build_model("logistic", {"in_features": 13}, seed=0)
    before = evaluate(model, cleveland.x_train, cleveland.y_train)["loss"]
    result = train_local(model, cleveland.x_train, cleveland.y_train, _train(epochs=20), seed=0)
    after = evaluate(model, cleveland.x_train, cleveland.y_train)["loss"]
    assert isinstance(result, TrainResult)
    assert result.num_samples == 199
    assert result.steps == 20 * 7  # ceil(199 / 32) batches per epoch
    assert after < before - 0.1
    assert result.metrics["train_loss"] < before
    assert evaluate(model, cleveland.x_test, cleveland.y_test)["accuracy"] > 0.7


@pytest.mark.parametrize("optimizer", [dict(name="adam"), dict(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)])
def test_training_is_bit_for_bit_deterministic(cleveland, optimizer):
    args = {"in_features": 13, "hidden": [16], "dropout": 0.3}

    def run(seed):
        model = build_model("mlp", args, seed=0)
        result = train_local(model, cleveland.x_train, cleveland.y_train, _train(epochs=3, **optimizer), seed=seed)
        return state_to_numpy(model), result

    (a, ra), (b, rb), (c, _) = run(1), run(1), run(2)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert ra == rb
    assert any(a[k].tobytes() != c[k].tobytes() for k in a)


def test_two_trainings_in_two_threads_that_overlap_each_draw_from_their_own_seed(cleveland):
    """Dropout draws from torch's one global RNG: a training that starts while another is under way and is under
    way itself when the other ends (several site agents in one process) still draws from its own seed alone."""
    args = {"in_features": 13, "hidden": [16], "dropout": 0.3}

    def run(seed, pause=None):
        model = build_model("mlp", args, seed=0)
        paused = []
        hook = (lambda: paused or (paused.append(1), pause())) if pause else None   # after the first step only
        train_local(model, cleveland.x_train, cleveland.y_train, _train(epochs=2), seed=seed, grad_hook=hook)
        return state_to_numpy(model)

    alone = {seed: run(seed) for seed in (1, 2)}
    got = overlapping(run)
    for seed in (1, 2):
        assert all(got[seed][k].tobytes() == alone[seed][k].tobytes() for k in alone[seed]), seed


def test_training_leaves_global_rng_and_mode(cleveland):
    model = build_model("mlp", {"in_features": 13, "dropout": 0.5}, seed=0)
    model.eval()
    before = torch.get_rng_state()
    train_local(model, cleveland.x_train, cleveland.y_train, _train(epochs=1), seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    assert not model.training


def test_evaluate_fields(cleveland):
    model = build_model("logistic", {"in_features": 13}, seed=0)
    metrics = evaluate(model, cleveland.x_test, cleveland.y_test)
    assert set(metrics) == {"loss", "accuracy", "num_samples", "auc"}
    assert metrics["num_samples"] == 104.0
    assert 0.0 <= metrics["accuracy"] <= 1.0 and 0.0 <= metrics["auc"] <= 1.0
    logits = model(torch.from_numpy(cleveland.x_test)).detach()
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(cleveland.y_test)).item()
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6)


def test_evaluate_without_auc():
    x = np.zeros((4, 3), dtype=np.float32)
    one_class = evaluate(build_model("logistic", {"in_features": 3}, seed=0), x, np.ones(4, dtype=np.int64))
    assert "auc" not in one_class
    three = build_model("logistic", {"in_features": 3, "num_classes": 3}, seed=0)
    three_way = evaluate(three, x, np.array([0, 1, 2, 1]))
    assert "auc" not in three_way and three_way["num_samples"] == 4.0


def test_empty_training_data_is_refused():
    model = build_model("logistic", {"in_features": 3}, seed=0)
    with pytest.raises(ValueError, match="no training samples"):
        train_local(model, np.zeros((0, 3), dtype=np.float32), np.zeros(0, dtype=np.int64), _train(), seed=0)


def test_bad_inputs_are_refused():
    model = build_model("logistic", {"in_features": 3}, seed=0)
    x = np.zeros((4, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="same number of rows"):
        train_local(model, x, np.zeros(3, dtype=np.int64), _train(), seed=0)
    with pytest.raises(ValueError, match="labels must be in 0..1"):
        train_local(model, x, np.array([0, 1, 2, 0]), _train(), seed=0)
    with pytest.raises(ConfigError, match=r"unknown optimizer 'rmsprop'.*\['adam', 'sgd'\]"):
        train_local(model, x, np.zeros(4, dtype=np.int64), _train(name="rmsprop"), seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        train_local(model, x, np.zeros(4, dtype=np.int64), _train(batch_size=0), seed=0)
    with pytest.raises(ConfigError, match="momentum"):
        train_local(model, x, np.zeros(4, dtype=np.int64), _train(name="adam", momentum=0.9), seed=0)


# float64 and regression models (the exact strategies' models)


def test_a_float64_model_trains_and_evaluates_on_float32_rows(cleveland):
    model = build_model("logistic", {"in_features": 13, "dtype": "float64"}, seed=0)
    result = train_local(model, cleveland.x_train, cleveland.y_train, _train(epochs=1), seed=0)
    assert result.steps > 0 and {a.dtype for a in state_to_numpy(model).values()} == {np.dtype(np.float64)}
    assert evaluate(model, cleveland.x_test, cleveland.y_test)["accuracy"] > 0


def test_a_regression_model_evaluates_its_squared_error_and_is_not_trained_by_minibatches():
    model = build_model("linear", {"in_features": 2, "dtype": "float64"}, seed=0)
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.linear.bias.fill_(0.5)
    x = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], np.float32)
    y = np.array([1.0, -1.0, 0.0])   # predictions 1.5, -1.5, -1.5: errors 0.5, -0.5, -1.5
    assert evaluate(model, x, y) == pytest.approx({"loss": 0.5 * 2.75 / 3, "mse": 2.75 / 3, "num_samples": 3.0})
    with pytest.raises(ConfigError, match="regression model.*lbfgs or newton"):
        train_local(model, x, y, _train(), seed=0)
