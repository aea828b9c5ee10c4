"""Shamir secret sharing over GF(PRIME), and the majority threshold secure aggregation needs."""

from __future__ import annotations

import secrets

from plexus import errors
from plexus.secagg.checks import check_int, not_int

PRIME = 2**521 - 1  # a Mersenne prime above every 32-byte secret
SHARE_BYTES = (PRIME.bit_length() + 7) // 8


def shamir_split(secret: int, n: int, t: int) -> list[tuple[int, int]]:
    """Split `secret` into shares (x, y) at x = 1..n; any t of them rebuild it, t - 1 reveal nothing."""
    check_int(n, "n")
    check_int(t, "t")
    check_int(secret, "secret")
    if not 1 <= t <= n:
        raise ValueError(f"threshold t={t} must satisfy 1 <= t <= n={n}")
    if not 0 <= secret < PRIME:
        raise ValueError("secret must lie in [0, PRIME)")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    shares = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def shamir_combine(shares: list[tuple[int, int]], t: int) -> int:
    """The secret behind `shares` (Lagrange at 0); IntegrityError if fewer than t distinct x.

    Shares beyond the first t are checked against the polynomial the first t define,
    so altered shares raise instead of silently changing the result.
    """
    check_int(t, "t")
    if t < 1:
        raise ValueError(f"threshold t must be >= 1, got {t}")
    points: dict[int, int] = {}
    for share in shares:
        if not isinstance(share, tuple) or len(share) != 2:
            raise TypeError(f"a share is an (x, y) tuple of ints, not {share!r}")
        x, y = share
        if not_int(x) or not_int(y) or not 0 < x < PRIME or not 0 <= y < PRIME:
            raise errors.IntegrityError("a share has x outside [1, PRIME) or y outside [0, PRIME)")
        if points.setdefault(x, y) != y:
            raise errors.IntegrityError(f"two different shares claim x = {x}")
    if len(points) < t:
        raise errors.IntegrityError(
            f"{len(points)} distinct shares cannot rebuild a secret shared {t}-of-n; {t} are needed"
        )
    xs = sorted(points)
    base = xs[:t]
    ys = [points[x] for x in base]
    weights = _barycentric_weights(base)
    for x in xs[t:]:
        if _interpolate(base, ys, weights, x) != points[x]:
            raise errors.IntegrityError(f"the share at x = {x} disagrees with the others: a share was altered")
    return _interpolate(base, ys, weights, 0)


def _barycentric_weights(xs: list[int]) -> list[int]:
    weights = []
    for xi in xs:
        denominator = 1
        for xj in xs:
            if xj != xi:
                denominator = denominator * (xi - xj) % PRIME
        weights.append(pow(denominator, -1, PRIME))
    return weights


def _interpolate(xs: list[int], ys: list[int], weights: list[int], at: int) -> int:
    k = len(xs)
    diffs = [(at - x) % PRIME for x in xs]
    suffix = [1] * (k + 1)
    for i in range(k - 1, -1, -1):
        suffix[i] = suffix[i + 1] * diffs[i] % PRIME
    total, prefix = 0, 1
    for i in range(k):
        total += ys[i] * weights[i] % PRIME * (prefix * suffix[i + 1] % PRIME)
        prefix = prefix * diffs[i] % PRIME
    return total % PRIME


def default_threshold(n: int) -> int:
    """The smallest majority of n participants, n // 2 + 1 (see the module docstring for why)."""
    check_int(n, "n")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return n // 2 + 1
