"""Tests for plexus.accounting: every ε equals Opacus's own RDP accountant for the same schedule and orders."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from opacus.accountants import RDPAccountant

from plexus.accounting import (
    RDP_ORDERS,
    PrivacyLedger,
    client_epsilon,
    dp_sgd_epsilon,
    dp_sgd_schedule,
    epsilon_after,
    round_sampling_rate,
    rounds_within,
)
from plexus.errors import IntegrityError


def _opacus(schedule, delta, alphas=None):
    accountant = RDPAccountant()
    for z, q, steps in schedule:
        for _ in range(steps):
            accountant.step(noise_multiplier=z, sample_rate=q)
    return accountant.get_epsilon(delta=delta, alphas=alphas)


def _close(ours, theirs):
    return abs(ours - theirs) <= 1e-6 * max(1.0, abs(theirs))


INTEGER_ORDERS = list(range(2, 64))


def test_rdp_orders_are_opacus_defaults():
    assert list(RDP_ORDERS) == RDPAccountant.DEFAULT_ALPHAS


@pytest.mark.parametrize("z", [0.5, 0.8, 1.0, 1.1, 2.0, 4.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-7])
def test_client_epsilon_with_every_site_equals_opacus(z, delta):
    """q = 1 (no sampling): the figures the coordinator reported through Opacus before, to 1e-6."""
    for rounds in (1, 3, 10, 100):
        assert _close(client_epsilon(z, [1.0] * rounds, delta), _opacus([(z, 1.0, rounds)], delta))
        assert _close(client_epsilon(z, [1.0] * rounds, delta), epsilon_after(rounds, z, 1.0, delta))


@pytest.mark.filterwarnings("ignore:Optimal order:UserWarning")
@pytest.mark.parametrize("z", [0.8, 1.0, 1.5, 3.0])
@pytest.mark.parametrize("q", [0.05, 0.3, 0.5, 0.9])
def test_client_epsilon_equals_opacus_at_the_same_orders(z, q):
    for rounds, delta in ((1, 1e-5), (20, 1e-6), (200, 1e-3)):
        assert _close(client_epsilon(z, [q] * rounds, delta, orders=INTEGER_ORDERS),
                      _opacus([(z, q, rounds)], delta, INTEGER_ORDERS))


@pytest.mark.filterwarnings("ignore:Optimal order:UserWarning")
def test_client_epsilon_composes_each_rounds_rate():
    rates = [0.5, 0.5, 1.0, 0.25, 0.5]
    schedule = [(1.2, 0.5, 2), (1.2, 1.0, 1), (1.2, 0.25, 1), (1.2, 0.5, 1)]
    assert _close(client_epsilon(1.2, rates, 1e-5, orders=INTEGER_ORDERS),
                  _opacus(schedule, 1e-5, INTEGER_ORDERS))
    assert client_epsilon(1.2, rates, 1e-5) == client_epsilon(1.2, sorted(rates), 1e-5)   # RDP adds up


@pytest.mark.filterwarnings("ignore:Optimal order:UserWarning")
@pytest.mark.parametrize(("z", "q"), [(0.8, 0.1), (1.1, 0.3), (2.0, 0.5), (1.0, 0.9), (4.0, 0.75)])
def test_client_epsilon_with_sampling_is_a_bound_between_opacus_orders(z, q):
    """At Opacus's orders dp-accounting's fractional-order RDP for q < 1 is an upper bound: ε is no less
    than Opacus's, no more than Opacus's over integer orders only, and never more than with q = 1."""
    for rounds, delta in ((1, 1e-5), (50, 1e-5), (300, 1e-6)):
        ours = client_epsilon(z, [q] * rounds, delta)
        assert _opacus([(z, q, rounds)], delta) - 1e-9 <= ours
        assert ours <= _opacus([(z, q, rounds)], delta, INTEGER_ORDERS) + 1e-9
        assert ours <= client_epsilon(z, [1.0] * rounds, delta)


def test_client_epsilon_edges_and_bad_input():
    assert client_epsilon(1.0, [], 1e-5) == 0.0
    assert math.isinf(client_epsilon(0.0, [1.0, 0.5], 1e-5))
    for rates in ([0.0], [1.5], [True]):
        with pytest.raises(ValueError, match="sample_rate must be in"):
            client_epsilon(1.0, rates, 1e-5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        client_epsilon(-1.0, [1.0], 1e-5)
    with pytest.raises(ValueError, match="delta"):
        client_epsilon(1.0, [1.0], 0.0)


def test_client_epsilon_runs_without_torch():
    code = ("import sys, plexus.accounting as a; e = a.client_epsilon(1.1, [0.5, 1.0], 1e-5); "
            "assert e > 0 and 'torch' not in sys.modules and 'opacus' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_round_sampling_rate_is_sampled_over_eligible_only_for_random_draws():
    assert round_sampling_rate(3, 10, at_random=True) == 0.3
    assert round_sampling_rate(10, 10, at_random=True) == 1.0
    assert round_sampling_rate(1, 4, at_random=False) == 1.0   # cwt, swt, ensemble: no amplification
    assert round_sampling_rate(4, 4, at_random=False) == 1.0
    with pytest.raises(ValueError, match="cannot sample 5 of 4"):
        round_sampling_rate(5, 4, at_random=True)
    with pytest.raises(ValueError, match="sample_rate"):
        round_sampling_rate(0, 4, at_random=True)
    with pytest.raises(ValueError, match="eligible must be"):
        round_sampling_rate(1, -1, at_random=True)


@pytest.mark.parametrize(("z", "q", "rounds", "delta"), [
    (1.0, 1.0, 10, 1e-5), (0.8, 0.5, 25, 1e-6), (2.0, 0.1, 100, 1e-5), (1.1, 1.0, 1, 1e-3)])
def test_epsilon_after_equals_opacus(z, q, rounds, delta):
    assert epsilon_after(rounds, z, q, delta) == _opacus([(z, q, rounds)], delta)


def test_ledger_matches_opacus_on_a_mixed_schedule_and_round_trips_json():
    schedule = [(1.0, 1.0, 3), (1.5, 0.25, 5), (1.0, 1.0, 2)]
    ledger = PrivacyLedger()
    for z, q, steps in schedule:
        for _ in range(steps):
            ledger.step(z, q)
    assert ledger.history == schedule
    assert ledger.epsilon(1e-5) == _opacus(schedule, 1e-5)
    restored = PrivacyLedger.from_json(ledger.to_json())
    assert restored.history == schedule and restored.epsilon(1e-5) == ledger.epsilon(1e-5)


def test_ledger_epsilon_if_does_not_record():
    ledger = PrivacyLedger([(1.0, 1.0, 4)])
    assert ledger.epsilon_if(1.0, 1.0, 1e-5) == epsilon_after(5, 1.0, 1.0, 1e-5)
    assert ledger.history == [(1.0, 1.0, 4)]


def test_empty_and_noiseless_ledgers():
    assert PrivacyLedger().epsilon(1e-5) == 0.0
    assert epsilon_after(0, 1.0, 1.0, 1e-5) == 0.0
    assert math.isinf(epsilon_after(3, 0.0, 1.0, 1e-5))


def test_ledger_rejects_bad_input():
    for text in ("{}", "[[1.0, 1.0]]", "[[1.0, 2.0, 3]]", "[[1.0, 1.0, 1.5]]", "not json"):
        with pytest.raises(IntegrityError, match="privacy ledger is corrupt"):
            PrivacyLedger.from_json(text)
    with pytest.raises(ValueError, match="sample_rate"):
        PrivacyLedger().step(1.0, 0.0)
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger().epsilon(1.0)


def test_rounds_within_is_the_last_round_inside_the_budget():
    z, q, delta, target = 2.0, 1.0, 1e-5, 8.0
    r = rounds_within(target, z, q, delta, max_rounds=1000)
    assert 1 < r < 1000
    assert epsilon_after(r, z, q, delta) <= target < epsilon_after(r + 1, z, q, delta)
    assert rounds_within(target, z, q, delta, max_rounds=r - 1) == r - 1
    assert rounds_within(1e-6, z, q, delta, max_rounds=10) == 0


def test_budget_stop_before_the_round_that_would_exceed():
    """The engine's rule: ask the ledger before each round, stop when the next one would pass the target."""
    target, z, delta = 5.0, 1.2, 1e-5
    ledger, ran = PrivacyLedger(), 0
    for _ in range(1000):
        if ledger.epsilon_if(z, 1.0, delta) > target:
            break
        ledger.step(z, 1.0)
        ran += 1
    assert ran == rounds_within(target, z, 1.0, delta, max_rounds=1000)
    assert ledger.epsilon(delta) <= target


@pytest.mark.filterwarnings("ignore:Secure RNG turned off:UserWarning")
def test_dp_sgd_schedule_matches_what_opacus_accounts():
    import torch
    from opacus import PrivacyEngine

    # 372 rows in batches of 4: 93 batches, and int(1 / (1/93)) == 92 in floating point.
    for n, batch in ((373, 4), (372, 4), (100, 10), (5, 32), (304, 32)):
        model = torch.nn.Linear(1, 2)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(n, 1)), batch_size=batch)
        engine = PrivacyEngine(accountant="rdp")
        _, optimizer, dp_loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
        optimizer.zero_grad()
        for p in model.parameters():  # one empty step, to read the rate Opacus's hook records
            p.grad_sample = torch.zeros(0, *p.shape)
        optimizer.step()
        (_, accounted_rate, _), = engine.accountant.history
        assert dp_sgd_schedule(n, batch, 3) == (accounted_rate, 3 * len(dp_loader))
    rate, steps = dp_sgd_schedule(373, 4, 2)
    assert dp_sgd_epsilon(3, train_size=373, batch_size=4, epochs=2, noise_multiplier=1.0, delta=1e-5) == \
        _opacus([(1.0, rate, 3 * steps)], 1e-5)
