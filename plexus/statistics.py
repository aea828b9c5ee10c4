"""Federated statistics as sums: a site's raw table becomes a vector of sums, sites' vectors add, figures follow.

A statistics job's "model" is the vector `layout(spec)` names, built from the spec alone. A site reads its
dataset (`read_table`), checks it against the spec (`schema_problems`) and computes its sums (`site_sums`);
the coordinator adds the sites' vectors (`combine_clear`, or a secure sum), optionally adds noise
(`add_dp_noise`) and derives the figures (`figures`), which `to_table`, `to_csv` and `to_json` print.

Decisions this module makes, in one place:

- Rows: a site describes its whole local dataset, every row (training and test alike, none dropped for
  missing cells). heart-disease: the hospital's rows of the vendored UCI CSV, raw columns (age, sex, cp, ...,
  num); chol 0 is a value there, not a missing cell.
- Missing: an empty cell (after stripping spaces) is missing, in every column. Any other text in a numeric
  column ("NA", "?", "nan") is a schema problem, as it is for a CSV schema's features.
- Categories are compared as text: a declared `0` matches the cell "0", not "0.0".
- Groups: "all" (every row) and one per `group_by` category; a row whose group cell is empty counts in
  "all" only. The group column may also be one of the described columns.
- Scaling: the sums of a numeric column with a range [lo, hi] are of u = (x − c)/w, c its midpoint and w its
  half-width (u = x without a range), so a value inside the range has |u| <= 1 and every sum a site sends is
  at most its row count: under secure aggregation, which needs a range on every numeric column, a clip of the
  largest site's rows covers them whatever the columns' units, and fixed point resolves u, not x. Centring
  also keeps variance and covariance from losing digits to cancellation. `figures` scales back.
- Values outside the range are summed as they are (|u| > 1), except under DP (spec.dp set), where u is
  clamped to [-1, 1] before it enters a sum, so one row moves each sum by at most 1 (histograms still count
  the values outside the range in their below/above cells).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from plexus.config import DatasetSpec, StatColumnSpec, StatisticsSpec
from plexus.datasets import cell_number, read_table as read_csv
from plexus.datasets.heart import hospital_table
from plexus.text import csv_cell, printable

__all__ = ["MAX_PREFIX", "MIN_PREFIX", "SUM_PREFIX", "DPLedger", "DPQuery", "Figure", "SmallCells", "add_dp_noise",
           "combine_clear", "dp_ledger", "figures", "group_labels", "layout", "read_table", "schema_problems",
           "site_sums", "to_csv", "to_json", "to_table"]

# Tensor name prefixes: the rule adds the `stats/` tensors, takes the minimum of the `min/` ones and the maximum
# of the `max/` ones. Columns are named by their index in spec.columns, so any column name makes a valid name.
SUM_PREFIX, MIN_PREFIX, MAX_PREFIX = "stats/", "min/", "max/"
# What an empty cell's min/max holds: finite (the wire refuses infinities) and beaten by any real value.
_EMPTY_MIN, _EMPTY_MAX = np.finfo(np.float64).max, -np.finfo(np.float64).max
_COV_PARTS = ("count", "sum_i", "sum_j", "sumsq_i", "sumsq_j", "sum_ij")   # the last axis of stats/cov/ tensors
_SHOWN = 5   # bad rows or values one schema problem lists


class Figure(NamedTuple):
    """One figure: a statistic of a column (or pair "a × b") over a group's rows; None where undefined."""

    group: str
    column: str
    statistic: str
    value: float | None


class SmallCells(ValueError):
    """The site's sums hold cells with fewer rows than its policy's min_cell_count (and more than none)."""

    def __init__(self, cells: list[str], min_cell_count: int):
        self.cells, self.min_cell_count = cells, min_cell_count
        shown = "; ".join(cells[:20]) + (f"; and {len(cells) - 20} more" if len(cells) > 20 else "")
        super().__init__(f"{len(cells)} cell(s) would hold 1 to {min_cell_count - 1} rows, fewer than this site's "
                         f"min_cell_count {min_cell_count} (empty cells are fine): {shown}")


# Reading a site's table ------------------------------------------------------------------------------------


def read_table(dataset: DatasetSpec) -> dict[str, np.ndarray]:
    """Every raw column of a site's dataset, all rows, as text arrays (spaces stripped; '' is a missing cell)."""
    if dataset.kind == "csv":
        if dataset.path is None:
            raise ValueError("a csv dataset needs `path` for statistics")
        table = read_csv(dataset.path, encoding=dataset.encoding, delimiter=dataset.delimiter)
    elif dataset.kind == "heart-disease":
        if dataset.hospital is None:
            raise ValueError("a heart-disease dataset needs `hospital` for statistics")
        table = hospital_table(dataset.hospital, path=dataset.path)
    else:
        raise ValueError(f"statistics read raw table columns, from datasets of kind 'csv' or 'heart-disease'; "
                         f"this dataset is of kind {dataset.kind!r}")
    return {name: np.array([row[i].strip() for row in table.rows], dtype=str) for i, name in enumerate(table.header)}


def schema_problems(spec: StatisticsSpec, table: dict[str, np.ndarray]) -> list[str]:
    """Every way the table differs from what the spec declares; empty when the site can compute its sums."""
    wanted = [c.name for c in spec.columns] + ([spec.group_by.column] if spec.group_by else [])
    missing = [name for name in dict.fromkeys(wanted) if name not in table]
    problems = [f"missing column(s) {', '.join(map(repr, missing))}"] if missing else []
    for column in spec.columns:
        if column.name in missing:
            continue
        if column.categories is None:
            _, bad = _numbers(table[column.name])
            rows = np.flatnonzero(bad) + 1
            if len(rows):
                problems.append(f"column {column.name!r}: {len(rows)} cell(s) are not numbers (data rows "
                                f"{_first(rows.tolist())}); a numeric column holds numbers and empty cells, or "
                                "declare `categories` to count its values as text")
        else:
            problems.extend(_undeclared(table[column.name], column.name, column.categories, "categories"))
    if spec.group_by is not None and spec.group_by.column not in missing:
        problems.extend(_undeclared(table[spec.group_by.column], spec.group_by.column, spec.group_by.categories,
                                    "group_by.categories"))
    return problems


def _undeclared(values: np.ndarray, name: str, declared: tuple[str, ...], key: str) -> list[str]:
    text = _texts(values)
    bad = (text != "") & ~np.isin(text, np.array(declared, dtype=str))
    if not bad.any():
        return []
    others = list(dict.fromkeys(text[bad].tolist()))
    shown = ", ".join(repr(v[:40]) for v in others[:_SHOWN]) + (f" and {len(others) - _SHOWN} more"
                                                               if len(others) > _SHOWN else "")
    return [f"column {name!r}: {int(bad.sum())} cell(s) hold values not among its declared {key}: {shown}; "
            f"add them to {key}"]


def _first(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:_SHOWN])) + (", ..." if len(numbers) > _SHOWN else "")


def _texts(values: np.ndarray) -> np.ndarray:
    return np.char.strip(np.asarray(values).astype(str))


def _numbers(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float64 values with NaN where missing, mask of cells that are neither numbers nor missing)."""
    values = np.asarray(values)
    if values.dtype.kind in "iuf":
        x = values.astype(np.float64)
        return np.where(np.isinf(x), np.nan, x), np.isinf(x)
    unique, inverse = np.unique(_texts(values), return_inverse=True)
    parsed = [math.nan if u == "" else cell_number(u) for u in unique.tolist()]
    bad = np.array([p is None for p in parsed], dtype=bool)[inverse.reshape(-1)]
    x = np.array([math.nan if p is None else p for p in parsed], dtype=np.float64)[inverse.reshape(-1)]
    return x, bad


# The vector of sums ----------------------------------------------------------------------------------------


def group_labels(spec: StatisticsSpec) -> list[str]:
    """The groups every statistic is computed over: "all", then "column=category" per group_by category."""
    if spec.group_by is None:
        return ["all"]
    return ["all"] + [f"{spec.group_by.column}={c}" for c in spec.group_by.categories]


def _numeric(spec: StatisticsSpec) -> list[int]:
    return [j for j, c in enumerate(spec.columns) if c.categories is None]


def _pairs(spec: StatisticsSpec) -> list[tuple[int, int]]:
    numeric = _numeric(spec) if spec.covariance else []
    return [(i, j) for a, i in enumerate(numeric) for j in numeric[a + 1:]]


def _scale(column: StatColumnSpec) -> tuple[float, float]:
    """(c, w): a numeric column's sums are of u = (x − c)/w; the range's midpoint and half-width, or (0, 1)."""
    if column.range is None:
        return 0.0, 1.0
    lo, hi = column.range
    return (lo + hi) / 2, (hi - lo) / 2


def _edges(column: StatColumnSpec) -> np.ndarray:
    return np.linspace(column.range[0], column.range[1], column.bins + 1)


def layout(spec: StatisticsSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """The sums vector's tensors (name, "F64", shape), in a fixed order; the first axis is the group.

    stats/rows [G]: rows per group. Column j numeric, u = (x − c)/w (`_scale`): stats/c{j}/count, /missing,
    /sum (Σu), /sumsq (Σu²) [G], with bins also /hist [G, bins + 2] (below range, the bins, above range);
    min/c{j} and max/c{j} [G] (of x) when min_max. Column j categorical: stats/c{j}/categories [G, k] and
    /missing [G]. Covariance, each pair i < j of numeric columns: stats/cov/c{i}-c{j} [G, 6], over the rows
    where both are present, the count, Σu_i, Σu_j, Σu_i², Σu_j², Σu_i·u_j.
    """
    g = len(group_labels(spec))
    out = [(f"{SUM_PREFIX}rows", "F64", (g,))]
    for j, column in enumerate(spec.columns):
        at = f"{SUM_PREFIX}c{j}/"
        if column.categories is not None:
            out += [(at + "categories", "F64", (g, len(column.categories))), (at + "missing", "F64", (g,))]
            continue
        out += [(at + stat, "F64", (g,)) for stat in ("count", "missing", "sum", "sumsq")]
        if column.bins is not None:
            out.append((at + "hist", "F64", (g, column.bins + 2)))
        if spec.min_max:
            out += [(f"{MIN_PREFIX}c{j}", "F64", (g,)), (f"{MAX_PREFIX}c{j}", "F64", (g,))]
    out += [(f"{SUM_PREFIX}cov/c{i}-c{j}", "F64", (g, len(_COV_PARTS))) for i, j in _pairs(spec)]
    return out


def site_sums(spec: StatisticsSpec, table: dict[str, np.ndarray], *,
              min_cell_count: int | None = None) -> dict[str, np.ndarray]:
    """This site's vector of sums over its table; SmallCells when a cell would hold 1..min_cell_count − 1 rows."""
    problems = schema_problems(spec, table)
    if problems:
        raise ValueError("the table does not match the statistics spec: " + "; ".join(problems))
    members = _members(spec, table)
    sums = {name: np.zeros(shape) for name, _, shape in layout(spec)}
    sums[f"{SUM_PREFIX}rows"][:] = members.sum(axis=1)
    scaled = {}
    for j, column in enumerate(spec.columns):
        if column.categories is None:
            scaled[j] = _numeric_sums(spec, j, table[column.name], members, sums)
        else:
            text = _texts(table[column.name])
            for k, category in enumerate(column.categories):
                sums[f"{SUM_PREFIX}c{j}/categories"][:, k] = (members & (text == category)).sum(axis=1)
            sums[f"{SUM_PREFIX}c{j}/missing"][:] = (members & (text == "")).sum(axis=1)
    for i, j in _pairs(spec):
        both = ~np.isnan(scaled[i]) & ~np.isnan(scaled[j])
        for g, rows in enumerate(members):
            a, b = scaled[i][rows & both], scaled[j][rows & both]
            sums[f"{SUM_PREFIX}cov/c{i}-c{j}"][g] = [a.size, a.sum(), b.sum(), (a * a).sum(), (b * b).sum(),
                                                     (a * b).sum()]
    if min_cell_count is not None:
        small = _small_cells(spec, sums, min_cell_count)
        if small:
            raise SmallCells(small, min_cell_count)
    return sums


def _numeric_sums(spec: StatisticsSpec, j: int, values: np.ndarray, members: np.ndarray,
                  sums: dict[str, np.ndarray]) -> np.ndarray:
    """Fill column j's count, missing, sums, histogram and min/max; returns its values u (NaN: missing)."""
    column, at = spec.columns[j], f"{SUM_PREFIX}c{j}/"
    x, _ = _numbers(values)
    present = ~np.isnan(x)
    u = _scaled(spec, column, x)
    cells = _hist_cells(column, x) if column.bins is not None else None
    for g, rows in enumerate(members):
        mine = rows & present
        sums[at + "count"][g], sums[at + "missing"][g] = mine.sum(), (rows & ~present).sum()
        sums[at + "sum"][g] = u[mine].sum()
        sums[at + "sumsq"][g] = (u[mine] * u[mine]).sum()
        if cells is not None:
            sums[at + "hist"][g] = np.bincount(cells[mine], minlength=column.bins + 2)
        if spec.min_max:
            sums[f"{MIN_PREFIX}c{j}"][g] = x[mine].min() if mine.any() else _EMPTY_MIN
            sums[f"{MAX_PREFIX}c{j}"][g] = x[mine].max() if mine.any() else _EMPTY_MAX
    return u


def _members(spec: StatisticsSpec, table: dict[str, np.ndarray]) -> np.ndarray:
    """[G, rows] booleans: which rows each group holds."""
    n = len(next(iter(table.values())))
    if spec.group_by is None:
        return np.ones((1, n), dtype=bool)
    text = _texts(table[spec.group_by.column])
    return np.stack([np.ones(n, dtype=bool)] + [text == c for c in spec.group_by.categories])


def _scaled(spec: StatisticsSpec, column: StatColumnSpec, x: np.ndarray) -> np.ndarray:
    c, w = _scale(column)
    u = (x - c) / w
    # Under DP a row moves Σu, Σu² and Σu_i·u_j by at most 1 (the sensitivities dp_ledger states). Clamping u,
    # not x, keeps that exact where (hi − c)/w rounds a little above 1.
    return np.clip(u, -1.0, 1.0) if spec.dp is not None else u


def _hist_cells(column: StatColumnSpec, x: np.ndarray) -> np.ndarray:
    """Each value's cell of stats/c{j}/hist: 0 below the range, 1..bins the bins as np.histogram fills them
    (half-open [a, b), the last one closed), bins + 1 above; missing values land anywhere (callers mask them)."""
    edges, x = _edges(column), np.nan_to_num(x)
    index = np.searchsorted(edges, x, side="right")   # 0 below, bins + 1 above or at hi
    index[x == edges[-1]] = column.bins
    return index


def _small_cells(spec: StatisticsSpec, sums: dict[str, np.ndarray], k: int) -> list[str]:
    """Every cell with 1..k − 1 rows, named "group / column / cell"; a small group is named once, whole."""
    def small(count: float) -> bool:
        return 0 < count < k

    labels, cells = group_labels(spec), []
    if spec.group_by is not None:
        # "all" less the listed groups: the rows whose group_by value is missing (or not listed). Its cells are
        # differences of the sums released, as readable as any group's, so they face the same rule.
        sums = {name: np.concatenate([v, v[:1] - v[1:].sum(axis=0, keepdims=True)]) if name.startswith(SUM_PREFIX)
                else v for name, v in sums.items()}
        labels = [*labels, f"{spec.group_by.column}=(missing or unlisted)"]
    if spec.min_max and _numeric(spec):
        cells.append("min and max of the numeric columns (each is one row's value; set min_max: false)")
    for g, label in enumerate(labels):
        if small(sums[f"{SUM_PREFIX}rows"][g]):
            cells.append(f"group {label} (and every cell in it)")
            continue
        for j, column in enumerate(spec.columns):
            at, name = f"{SUM_PREFIX}c{j}/", f"{label} / {column.name}"
            if column.categories is not None:
                cells += [f"{name} / {c}" for c, n in zip(column.categories, sums[at + "categories"][g]) if small(n)]
            else:
                cells += [f"{name} / count"] if small(sums[at + "count"][g]) else []
                if column.bins is not None:
                    cells += [f"{name} / histogram {bin_}" for bin_, n in zip(_bin_labels(column), sums[at + "hist"][g])
                              if small(n)]
            cells += [f"{name} / missing"] if small(sums[at + "missing"][g]) else []
        for i, j in _pairs(spec):
            if small(sums[f"{SUM_PREFIX}cov/c{i}-c{j}"][g, 0]):
                cells.append(f"{label} / {spec.columns[i].name} × {spec.columns[j].name} / rows with both")
    return cells


# Pooling ---------------------------------------------------------------------------------------------------


def combine_clear(spec: StatisticsSpec, per_site: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The pooled vector of sites' vectors seen in the clear: sums added (in the order given), min of the
    minima, max of the maxima."""
    if not per_site:
        raise ValueError("combine_clear needs at least one site's sums")
    expected = layout(spec)
    for k, sums in enumerate(per_site):
        _check_vector(expected, sums, f"site {k}'s sums")
    pooled = {}
    for name, _, _ in expected:
        values = [np.asarray(sums[name], dtype=np.float64) for sums in per_site]
        if name.startswith(MIN_PREFIX):
            pooled[name] = np.minimum.reduce(values)
        elif name.startswith(MAX_PREFIX):
            pooled[name] = np.maximum.reduce(values)
        else:
            pooled[name] = sum(values[1:], values[0].copy())
    return pooled


def _check_vector(expected: list, sums: dict[str, np.ndarray], what: str) -> None:
    names = {name for name, _, _ in expected}
    if set(sums) != names:
        missing, extra = sorted(names - set(sums)), sorted(set(sums) - names)
        raise ValueError(f"{what} do not match the spec's layout: missing {missing}, unexpected {extra}")
    for name, _, shape in expected:
        if np.shape(sums[name]) != shape:
            raise ValueError(f"{what}: tensor {name!r} has shape {list(np.shape(sums[name]))}; the spec's layout "
                             f"has {list(shape)}")


# Figures ---------------------------------------------------------------------------------------------------


def figures(spec: StatisticsSpec, pooled: dict[str, np.ndarray]) -> list[Figure]:
    """The figures of the pooled sums, column by column, each over every group.

    Statistics: rows (per group); numeric columns count, missing, sum, mean, var, std, min, max, "quantile q",
    "histogram [a, b)" (with "< lo" and "> hi" cells); categorical columns count, missing, "category c"; pairs
    "a × b" count (rows with both), cov, corr. Variance and covariance use ddof 1 and pairwise-complete rows,
    as pandas does. A quantile q is estimated from the histogram: pandas' q-quantile interpolates linearly
    between the order statistics at ranks floor(h) and ceil(h), h = q·(n − 1); each of the two is estimated by
    spreading its bin's values evenly over the bin, so when both lie within the range the estimate is within
    one bin width of the exact quantile. It is None when either lies outside the range or there are no values.
    """
    _check_vector(layout(spec), pooled, "the pooled sums")
    labels = group_labels(spec)
    out = [Figure(label, "", "rows", float(n)) for label, n in zip(labels, pooled[f"{SUM_PREFIX}rows"])]
    for j, column in enumerate(spec.columns):
        for g, label in enumerate(labels):
            stats = (_categorical_figures if column.categories is not None else _numeric_figures)(spec, j, g, pooled)
            out += [Figure(label, column.name, statistic, None if value is None else float(value))
                    for statistic, value in stats]
    for i, j in _pairs(spec):
        name = f"{spec.columns[i].name} × {spec.columns[j].name}"
        scale = _scale(spec.columns[i])[1] * _scale(spec.columns[j])[1]   # w_i·w_j: the sums are of u_i, u_j
        for g, label in enumerate(labels):
            n, si, sj, sii, sjj, sij = pooled[f"{SUM_PREFIX}cov/c{i}-c{j}"][g]
            cov = scale * (sij - si * sj / n) / (n - 1) if n > 1 else None
            spread = (sii - si * si / n) * (sjj - sj * sj / n) if n > 1 else 0.0
            corr = (sij - si * sj / n) / math.sqrt(spread) if spread > 0 else None
            out += [Figure(label, name, "count", float(n)), Figure(label, name, "cov", cov),
                    Figure(label, name, "corr", corr)]
    return out


def _categorical_figures(spec: StatisticsSpec, j: int, g: int, pooled: dict) -> list[tuple[str, float | None]]:
    column, counts = spec.columns[j], pooled[f"{SUM_PREFIX}c{j}/categories"][g]
    return [("count", counts.sum()), ("missing", pooled[f"{SUM_PREFIX}c{j}/missing"][g]),
            *((f"category {c}", n) for c, n in zip(column.categories, counts))]


def _numeric_figures(spec: StatisticsSpec, j: int, g: int, pooled: dict) -> list[tuple[str, float | None]]:
    column, at = spec.columns[j], f"{SUM_PREFIX}c{j}/"
    n, s, ss = (pooled[at + stat][g] for stat in ("count", "sum", "sumsq"))
    c, w = _scale(column)   # the sums are of u = (x − c)/w
    var = w * w * max(ss - s * s / n, 0.0) / (n - 1) if n > 1 else None
    out = [("count", n), ("missing", pooled[at + "missing"][g]), ("sum", n * c + w * s),
           ("mean", c + w * s / n if n > 0 else None), ("var", var),
           ("std", None if var is None else math.sqrt(var))]
    if spec.min_max:
        out += [("min", pooled[f"{MIN_PREFIX}c{j}"][g] if n > 0 else None),
                ("max", pooled[f"{MAX_PREFIX}c{j}"][g] if n > 0 else None)]
    if column.bins is not None:
        hist = pooled[at + "hist"][g]
        out += [(f"quantile {q:g}", _quantile(column, hist, q)) for q in spec.quantiles]
        out += [(f"histogram {bin_}", count) for bin_, count in zip(_bin_labels(column), hist)]
    return out


def _bin_labels(column: StatColumnSpec) -> list[str]:
    edges = _edges(column)
    bins = [f"[{a:g}, {b:g})" for a, b in zip(edges[:-1], edges[1:])]
    bins[-1] = bins[-1][:-1] + "]"
    return [f"< {edges[0]:g}", *bins, f"> {edges[-1]:g}"]


def _quantile(column: StatColumnSpec, hist: np.ndarray, q: float) -> float | None:
    counts = np.maximum(hist, 0.0)   # noisy (DP) counts can be negative
    n = counts.sum()
    if n <= 0:
        return None
    edges, before = _edges(column), np.concatenate([[0.0], np.cumsum(counts)])
    h = q * (n - 1)

    def order_statistic(rank: float) -> float | None:
        cell = int(np.searchsorted(before, rank, side="right")) - 1   # before[cell] <= rank < before[cell + 1]
        cell = min(cell, len(counts) - 1)
        if cell == 0 or cell == len(counts) - 1:   # below or above the range
            return None
        share = min(max((rank - before[cell] + 0.5) / counts[cell], 0.0), 1.0)
        return edges[cell - 1] + share * (edges[cell] - edges[cell - 1])

    low, high = order_statistic(math.floor(h)), order_statistic(math.ceil(h))
    if low is None or high is None:
        return None
    return low + (h - math.floor(h)) * (high - low)


# Differential privacy --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DPQuery:
    """One noised query: a statistic family of a column over every group, with its sensitivity and noise."""

    query: str           # e.g. "sum of 'age'"
    tensor: str          # the layout tensor (and for covariance the part) the noise is added to
    sensitivity: float   # L1 (laplace) or L2 (gaussian) norm of one row's change to the tensor
    scale: float         # laplace: b = sensitivity / epsilon; gaussian: sigma
    epsilon: float
    delta: float


@dataclass(frozen=True, slots=True)
class DPLedger:
    """Every query's epsilon and delta, and their totals by basic composition (sums)."""

    mechanism: str
    queries: tuple[DPQuery, ...]
    epsilon: float
    delta: float

    def to_dict(self) -> dict:
        """The ledger as plain data (for events, metrics and JSON)."""
        return asdict(self)


def dp_ledger(spec: StatisticsSpec) -> DPLedger:
    """The queries `add_dp_noise` answers for this spec, each with its sensitivity and noise scale.

    Neighbouring datasets differ by one row added or removed. One row changes one cell of each tensor in
    "all" and at most one in a group, so with group_by every per-cell sensitivity counts twice (L1) or √2
    times (L2). Per cell, every one 1: counts, missing, histogram and category cells; and the sums of
    u = (x − c)/w, clamped to [−1, 1] under DP: Σu, Σu², Σu_i·u_j (each row adds a value in [−1, 1], or
    [0, 1] for Σu²). Sensitivity and scale are in the tensor's units; in x's, Σu's noise is w times theirs,
    Σu²'s w² and Σu_i·u_j's w_i·w_j. Laplace noise has scale b = Δ1/ε; Gaussian noise
    σ = Δ2·sqrt(2 ln(1.25/δ))/ε (Dwork & Roth, Theorem A.1; ε < 1).
    """
    dp = spec.dp
    if dp is None:
        raise ValueError("the statistics spec has no dp block; there is nothing to account")
    if spec.min_max:
        raise ValueError("min and max cannot be released under dp (each is one row's value); set min_max: false")
    grouped = 2.0 if spec.group_by is not None else 1.0
    factor = grouped if dp.mechanism == "laplace" else math.sqrt(grouped)
    delta = dp.delta if dp.mechanism == "gaussian" else 0.0

    def query(label: str, tensor: str, per_cell: float) -> DPQuery:
        sensitivity = factor * per_cell
        scale = (sensitivity / dp.epsilon if dp.mechanism == "laplace"
                 else sensitivity * math.sqrt(2 * math.log(1.25 / dp.delta)) / dp.epsilon)
        return DPQuery(label, tensor, sensitivity, scale, dp.epsilon, delta)

    queries = [query("rows", f"{SUM_PREFIX}rows", 1.0)]
    for j, column in enumerate(spec.columns):
        at, name = f"{SUM_PREFIX}c{j}/", repr(column.name)
        if column.categories is not None:
            queries += [query(f"category counts of {name}", at + "categories", 1.0),
                        query(f"missing of {name}", at + "missing", 1.0)]
            continue
        queries += [query(f"count of {name}", at + "count", 1.0), query(f"missing of {name}", at + "missing", 1.0),
                    query(f"sum of {name}", at + "sum", 1.0), query(f"sum of squares of {name}", at + "sumsq", 1.0)]
        if column.bins is not None:
            queries.append(query(f"histogram of {name}", at + "hist", 1.0))
    for i, j in _pairs(spec):
        pair, tensor = f"{spec.columns[i].name!r} × {spec.columns[j].name!r}", f"{SUM_PREFIX}cov/c{i}-c{j}"
        queries += [query(f"{part} of {pair}", f"{tensor}:{part}", 1.0) for part in _COV_PARTS]
    return DPLedger(dp.mechanism, tuple(queries), math.fsum(q.epsilon for q in queries),
                    math.fsum(q.delta for q in queries))


def add_dp_noise(spec: StatisticsSpec, pooled: dict[str, np.ndarray],
                 rng: np.random.Generator) -> tuple[dict[str, np.ndarray], DPLedger]:
    """The pooled sums with every query's noise added (drawn from `rng`), and the ledger of what was spent."""
    ledger = dp_ledger(spec)
    _check_vector(layout(spec), pooled, "the pooled sums")
    noisy = {name: np.array(values, dtype=np.float64) for name, values in pooled.items()}
    for q in ledger.queries:
        tensor, _, part = q.tensor.partition(":")
        target = noisy[tensor][..., _COV_PARTS.index(part)] if part else noisy[tensor]
        draw = rng.laplace if ledger.mechanism == "laplace" else rng.normal
        target += draw(0.0, q.scale, size=target.shape)
    return noisy, ledger


# Output ----------------------------------------------------------------------------------------------------


def _show(value: float | None) -> str:
    if value is None:
        return "-"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.8g}"


def to_table(rows: list[Figure]) -> str:
    """The figures as aligned text: one line per (column, statistic), one value column per group."""
    groups = list(dict.fromkeys(f.group for f in rows))
    lines: dict[tuple[str, str], dict[str, str]] = {}
    for f in rows:
        lines.setdefault((f.column, f.statistic), {})[f.group] = _show(f.value)
    table = [["column", "statistic", *groups]] + [
        [column, statistic, *(values.get(g, "") for g in groups)] for (column, statistic), values in lines.items()]
    table = [[printable(cell) for cell in row] for row in table]
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) if k < 2 else cell.rjust(w) for k, (cell, w) in
                               enumerate(zip(row, widths))).rstrip() for row in table) + "\n"


def to_csv(rows: list[Figure]) -> str:
    """The figures as CSV (group, column, statistic, value), one per line; an undefined value is empty."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["group", "column", "statistic", "value"])
    for f in rows:
        writer.writerow([csv_cell(f.group), csv_cell(f.column), csv_cell(f.statistic),
                         "" if f.value is None else repr(f.value)])
    return out.getvalue()


def to_json(rows: list[Figure], ledger: DPLedger | None = None) -> str:
    """The figures as JSON, with the DP ledger (null without DP); an undefined value is null."""
    return json.dumps({"figures": [f._asdict() for f in rows], "dp": None if ledger is None else ledger.to_dict()},
                      indent=1, allow_nan=False) + "\n"
