"""Tests for plexus.accounting: every ε equals Opacus's own RDP accountant for the same schedule."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import RDPAccountant

from plexus.accounting import (PrivacyLedger, dp_sgd_epsilon, dp_sgd_schedule, epsilon_after,
                               rounds_within)
from plexus.errors import IntegrityError


def _opacus(schedule, delta):
    accountant = RDPAccountant()
    for z, q, steps in schedule:
        for _ in range(steps):
            accountant.step(noise_multiplier=z, sample_rate=q)
    return accountant.get_epsilon(delta=delta)


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
