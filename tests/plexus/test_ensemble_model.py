import numpy as np
import pytest
import torch
from torch import nn

from plexus.config import DataSpec, ModelSpec, RoundConfig, StrategySpec
from plexus.errors import ConfigError
from plexus.models import Ensemble, Logistic, build_job_model, build_model, member_seed, state_to_numpy

ARGS = {"in_features": 4, "num_classes": 3}


def _same_bits(a, b):
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def _ensemble(k=3, seed=0):
    return build_model("logistic", ARGS, seed=seed, members=k)


def _expected(model, x, w):
    probs = torch.stack([torch.softmax(m(x), dim=-1) for m in model.members]).double()
    return torch.log((torch.tensor(w, dtype=torch.float64).view(-1, 1, 1) * probs).sum(0))


def test_forward_is_the_log_of_the_weighted_mixture():
    model = _ensemble()
    model.weights.copy_(torch.tensor([1.0, 3.0, 0.0]))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(out.double(), _expected(model, x, [0.25, 0.75, 0.0]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.exp().sum(1), torch.ones(5))


def test_zero_weights_mean_uniform():
    model = _ensemble()
    assert model.weights.dtype == torch.float32 and not model.weights.any()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x).double(), _expected(model, x, [1 / 3] * 3), rtol=1e-5, atol=1e-6)


def test_forward_is_finite_for_extreme_logits():
    model = _ensemble(2)
    with torch.no_grad():
        for member in model.members:
            member.linear.weight.fill_(0.0)
            member.linear.bias.copy_(torch.tensor([1e6, 0.0, -1e6]))
        out = model(torch.zeros(2, 4))
    assert torch.isfinite(out).all() and out.argmax(1).tolist() == [0, 0]


def test_state_names():
    names = set(_ensemble(2).state_dict())
    assert names == {"weights"} | {f"members.{i}.linear.{p}" for i in range(2) for p in ("weight", "bias")}


def test_members_are_deterministic_distinct_and_seeded_by_member_seed():
    a, b = _ensemble(seed=5), _ensemble(seed=5)
    assert _same_bits(state_to_numpy(a), state_to_numpy(b))
    assert not _same_bits(state_to_numpy(a), state_to_numpy(_ensemble(seed=6)))
    members = [state_to_numpy(m) for m in a.members]
    assert not _same_bits(members[0], members[1]) and not _same_bits(members[1], members[2])
    for i, member in enumerate(members):
        assert _same_bits(member, state_to_numpy(build_model("logistic", ARGS, seed=member_seed(5, i))))


def test_member_seed_is_distinct_and_in_range():
    seeds = [member_seed(s, i) for s in (0, 1, 2**63 - 1) for i in range(200)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert member_seed(7, 3) == member_seed(7, 3)


@pytest.mark.parametrize("members", [1, -1, -5])
def test_too_few_members_are_refused(members):
    with pytest.raises(ConfigError, match="at least 2 members"):
        build_model("logistic", ARGS, seed=0, members=members)
    with pytest.raises(ConfigError, match="at least 2 members"):
        Ensemble([Logistic(4)])


def test_plain_build_is_unchanged():
    plain = build_model("logistic", ARGS, seed=3)
    assert isinstance(plain, Logistic)
    assert _same_bits(state_to_numpy(plain), state_to_numpy(build_model("logistic", ARGS, seed=3, members=0)))
    with pytest.raises(TypeError, match="members must be an integer"):
        build_model("logistic", ARGS, seed=3, members=True)


def _job(strategy, args=None):
    return RoundConfig(name="t", model=ModelSpec("logistic", ARGS), data=DataSpec("d"), rounds=1,
                       strategy=StrategySpec(strategy, args or {}), seed=11)


def test_build_job_model():
    model = build_job_model(_job("ensemble", {"members": ["a", "b", "c", "d"]}))
    assert isinstance(model, Ensemble) and len(model.members) == 4
    assert _same_bits(state_to_numpy(model), state_to_numpy(build_model("logistic", ARGS, seed=11, members=4)))
    plain = build_job_model(_job("fedavg"))
    assert isinstance(plain, Logistic)
    assert _same_bits(state_to_numpy(plain), state_to_numpy(build_model("logistic", ARGS, seed=11)))
    with pytest.raises(ConfigError, match="strategy.args.members must be a list"):
        build_job_model(_job("ensemble", {"members": "ab"}))


def test_ensemble_trains_as_logits():
    model = _ensemble(2)
    x = torch.randn(8, 4)
    loss = nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert np.isfinite(loss.item())
