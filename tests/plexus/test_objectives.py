"""plexus.objectives: the summed loss, gradient and Hessian against torch autograd and finite differences."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plexus import objectives
from plexus.models import Linear, build_model, state_to_numpy

ROWS = 30
CASES = {
    "binary logistic": ("logistic", {"in_features": 4, "num_classes": 2}),
    "3-class logistic": ("logistic", {"in_features": 4, "num_classes": 3}),
    "linear": ("linear", {"in_features": 4}),
    "mlp": ("mlp", {"in_features": 4, "hidden": [3], "num_classes": 3}),
}


def _case(case: str, *, dtype: str = "float64", seed: int = 0):
    name, args = CASES[case]
    model = build_model(name, {**args, "dtype": dtype}, seed=seed)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 4)) * np.array([1.0, 2.0, 0.5, 3.0])
    if name == "linear":
        y = x @ np.array([0.5, -1.0, 2.0, 0.1]) + rng.normal(size=ROWS)
    else:
        y = rng.integers(0, args["num_classes"], size=ROWS)
    return model, x, y


def _mean_loss(model, params: dict, x, y) -> torch.Tensor:
    """The plain mean loss as torch writes it (training's cross-entropy; half the MSE for regression)."""
    out = torch.func.functional_call(model, params, (torch.as_tensor(x),))
    if isinstance(model, Linear):
        return 0.5 * F.mse_loss(out.reshape(-1), torch.as_tensor(y))
    return F.cross_entropy(out, torch.as_tensor(y))


def _autograd_sums(model, x, y) -> tuple[np.ndarray, np.ndarray]:
    """n·∇ and n·∇² of the plain mean loss, by torch.autograd.functional over the flat parameters."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]

    def total(theta: torch.Tensor) -> torch.Tensor:
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(theta, sizes), shapes)}
        return len(y) * _mean_loss(model, params, x, y)

    theta = torch.as_tensor(objectives.flat_parameters(model))
    return (torch.autograd.functional.jacobian(total, theta).numpy(),
            torch.autograd.functional.hessian(total, theta).numpy())


def _at(model, theta: np.ndarray):
    """A copy of `model` with parameters `theta` (named_parameters order)."""
    moved = copy.deepcopy(model)
    with torch.no_grad():
        offset = 0
        for _, p in moved.named_parameters():
            p.copy_(torch.as_tensor(theta[offset:offset + p.numel()]).reshape(p.shape))
            offset += p.numel()
    return moved


@pytest.mark.parametrize("case", CASES)
def test_sums_equal_autograd_of_the_mean_loss_times_rows(case):
    model, x, y = _case(case)
    grad, hess = _autograd_sums(model, x, y)
    with torch.no_grad():
        mean = _mean_loss(model, dict(model.named_parameters()), x, y).item()
    assert objectives.loss_sum(model, x, y) == pytest.approx(ROWS * mean, rel=1e-13)
    assert np.allclose(objectives.row_losses(model, x, y).mean(), mean, rtol=1e-13, atol=0)
    assert np.abs(objectives.gradient_sum(model, x, y) - grad).max() <= 1e-10
    assert np.abs(objectives.hessian_sum(model, x, y) - hess).max() <= 1e-10


@pytest.mark.parametrize("case", CASES)
def test_sums_equal_central_finite_differences(case):
    model, x, y = _case(case, seed=1)
    theta = objectives.flat_parameters(model)
    d, h = len(theta), 1e-5
    grad = objectives.gradient_sum(model, x, y)
    hess = objectives.hessian_sum(model, x, y)
    assert grad.shape == (d,) and hess.shape == (d, d) and grad.dtype == hess.dtype == np.float64
    for j in range(d):
        step = np.zeros(d)
        step[j] = h
        up, down = _at(model, theta + step), _at(model, theta - step)
        slope = (objectives.loss_sum(up, x, y) - objectives.loss_sum(down, x, y)) / (2 * h)
        curve = (objectives.gradient_sum(up, x, y) - objectives.gradient_sum(down, x, y)) / (2 * h)
        assert slope == pytest.approx(grad[j], abs=1e-7)
        assert np.abs(curve - hess[:, j]).max() <= 1e-7


@pytest.mark.parametrize("case", CASES)
def test_each_row_is_clipped_to_the_norm_and_a_large_norm_clips_nothing(case):
    model, x, y = _case(case, seed=2)
    rows = np.stack([objectives.gradient_sum(model, x[i:i + 1], y[i:i + 1]) for i in range(ROWS)])
    norms = np.linalg.norm(rows, axis=1)
    clip = float(np.median(norms))   # half the rows are cut
    for i in range(ROWS):
        one = objectives.gradient_sum(model, x[i:i + 1], y[i:i + 1], clip_norm=clip)
        assert np.linalg.norm(one) <= clip
        assert np.allclose(one, rows[i] * min(1.0, clip / norms[i]), rtol=1e-11, atol=1e-15)
    clipped = objectives.gradient_sum(model, x, y, clip_norm=clip)
    assert np.allclose(clipped, (rows * np.minimum(1.0, clip / norms)[:, None]).sum(axis=0), rtol=0, atol=1e-10)
    assert not np.allclose(clipped, rows.sum(axis=0))
    assert np.allclose(objectives.gradient_sum(model, x, y, clip_norm=1e12), objectives.gradient_sum(model, x, y),
                       rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case", CASES)
def test_small_chunks_give_the_same_sums(case, monkeypatch):
    model, x, y = _case(case, seed=3)
    def sums():
        return (objectives.row_losses(model, x, y), objectives.gradient_sum(model, x, y),
                objectives.gradient_sum(model, x, y, clip_norm=0.5), objectives.hessian_sum(model, x, y))

    whole = sums()
    monkeypatch.setattr(objectives, "CHUNK_BYTES", 1)   # one row per chunk
    chunked = sums()
    assert all(np.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(whole, chunked))


def test_a_float32_model_is_evaluated_in_float64_and_left_as_it_was():
    model, x, y = _case("3-class logistic", dtype="float32")
    before = state_to_numpy(model)
    wide = copy.deepcopy(model).to(torch.float64)
    assert np.array_equal(objectives.gradient_sum(model, x, y), objectives.gradient_sum(wide, x, y))
    assert np.array_equal(objectives.hessian_sum(model, x, y), objectives.hessian_sum(wide, x, y))
    after = state_to_numpy(model)
    assert all(after[k].dtype == np.float32 and after[k].tobytes() == before[k].tobytes() for k in before)


def test_dropout_is_off():
    model = build_model("mlp", {"in_features": 4, "hidden": [8], "num_classes": 2, "dropout": 0.5,
                                "dtype": "float64"}, seed=0)
    _, x, y = _case("binary logistic")
    model.train()
    assert np.array_equal(objectives.gradient_sum(model, x, y), objectives.gradient_sum(model, x, y))
    assert model.training   # the caller's mode is untouched


def test_dimension_and_parameter_order():
    model, _, _ = _case("3-class logistic")
    theta = objectives.flat_parameters(model)
    assert objectives.dimension(model) == len(theta) == 3 * 4 + 3
    assert np.array_equal(theta[:12], model.linear.weight.detach().numpy().reshape(-1))
    assert np.array_equal(theta[12:], model.linear.bias.detach().numpy())


def test_bad_inputs_are_refused():
    model, x, y = _case("binary logistic")
    with pytest.raises(TypeError, match="integer class labels"):
        objectives.gradient_sum(model, x, y.astype(np.float64))
    with pytest.raises(ValueError, match=r"labels must be in 0\.\.1"):
        objectives.gradient_sum(model, x, y + 1)
    with pytest.raises(ValueError, match="same number of rows"):
        objectives.loss_sum(model, x, y[:-1])
    with pytest.raises(ValueError, match="clip_norm"):
        objectives.gradient_sum(model, x, y, clip_norm=0.0)
