"""A site's train/test split and the seeded ways to make one: stratified, and Dirichlet across sites."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Split:
    """A train/test split of one site's data, ready for torch."""

    x_train: np.ndarray  # float32 (n, ...) C-contiguous
    y_train: np.ndarray  # int64 (n,) class indices; float64 (n,) for a numeric target
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int     # 0 for a numeric target
    feature_names: tuple[str, ...]


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) index arrays with each label's share kept; same seed, same split.

    The test set has ceil(test_fraction * n) rows (scikit-learn's convention,
    which reproduces FLamby's split sizes); rows are shared out between labels
    by largest remainder.
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {y.shape}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n = len(y)
    n_test = test_rows(n, test_fraction)
    if not 1 <= n_test <= n - 1:
        raise ValueError(
            f"cannot split {n} samples with test_fraction={test_fraction}: "
            "train and test would not both be non-empty"
        )
    classes, counts = np.unique(y, return_counts=True)
    quotas = counts * n_test / n
    per_class = np.floor(quotas).astype(np.int64)
    short = n_test - int(per_class.sum())
    per_class[np.argsort(-(quotas - per_class), kind="stable")[:short]] += 1

    rng = np.random.default_rng(seed)
    train, test = [], []
    for label, k in zip(classes, per_class):
        members = rng.permutation(np.flatnonzero(y == label))
        test.append(members[:k])
        train.append(members[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def random_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) index arrays for rows with numeric targets (nothing to stratify by): a seeded
    permutation's first ceil(test_fraction * n) rows are the test rows, as many as stratified_split takes."""
    n = len(y)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n_test = test_rows(n, test_fraction)
    if not 1 <= n_test <= n - 1:
        raise ValueError(
            f"cannot split {n} samples with test_fraction={test_fraction}: "
            "train and test would not both be non-empty"
        )
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def test_rows(n: int, test_fraction: float) -> int:
    # round() first: 0.34 * 50 is 17.000000000000004 in floating point.
    return math.ceil(round(test_fraction * n, 9))


def dirichlet_partition(labels: np.ndarray, sites: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Split row indices across ``sites`` with a Dirichlet(alpha) label skew; sorted int64 index arrays.

    For each class (in sorted order), proportions p ~ Dir(alpha * 1_sites) are
    drawn from ``np.random.default_rng(seed)`` and the class's shuffled rows are
    cut at round(cumsum(p) * n_class). (Rounding, not the usual floor: floor
    hands every class's remainder to the last site, which matters for small
    classes.) The result is disjoint and covers every row. If a site ends up
    empty the whole draw is repeated with the same generator, so the result
    still depends on the arguments alone.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if isinstance(sites, bool) or not isinstance(sites, (int, np.integer)) or sites < 1:
        raise ValueError(f"sites must be a positive integer, got {sites!r}")
    if not (isinstance(alpha, (int, float, np.floating)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if len(labels) < sites:
        raise ValueError(f"cannot give each of {sites} sites a row: there are only {len(labels)} rows")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(1000):
        shares: list[list[np.ndarray]] = [[] for _ in range(sites)]
        for label in classes:
            members = rng.permutation(np.flatnonzero(labels == label))
            cuts = np.rint(np.cumsum(rng.dirichlet(np.full(sites, float(alpha))))[:-1] * len(members))
            cuts = cuts.astype(np.int64)
            for share, chunk in zip(shares, np.split(members, cuts)):
                share.append(chunk)
        parts = [np.sort(np.concatenate(share)).astype(np.int64) for share in shares]
        if min(len(part) for part in parts) > 0:
            return parts
    raise ValueError(
        f"1000 Dirichlet draws with alpha={alpha} each left a site without rows; "
        f"raise alpha, use fewer sites than {sites} or more rows than {len(labels)}"
    )
