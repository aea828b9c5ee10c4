"""(ε, δ) accounting: RDP of the sampled Gaussian mechanism, a persistable ledger and budget arithmetic.

Client-level DP-FedAvg (the coordinator): one step per round at that round's
sampling rate q (`round_sampling_rate`), composed by `client_epsilon` with
Google's dp-accounting, which needs no torch. Sample-level DP-SGD (a site):
one step per local batch at the Poisson rate of the site's batches, with
Opacus's RDP accountant (`PrivacyLedger`, `epsilon_after`, `dp_sgd_*`), whose
step hook the site's training drives. We never compute RDP ourselves.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections import Counter

from plexus.errors import IntegrityError

# Opacus's RDPAccountant.DEFAULT_ALPHAS: client_epsilon with q = 1 equals what Opacus reported before.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def _rdp_accountant():
    # Imported on use: opacus imports torch, which a coordinator process must not carry.
    from opacus.accountants import RDPAccountant

    return RDPAccountant()


class PrivacyLedger:
    """The privacy spent so far, as Opacus's RDP history of (noise_multiplier, sample_rate, steps)."""

    def __init__(self, history: list[tuple[float, float, int]] | tuple = ()) -> None:
        self._accountant = _rdp_accountant()
        for z, q, n in history:
            self.step(z, q, steps=n)

    @property
    def accountant(self):
        """The wrapped Opacus accountant (Opacus's optimizer hooks may step it directly)."""
        return self._accountant

    @property
    def history(self) -> list[tuple[float, float, int]]:
        return [(float(z), float(q), int(n)) for z, q, n in self._accountant.history]

    def step(self, noise_multiplier: float, sample_rate: float, *, steps: int = 1) -> None:
        """Record `steps` applications of the sampled Gaussian mechanism."""
        z, q = _noise(noise_multiplier), _rate(sample_rate)
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
        if steps == 0:
            return
        history = self._accountant.history
        # Same merge rule as RDPAccountant.step: consecutive identical steps share one entry.
        if history and history[-1][:2] == (z, q):
            history[-1] = (z, q, history[-1][2] + int(steps))
        else:
            history.append((z, q, int(steps)))

    def epsilon(self, delta: float) -> float:
        """ε spent so far at `delta` (0.0 before any step, inf when a step had no noise)."""
        delta = _delta(delta)
        if not self._accountant.history:
            return 0.0
        if any(z == 0 for z, _, _ in self._accountant.history):
            return math.inf  # what Opacus returns too, without its warning about the alpha range
        return float(self._accountant.get_epsilon(delta=delta))

    def epsilon_if(self, noise_multiplier: float, sample_rate: float, delta: float, *, steps: int = 1) -> float:
        """ε after `steps` more steps, without recording them: ask before a round, not after."""
        trial = PrivacyLedger(self.history)
        trial.step(noise_multiplier, sample_rate, steps=steps)
        return trial.epsilon(delta)

    def to_json(self) -> str:
        return json.dumps([list(entry) for entry in self.history], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        try:
            entries = json.loads(text)
            if not isinstance(entries, list):
                raise ValueError("not a list")
            history = []
            for entry in entries:
                z, q, n = entry
                if isinstance(n, bool) or not isinstance(n, int):
                    raise ValueError(f"step count {n!r} is not an integer")
                history.append((z, q, n))
            return cls(history)
        except (ValueError, TypeError) as exc:
            raise IntegrityError(f"privacy ledger is corrupt ({exc}); expected a JSON list of "
                                 "[noise_multiplier, sample_rate, steps]") from None


def epsilon_after(rounds: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
    """ε after `rounds` identical steps of the sampled Gaussian mechanism."""
    ledger = PrivacyLedger()
    ledger.step(noise_multiplier, sample_rate, steps=rounds)
    return ledger.epsilon(delta)


def rounds_within(target_epsilon: float, noise_multiplier: float, sample_rate: float, delta: float,
                  max_rounds: int) -> int:
    """The most rounds (0..max_rounds) whose ε stays <= target_epsilon."""
    if not (isinstance(target_epsilon, numbers.Real) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a number > 0, got {target_epsilon!r}")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, numbers.Integral) or max_rounds < 0:
        raise ValueError(f"max_rounds must be a non-negative integer, got {max_rounds!r}")
    lo, hi = 0, int(max_rounds)  # ε grows with rounds: binary search for the last round within budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if epsilon_after(mid, noise_multiplier, sample_rate, delta) <= target_epsilon:
            lo = mid
        else:
            hi = mid - 1
    return lo


def round_sampling_rate(sampled: int, eligible: int, *, at_random: bool) -> float:
    """q of one DP-FedAvg round: `sampled` of `eligible` sites when the schedule draws them at random
    (sites.fraction / sites.count), else 1.0 (every site, or a schedule that picks them deterministically)."""
    for name, value in (("sampled", sampled), ("eligible", eligible)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if sampled > eligible:
        raise ValueError(f"cannot sample {sampled} of {eligible} eligible sites")
    if not at_random or sampled == eligible:
        return 1.0
    return _rate(sampled / eligible)


def client_epsilon(noise_multiplier: float, rates, delta: float, *, orders=RDP_ORDERS) -> float:
    """ε after one round per entry of `rates` (each round's q), the Poisson-subsampled Gaussian mechanism's
    RDP at `orders` summed over the rounds, with dp-accounting (no torch).

    dp-accounting 0.6 bounds the RDP of q < 1 at a fractional order from above (looser than Opacus; its
    integer orders agree with Opacus), so the result is the smaller of that bound and the one for q = 1
    in every round: sampling never reports more ε than every site taking part would.
    """
    z, qs, delta = _noise(noise_multiplier), [_rate(q) for q in rates], _delta(delta)
    if not qs:
        return 0.0
    if z == 0:
        return math.inf
    eps = _dp_accounting_epsilon(z, Counter(qs), delta, orders)
    if any(q != 1.0 for q in qs):
        eps = min(eps, _dp_accounting_epsilon(z, Counter({1.0: len(qs)}), delta, orders))
    return eps


def load_client_accountant() -> None:
    """Import dp-accounting now (about a second, once per process), e.g. outside a lock, so that the
    first client_epsilon does not pay for it."""
    from dp_accounting.rdp import rdp_privacy_accountant  # noqa: F401


def _dp_accounting_epsilon(z: float, rounds_at: Counter, delta: float, orders) -> float:
    # Imported on use: dp-accounting brings scipy (~70 MB), which a coordinator without DP jobs need not hold.
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    logging.getLogger("absl").addFilter(_unconverged_order)   # the same filter object is added once
    accountant = rdp_privacy_accountant.RdpAccountant(list(orders))
    for q, count in sorted(rounds_at.items()):   # RDP adds up: each distinct q is computed once
        accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), count)
    return float(accountant.get_epsilon(delta))


def _unconverged_order(record: logging.LogRecord) -> bool:
    """Drop dp-accounting's warning that an order's series did not converge: that order is left out of
    the minimum (its bound is infinite), which the docstring of client_epsilon covers, every round."""
    return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


def dp_sgd_schedule(train_size: int, batch_size: int, epochs: int) -> tuple[float, int]:
    """(accounted sample rate, steps per round) of one site's DP-SGD, exactly as Opacus's make_private runs it.

    Opacus samples with rate 1/ceil(n/B), runs int(1/rate) batches per epoch and
    accounts each step at 1/(batches per epoch); float rounding can make that one
    batch fewer and the accounted rate a little higher than the true one (so ε is
    slightly pessimistic). We replicate it so the policy's ε equals the site's.
    """
    for name, value in (("train_size", train_size), ("batch_size", batch_size), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    batches = int(1 / (1 / math.ceil(train_size / batch_size)))  # UniformWithReplacementSampler's int(1 / rate)
    return 1 / batches, epochs * batches  # make_private accounts at 1 / len(DPDataLoader)


def dp_sgd_epsilon(rounds: int, *, train_size: int, batch_size: int, epochs: int, noise_multiplier: float,
                   delta: float) -> float:
    """A site's sample-level ε after `rounds` rounds of DP-SGD on `train_size` rows."""
    sample_rate, steps = dp_sgd_schedule(train_size, batch_size, epochs)
    return epsilon_after(rounds * steps, noise_multiplier, sample_rate, delta)


def _noise(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {value!r}")
    return float(value)


def _rate(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {value!r}")
    return float(value)


def _delta(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 1:
        raise ValueError(f"delta must be in (0, 1), got {value!r}")
    return float(value)
