"""Staleness weights for asynchronous training, shared by the coordinator and (under secure aggregation) sites.

An update computed from model version vᵢ and aggregated into the buffer of version v has staleness
τ = v − vᵢ; it weighs s(τ)·n (n: its training samples, or 1 under DP). The functions are FedAsync's
(Xie et al. 2019): constant 1, polynomial (1 + τ)^−a (FedBuff's 1/√(1 + τ) is a = 0.5), and hinge,
1 up to τ = b and 1 / (a(τ − b) + 1) after.

s(τ) is rounded down to a multiple of 2^−16 (`QUANTUM`), so every weight s·n (n ≤ 2^31) is a float64 with
at most 47 significant bits and any sum of them is exact: a buffer's total weight, and so its mean, is the
same whatever order its updates arrived in. `fixed_weight` is the same weight as an integer count of
quanta, for the secure-aggregation adverts that carry integer weights (at most `MAX_FIXED_WEIGHT`).
"""

from __future__ import annotations

import math

from plexus.config import StalenessSpec

QUANTUM_BITS = 16
QUANTUM = 2.0 ** -QUANTUM_BITS
# The largest advert weight of an asynchronous secure cohort: fixed_weight(s, τ, n) with s(τ) ≤ 1 and n at most
# 2^31 (every update's num_samples bound), so 2^47. A float64 holds it exactly, and a cohort's total (at most
# asynchronous.buffer ≤ 10_000 < 2^14 adverts) stays below 2^61, inside the uint64 total_weight on the wire
# and the 8-byte integers an advert's signature covers.
MAX_FIXED_WEIGHT = 2 ** (QUANTUM_BITS + 31)


def raw(spec: StalenessSpec, tau: int) -> float:
    """s(τ) before rounding, in (0, 1]."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0; got {tau}")
    if spec.fn == "constant":
        return 1.0
    if spec.fn == "polynomial":
        return (1.0 + tau) ** -spec.a
    return 1.0 if tau <= spec.b else 1.0 / (spec.a * (tau - spec.b) + 1.0)


def quanta(spec: StalenessSpec, tau: int) -> int:
    """s(τ) in units of 2^−16, at least 1 (a fresh enough update never weighs nothing)."""
    return max(1, math.floor(raw(spec, tau) * 2 ** QUANTUM_BITS))


def factor(spec: StalenessSpec, tau: int) -> float:
    """s(τ), rounded down to a multiple of 2^−16."""
    return quanta(spec, tau) * QUANTUM


def weight(spec: StalenessSpec, tau: int, n: int) -> float:
    """What an update of n samples and staleness τ weighs in its buffer: s(τ)·n, exactly."""
    return factor(spec, tau) * n


def fixed_weight(spec: StalenessSpec, tau: int, n: int) -> int:
    """s(τ)·n in units of 2^−16, as an integer (weight(...) == fixed_weight(...) * QUANTUM)."""
    return quanta(spec, tau) * n
