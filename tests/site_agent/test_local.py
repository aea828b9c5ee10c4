import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from torch import nn

from plexus.config import STRATEGY_ARGS, DataSpec, ModelSpec, OptimizerSpec, RoundConfig, StrategySpec, TrainSpec
from plexus.datasets import Split
from plexus.errors import ConfigError
from plexus.models import build_job_model, build_model, load_numpy_state, state_to_numpy
from plexus.wire import Layout
from site_agent.local import (
    LOCAL,
    PLAIN,
    LocalResult,
    gradient_correction,
    local_update,
    proximal_term,
    scaffold_path,
    served_layout,
)
from site_agent.training import train_local


def _data(n=24, features=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.normal(size=n) > 0).astype(np.int64)
    return Split(x_train=x, y_train=y, x_test=x, y_test=y, num_classes=2, feature_names=())


def _job(strategy="fedavg", args=None, *, lr=0.1, batch_size=8, epochs=1, steps=None, features=3):
    return RoundConfig(name="t", model=ModelSpec("logistic", {"in_features": features}), data=DataSpec("d"),
                       rounds=1, strategy=StrategySpec(strategy, args or {}),
                       train=TrainSpec(epochs=epochs, steps=steps, batch_size=batch_size,
                                       optimizer=OptimizerSpec(name="sgd", lr=lr)), seed=3)


def _same_bits(a, b):
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def _model(job):
    return build_job_model(job)


def _served(job, model, extras=None):
    return {**state_to_numpy(model), **(extras or {})}


def _logistic_step(w, b, x, y, lr, extra_w=0.0, extra_b=0.0):
    """One full-batch SGD step of mean cross-entropy by hand (float64): grad_W = (p − onehot)ᵀx / N."""
    logits = x @ w.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    err = p - np.eye(w.shape[0])[y]
    gw = err.T @ x / len(y) + extra_w
    gb = err.mean(0) + extra_b
    return w - lr * gw, b - lr * gb


class _Recorder(nn.Module):
    """A logistic model that remembers which rows each forward pass saw (column 0 holds the row id)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.seen = []

    def forward(self, x):
        self.seen.append(x[:, 0].long().tolist())
        return self.linear(x)


class _WithBatchNorm(nn.Module):
    def __init__(self, features=3):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.BatchNorm1d(features)
        self.linear = nn.Linear(features, 2)

    def forward(self, x):
        return self.linear(self.norm(x))


# train_local: steps mode


def test_steps_mode_takes_exactly_that_many_steps_reshuffling_each_pass():
    x = np.stack([np.arange(10), np.ones(10)], 1).astype(np.float32)
    y = np.arange(10) % 2
    model = _Recorder()
    result = train_local(model, x, y, TrainSpec(batch_size=4, optimizer=OptimizerSpec(lr=0.01)), seed=1, steps=6)
    assert result.steps == 6 and len(model.seen) == 6
    first, second = sum(model.seen[:3], []), sum(model.seen[3:], [])
    assert sorted(first) == sorted(second) == list(range(10))  # 3 steps of 4, 4, 2 rows = one pass each
    assert first != second  # a fresh permutation per pass

    model = _Recorder()
    assert train_local(model, x, y, TrainSpec(batch_size=4, optimizer=OptimizerSpec(lr=0.01)),
                       seed=1, steps=7).steps == 7
    assert [len(b) for b in model.seen] == [4, 4, 2, 4, 4, 2, 4]


def test_steps_come_from_the_argument_then_train_steps_then_epochs():
    data = _data()
    job = _job(steps=5, batch_size=8)
    assert train_local(_model(job), data.x_train, data.y_train, job.train, seed=0).steps == 5
    assert train_local(_model(job), data.x_train, data.y_train, job.train, seed=0, steps=2).steps == 2
    job = _job(epochs=2, batch_size=10)  # 24 rows: 3 steps a pass
    assert train_local(_model(job), data.x_train, data.y_train, job.train, seed=0).steps == 6


def test_steps_mode_is_bit_for_bit_deterministic():
    data = _data()
    job = _job(steps=9, batch_size=5)
    runs = []
    for seed in (4, 4, 5):
        model = _model(job)
        result = train_local(model, data.x_train, data.y_train, job.train, seed=seed)
        runs.append((state_to_numpy(model), result.metrics["train_loss"]))
    assert _same_bits(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert not _same_bits(runs[0][0], runs[2][0])


def test_steps_mode_loss_averages_every_step():
    data = _data()
    job = _job(batch_size=7, lr=1e-12)  # the model does not move, so every pass sees the same loss
    model = _model(job)
    full = nn.functional.cross_entropy(model(torch.from_numpy(data.x_train)), torch.from_numpy(data.y_train)).item()
    result = train_local(model, data.x_train, data.y_train, job.train, seed=0, steps=8)  # two whole passes
    assert result.metrics["train_loss"] == pytest.approx(full, rel=1e-5)


def test_bad_steps_are_refused():
    data = _data()
    job = _job()
    with pytest.raises(ValueError, match="steps must be >= 1"):
        train_local(_model(job), data.x_train, data.y_train, job.train, seed=0, steps=0)
    with pytest.raises(TypeError, match="steps must be an integer"):
        train_local(_model(job), data.x_train, data.y_train, job.train, seed=0, steps=2.0)
    with pytest.raises(ConfigError, match="train.steps"):
        train_local(_model(job), data.x_train, data.y_train, _job(steps=-1).train, seed=0)


# train_local: FedProx


def test_fedprox_large_mu_keeps_weights_near_the_anchor():
    data = _data(n=64)
    job = _job(lr=0.01, batch_size=8)
    start = _model(job)
    anchor = {n: p.detach().clone() for n, p in start.named_parameters()}

    def distance(mu):
        model = _model(job)
        term = proximal_term(model, anchor, mu) if mu else None
        train_local(model, data.x_train, data.y_train, job.train, seed=0, steps=40, loss_term=term)
        return sum(((p - anchor[n]) ** 2).sum().item() for n, p in model.named_parameters()) ** 0.5

    free, held = distance(0.0), distance(50.0)
    assert free > 0.05
    assert held < free / 10


def test_fedprox_step_matches_hand_computation():
    data = _data(n=6, features=1)
    job = _job(lr=0.3, batch_size=6, features=1)  # one full-batch step
    model = _model(job)
    w0 = model.linear.weight.detach().double().numpy().copy()
    b0 = model.linear.bias.detach().double().numpy().copy()
    aw, ab = w0 + np.array([[0.5], [-1.0]]), b0 + np.array([0.25, 2.0])
    anchor = {"linear.weight": torch.tensor(aw, dtype=torch.float32), "linear.bias": torch.tensor(ab)}
    mu = 0.7
    train_local(model, data.x_train, data.y_train, job.train, seed=0, steps=1,
                loss_term=proximal_term(model, anchor, mu))
    w1, b1 = _logistic_step(w0, b0, data.x_train.astype(np.float64), data.y_train, 0.3,
                            extra_w=mu * (w0 - aw), extra_b=mu * (b0 - ab))
    np.testing.assert_allclose(model.linear.weight.detach().numpy(), w1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.linear.bias.detach().numpy(), b1, rtol=0, atol=1e-6)


def test_fedprox_needs_a_complete_anchor():
    job = _job()
    model = _model(job)
    with pytest.raises(ValueError, match="anchor"):
        proximal_term(model, None, 0.1)
    with pytest.raises(ValueError, match=r"anchor lacks parameter\(s\) \['linear.weight'\]"):
        proximal_term(model, {"linear.bias": torch.zeros(2)}, 0.1)
    for mu in (-1.0, 0.0, float("nan"), True):
        with pytest.raises(ValueError, match="mu must be a finite number > 0"):
            proximal_term(model, {}, mu)
    with pytest.raises(ValueError, match=r"correction\['linear.bias'\] has shape \(3,\)"):
        gradient_correction(model, {"linear.weight": torch.zeros(2, 3), "linear.bias": torch.zeros(3)})


# train_local: SCAFFOLD correction


def test_correction_step_matches_hand_computation():
    data = _data(n=6, features=1)
    job = _job(lr=0.2, batch_size=6, features=1)
    model = _model(job)
    w0 = model.linear.weight.detach().double().numpy().copy()
    b0 = model.linear.bias.detach().double().numpy().copy()
    cw, cb = np.array([[0.3], [-0.6]]), np.array([1.5, -0.5])
    correction = {"linear.weight": torch.tensor(cw), "linear.bias": torch.tensor(cb)}
    train_local(model, data.x_train, data.y_train, job.train, seed=0, steps=1,
                grad_hook=gradient_correction(model, correction))
    w1, b1 = _logistic_step(w0, b0, data.x_train.astype(np.float64), data.y_train, 0.2, extra_w=cw, extra_b=cb)
    np.testing.assert_allclose(model.linear.weight.detach().numpy(), w1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.linear.bias.detach().numpy(), b1, rtol=0, atol=1e-6)


def test_zero_correction_and_a_zero_loss_term_change_nothing():
    data = _data()
    job = _job(steps=4)
    plain, other = _model(job), _model(job)
    train_local(plain, data.x_train, data.y_train, job.train, seed=2)
    zeros = {n: torch.zeros_like(p) for n, p in other.named_parameters()}
    train_local(other, data.x_train, data.y_train, job.train, seed=2, grad_hook=gradient_correction(other, zeros),
                loss_term=lambda: torch.zeros(()))
    assert _same_bits(state_to_numpy(plain), state_to_numpy(other))


def test_the_hooks_run_once_per_step_in_order():
    data = _data()
    job = _job(steps=3)
    model, calls = _model(job), []

    def term():
        calls.append("loss_term")
        return torch.zeros(())

    def hook():
        assert model.linear.weight.grad is not None   # after backward
        calls.append("grad_hook")

    train_local(model, data.x_train, data.y_train, job.train, seed=2, loss_term=term, grad_hook=hook)
    assert calls == ["loss_term", "grad_hook"] * 3


def test_every_strategy_has_a_site_half_and_only_those_that_need_served_tensors_keep_them():
    # Site and coordinator know the same strategies (lbfgs/newton's args come with branch exact-rule).
    assert sorted(LOCAL) == sorted(STRATEGY_ARGS)
    assert {name for name, half in LOCAL.items() if half.reads_served} == {"fedprox", "scaffold"}
    assert {name for name, half in LOCAL.items() if half is not PLAIN} == {"fedprox", "scaffold", "ensemble", "lbfgs",
                                                                           "newton"}
    with pytest.raises(ValueError, match=r"strategy 'fedsgd' is unknown to this site \(known: \['cwt', "):
        served_layout(_job("fedsgd"), _model(_job()))


# served_layout


def test_served_layout_is_the_model_plus_scaffold_control_variates():
    model = _WithBatchNorm()
    state = state_to_numpy(model)
    assert served_layout(_job("fedavg"), model) == Layout.of(state)
    layout = served_layout(_job("scaffold"), model)
    extras = {t.name: (t.dtype, t.shape) for t in layout.tensors if t.name.startswith("scaffold/")}
    assert extras == {f"scaffold/c/{n}": ("F32", a.shape) for n, a in state.items() if a.dtype.kind == "f"}
    assert "scaffold/c/norm.num_batches_tracked" not in extras
    assert {t.name for t in layout.tensors} - set(extras) == set(state)


def test_served_layout_of_an_ensemble_job_is_the_whole_ensemble():
    job = _job("ensemble", {"members": ["a", "b", "c"]})
    model = build_job_model(job)
    layout = served_layout(job, model)
    assert {t.name for t in layout.tensors} == {"weights"} | {f"members.{i}.linear.{p}" for i in range(3)
                                                               for p in ("weight", "bias")}


# local_update


def _update(job, model, served, data, tmp_path, *, site="a", job_id="job1", seed=7, local_steps=0):
    return local_update(job, model, served, data, site=site, job_id=job_id, seed=seed, local_steps=local_steps,
                        state_dir=tmp_path)


def test_default_strategies_train_plainly(tmp_path):
    data = _data()
    job = _job("fedavg")
    model, plain = _model(job), _model(job)
    out = _update(job, model, _served(job, model), data, tmp_path, local_steps=5)
    expected = train_local(plain, data.x_train, data.y_train, job.train, seed=7, steps=5)
    assert isinstance(out, LocalResult) and out.result == expected
    assert _same_bits(out.update, state_to_numpy(plain))
    out.commit()
    assert list(tmp_path.iterdir()) == []


def test_fedprox_local_update_uses_mu_and_the_served_anchor(tmp_path):
    data = _data()
    for args, mu in (({"mu": 3.0}, 3.0), ({}, 0.01)):
        job = _job("fedprox", args)
        model, plain = _model(job), _model(job)
        anchor = {n: p.detach().clone() for n, p in plain.named_parameters()}
        out = _update(job, model, _served(job, model), data, tmp_path)
        train_local(plain, data.x_train, data.y_train, job.train, seed=7, loss_term=proximal_term(plain, anchor, mu))
        assert _same_bits(out.update, state_to_numpy(plain))


def _scaffold_served(job, model, c):
    return _served(job, model, {f"scaffold/c/{n}": v for n, v in c.items()})


def test_scaffold_update_carries_the_control_variate_delta(tmp_path):
    data = _data()
    job = _job("scaffold", lr=0.05, batch_size=8)
    model = _WithBatchNorm()
    x = state_to_numpy(model)
    rng = np.random.default_rng(1)
    c = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in x.items() if a.dtype.kind == "f"}
    out = _update(job, model, _scaffold_served(job, model, c), data, tmp_path, local_steps=3)
    assert out.result.steps == 3
    params = {n for n, _ in model.named_parameters()}
    y = {n: out.update[n] for n in x}
    assert _same_bits(y, state_to_numpy(model))
    assert set(out.update) == set(x) | {f"scaffold/dc/{n}" for n in c}
    for n in c:
        dc = out.update[f"scaffold/dc/{n}"]
        assert dc.dtype == np.float32
        if n in params:  # c_k = 0: c_k⁺ = −c + (x − y)/(Kη)
            expected = -c[n].astype(np.float64) + (x[n].astype(np.float64) - y[n]) / (3 * 0.05)
            np.testing.assert_allclose(dc, expected, rtol=1e-5, atol=1e-5)
        else:  # float buffers keep c_k
            assert not dc.any()


def test_scaffold_local_step_uses_c_minus_c_k(tmp_path):
    data = _data(n=6, features=1)
    job = _job("scaffold", lr=0.2, batch_size=6, features=1)
    model = _model(job)
    w0 = model.linear.weight.detach().double().numpy().copy()
    b0 = model.linear.bias.detach().double().numpy().copy()
    c = {"linear.weight": np.array([[0.4], [-0.2]], np.float32), "linear.bias": np.array([0.1, 0.9], np.float32)}
    c_k = {"linear.weight": np.array([[-1.0], [0.5]], np.float32), "linear.bias": np.array([0.0, 0.25], np.float32)}
    path = scaffold_path(tmp_path, "job1")
    path.parent.mkdir(parents=True)
    save_file(c_k, str(path))
    out = _update(job, model, _scaffold_served(job, model, c), data, tmp_path, local_steps=1)
    corr = {n: c[n].astype(np.float64) - c_k[n] for n in c}
    w1, b1 = _logistic_step(w0, b0, data.x_train.astype(np.float64), data.y_train, 0.2,
                            extra_w=corr["linear.weight"], extra_b=corr["linear.bias"])
    np.testing.assert_allclose(out.update["linear.weight"], w1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out.update["linear.bias"], b1, rtol=0, atol=1e-6)
    # One SGD step: (x − y)/η = g + c − c_k, so c_k⁺ = g and Δc = g − c_k.
    g_w = (w0 - w1) / 0.2 - corr["linear.weight"]
    np.testing.assert_allclose(out.update["scaffold/dc/linear.weight"], g_w - c_k["linear.weight"], atol=1e-4)


def test_scaffold_c_k_persists_only_on_commit_and_survives_a_restart(tmp_path):
    data = _data()
    job = _job("scaffold", lr=0.05)
    path = scaffold_path(tmp_path, "job1")

    model = _model(job)
    c = {n: np.full(a.shape, 0.5, np.float32) for n, a in state_to_numpy(model).items()}
    first = _update(job, model, _scaffold_served(job, model, c), data, tmp_path, local_steps=4)
    assert not path.exists() and not path.parent.exists()  # nothing is written before commit
    first.commit()
    c_k = load_file(str(path))
    assert set(c_k) == set(c)
    for n in c:  # c_k was 0, so the stored c_k⁺ is Δc
        assert c_k[n].dtype == np.float32
        np.testing.assert_array_equal(c_k[n], first.update[f"scaffold/dc/{n}"])
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    stored = path.read_bytes()

    # A restarted site: new objects, the same state_dir. Served c = stored c_k makes the correction exactly 0.
    model, plain = _model(job), _model(job)
    second = _update(job, model, _scaffold_served(job, model, c_k), data, tmp_path, local_steps=4)
    train_local(plain, data.x_train, data.y_train, job.train, seed=7, steps=4)
    trained = state_to_numpy(plain)
    assert _same_bits({n: second.update[n] for n in trained}, trained)
    x = state_to_numpy(_model(job))
    for n in c:  # c_k⁺⁺ = c_k⁺ − c + (x − y)/(Kη) = (x − y)/(Kη)
        expected = (x[n].astype(np.float64) - trained[n]) / (4 * 0.05) - c_k[n]
        np.testing.assert_allclose(second.update[f"scaffold/dc/{n}"], expected, rtol=1e-5, atol=1e-5)
    assert path.read_bytes() == stored  # not committed: the file is untouched


def test_scaffold_refuses_a_stored_control_variate_of_another_model(tmp_path):
    data = _data()
    job = _job("scaffold")
    model = _model(job)
    c = {n: np.zeros(a.shape, np.float32) for n, a in state_to_numpy(model).items()}
    path = scaffold_path(tmp_path, "job1")
    path.parent.mkdir(parents=True)
    save_file({"linear.weight": np.zeros((2, 5), np.float32), "linear.bias": np.zeros(2, np.float32)}, str(path))
    with pytest.raises(ValueError, match=r"does not match this job's model.*linear.weight.*Delete the file"):
        _update(job, model, _scaffold_served(job, model, c), data, tmp_path)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"cannot be read.*Delete the file"):
        _update(job, model, _scaffold_served(job, model, c), data, tmp_path)


def test_scaffold_needs_the_served_control_variate(tmp_path):
    job = _job("scaffold")
    model = _model(job)
    with pytest.raises(ValueError, match="lacks tensor .scaffold/c/linear"):
        _update(job, model, _served(job, model), _data(), tmp_path)


def test_job_ids_cannot_escape_the_state_dir(tmp_path):
    for bad in ("../x", "a/b", "..", ""):
        with pytest.raises(ValueError, match="path separators"):
            scaffold_path(tmp_path, bad)


def test_ensemble_site_trains_only_its_own_member(tmp_path):
    data = _data()
    job = _job("ensemble", {"members": ["a", "b", "c"]})
    model = build_job_model(job)
    before = state_to_numpy(model)
    out = _update(job, model, _served(job, model), data, tmp_path, site="b", local_steps=3)
    assert out.result.steps == 3
    assert set(out.update) == set(before)
    changed = {n for n in before if before[n].tobytes() != out.update[n].tobytes()}
    assert changed == {"members.1.linear.weight", "members.1.linear.bias"}

    member = build_model("logistic", {"in_features": 3}, seed=0)
    load_numpy_state(member, {n.removeprefix("members.1."): before[n] for n in before if n.startswith("members.1.")})
    train_local(member, data.x_train, data.y_train, job.train, seed=7, steps=3)
    assert _same_bits({f"members.1.{n}": a for n, a in state_to_numpy(member).items()},
                      {n: out.update[n] for n in changed})


def test_ensemble_refuses_a_site_that_is_not_a_member(tmp_path):
    job = _job("ensemble", {"members": ["a", "b"]})
    model = build_job_model(job)
    with pytest.raises(ValueError, match="'z' is not a member"):
        _update(job, model, _served(job, model), _data(), tmp_path, site="z")
    with pytest.raises(TypeError, match="build_job_model"):
        _update(job, _model(_job()), {}, _data(), tmp_path, site="a")


class _Scalar(nn.Module):
    """A 0-d parameter: it travels on the wire as shape [1]."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        return self.scale * self.linear(x)


@pytest.mark.parametrize("strategy", ["fedprox", "scaffold"])
def test_zero_dim_parameters_work(tmp_path, strategy):
    job = _job(strategy, {"mu": 0.5} if strategy == "fedprox" else {})
    model = _Scalar()
    layout = served_layout(job, model)
    served = {t.name: np.full(t.shape, 0.1, np.float32) if t.name.startswith("scaffold/") else None
              for t in layout.tensors}
    served.update(state_to_numpy(model))
    out = _update(job, model, served, _data(), tmp_path, local_steps=2)
    assert Layout.of({k: v for k, v in out.update.items() if not k.startswith("scaffold/")}) == Layout.of(
        state_to_numpy(model))
    out.commit()
