"""Tests for plexus.statistics: sites' sums pooled give pandas' figures on the pooled rows; schema, small cells, DP."""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from plexus import config, statistics, typed_yaml, wire
from plexus.config import DatasetSpec, StatisticsSpec, statistics_args, statistics_spec_from_args
from plexus.datasets import HEART_DISEASE_CSV, HOSPITALS
from plexus.errors import ConfigError
from plexus.statistics import Figure, SmallCells

HEART = {
    "columns": [
        {"name": "age", "range": [0, 100], "bins": 10},
        {"name": "trestbps", "range": [0, 250], "bins": 25},
        {"name": "chol"},
        {"name": "thalch", "range": [50, 220], "bins": 17},
        {"name": "oldpeak", "range": [-3, 7], "bins": 20},
        {"name": "sex", "categories": ["Male", "Female"]},
        {"name": "cp", "categories": ["typical angina", "atypical angina", "non-anginal", "asymptomatic"]},
        {"name": "fbs", "categories": ["TRUE", "FALSE"]},
    ],
    "group_by": {"column": "num", "categories": [0, 1, 2, 3, 4]},
    "quantiles": [0, 0.1, 0.25, 0.5, 0.75, 0.9, 1],
    "covariance": True,
}
NUMERIC = ["age", "trestbps", "chol", "thalch", "oldpeak"]
CATEGORICAL = ["sex", "cp", "fbs"]


def pooled_heart(spec: StatisticsSpec) -> dict[str, np.ndarray]:
    sites = [statistics.read_table(DatasetSpec(kind="heart-disease", hospital=h)) for h in HOSPITALS]
    return statistics.combine_clear(spec, [statistics.site_sums(spec, t) for t in sites])


def by_key(rows: list[Figure]) -> dict[tuple[str, str, str], float | None]:
    out = {(f.group, f.column, f.statistic): f.value for f in rows}
    assert len(out) == len(rows), "every figure has its own (group, column, statistic)"
    return out


def close(value: float | None, expected: float) -> bool:
    if value is None:
        return bool(np.isnan(expected))
    return math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-9)


def assert_equals_pandas(spec: StatisticsSpec, rows: list[Figure], frame: pd.DataFrame) -> None:
    """Every figure equals pandas on the pooled rows (every group: all rows, then group_by's categories)."""
    got = by_key(rows)
    groups = [("all", frame)]
    if spec.group_by is not None:
        column = frame[spec.group_by.column].astype(str).str.strip()
        groups += [(f"{spec.group_by.column}={c}", frame[column == c]) for c in spec.group_by.categories]
    checked = 0
    for label, rows_ in groups:
        assert got[(label, "", "rows")] == len(rows_)
        for c in spec.columns:
            if c.categories is not None:
                text = rows_[c.name].fillna("").astype(str).str.strip()
                assert got[(label, c.name, "missing")] == (text == "").sum()
                assert got[(label, c.name, "count")] == (text != "").sum()
                for category in c.categories:
                    assert got[(label, c.name, f"category {category}")] == (text == category).sum()
                continue
            s = pd.to_numeric(rows_[c.name])
            expected = {"count": s.count(), "missing": s.isna().sum(), "sum": s.sum(), "mean": s.mean(),
                        "var": s.var(), "std": s.std(), "min": s.min(), "max": s.max()}
            for statistic, value in expected.items():
                assert close(got[(label, c.name, statistic)], value), (label, c.name, statistic)
                checked += 1
            if c.bins is not None:
                values = s.dropna().to_numpy()
                counts, edges = np.histogram(values, bins=c.bins, range=c.range)
                hist = [got[(label, c.name, f"histogram {b}")] for b in statistics._bin_labels(c)]
                assert hist == [(values < c.range[0]).sum(), *counts, (values > c.range[1]).sum()]
                checked += 1
        numeric = [c.name for c in spec.columns if c.categories is None]
        if spec.covariance:
            table = rows_[numeric].apply(pd.to_numeric)
            cov, corr, n = table.cov(), table.corr(), table.notna().astype(int).T @ table.notna().astype(int)
            for a, i in enumerate(numeric):
                for j in numeric[a + 1:]:
                    pair = f"{i} × {j}"
                    assert got[(label, pair, "count")] == n.loc[i, j]
                    assert close(got[(label, pair, "cov")], cov.loc[i, j]), (label, pair)
                    assert close(got[(label, pair, "corr")], corr.loc[i, j]), (label, pair)
                    checked += 1
    assert checked > 0


def heart_frame() -> pd.DataFrame:
    return pd.read_csv(HEART_DISEASE_CSV, dtype={c: str for c in CATEGORICAL}, keep_default_na=False,
                       na_values={c: [""] for c in NUMERIC})


# Equality with pandas -------------------------------------------------------------------------------------


def test_heart_disease_four_hospitals_pooled_equal_pandas_on_every_row_grouped_by_num():
    spec = statistics_spec_from_args(HEART)
    frame = heart_frame()
    assert len(frame) == 920   # the four hospitals are the whole file
    assert_equals_pandas(spec, statistics.figures(spec, pooled_heart(spec)), frame)


def test_each_hospital_reads_all_its_rows_raw_with_empty_cells_missing():
    tables = {h: statistics.read_table(DatasetSpec(kind="heart-disease", hospital=h)) for h in HOSPITALS}
    assert {h: len(t["age"]) for h, t in tables.items()} == {"cleveland": 303, "hungary": 294, "switzerland": 123,
                                                            "va": 200}
    assert set(tables["va"]) == set(heart_frame().columns)
    assert (tables["switzerland"]["chol"] == "0").all()   # a raw value of the file, not a missing cell
    assert (tables["va"]["ca"] == "").sum() > 0


SMALL_CSV = {
    "a.csv": """\
        x,y,z,g
        1.5,10,red,u
        ,12,blue,v
        3, 9 ,,u
        -2,,red,
        12,7,green,v
        """,
    "b.csv": """\
        x,y,z,g
        4,1e3,red,v
        0,,,v
        10,5,blue,v
        """,
    "c.csv": """\
        g,z,y,x,unused
        u,green,2,,a
        u,red,3,,b
        """,
}
SMALL = {"columns": [{"name": "x", "range": [0, 10], "bins": 4}, {"name": "y"},
                     {"name": "z", "categories": ["red", "green", "blue"]}],
         "group_by": {"column": "g", "categories": ["u", "v", "w"]}, "covariance": True, "quantiles": [0.5]}


def write_sites(tmp_path) -> list[DatasetSpec]:
    specs = []
    for name, text in SMALL_CSV.items():
        (tmp_path / name).write_text(textwrap.dedent(text), encoding="utf-8")
        specs.append(DatasetSpec(kind="csv", path=tmp_path / name, label="z"))
    return specs


def test_a_small_csv_with_missing_cells_empty_groups_and_values_outside_the_range_equals_pandas(tmp_path):
    spec = statistics_spec_from_args(SMALL)
    sites = [statistics.read_table(d) for d in write_sites(tmp_path)]
    pooled = statistics.combine_clear(spec, [statistics.site_sums(spec, t) for t in sites])
    frame = pd.concat([pd.read_csv(d.path, dtype={"z": str, "g": str}, skipinitialspace=True)
                       for d in write_sites(tmp_path)], ignore_index=True)
    rows = statistics.figures(spec, pooled)
    assert_equals_pandas(spec, rows, frame)
    got = by_key(rows)
    # Group w has no rows: its counts are 0 and what needs rows is undefined; an empty group cell is in "all" only.
    assert got[("g=w", "", "rows")] == 0 and got[("g=w", "x", "mean")] is None and got[("g=w", "x", "min")] is None
    assert got[("all", "", "rows")] == 10 and sum(got[(f"g={g}", "", "rows")] for g in "uvw") == 9
    assert got[("all", "x", "histogram < 0")] == 1 and got[("all", "x", "histogram > 10")] == 1
    assert got[("all", "x", "histogram [7.5, 10]")] == 1   # 10 sits in the last, closed, bin


# Quantiles ------------------------------------------------------------------------------------------------


def test_heart_quantiles_are_within_one_bin_width_of_pandas():
    spec = statistics_spec_from_args(HEART)
    got, frame = by_key(statistics.figures(spec, pooled_heart(spec))), heart_frame()
    for c in spec.columns:
        if c.bins is None:
            continue
        width = (c.range[1] - c.range[0]) / c.bins
        for label, rows in [("all", frame), *((f"num={k}", frame[frame.num == k]) for k in range(5))]:
            for q in spec.quantiles:
                exact = pd.to_numeric(rows[c.name]).quantile(q)
                assert abs(got[(label, c.name, f"quantile {q:g}")] - exact) <= width, (label, c.name, q)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=60),
       bins=st.integers(1, 12), q=st.floats(0, 1))
def test_a_quantile_estimate_is_within_one_bin_width_whenever_its_order_statistics_lie_in_the_range(values, bins, q):
    spec = statistics_spec_from_args({"columns": [{"name": "v", "range": [-50, 50], "bins": bins}],
                                      "quantiles": [q], "min_max": False})
    sums = statistics.site_sums(spec, {"v": np.array(values)})
    (estimate,) = [f.value for f in statistics.figures(spec, sums) if f.statistic.startswith("quantile")]
    assert abs(estimate - np.quantile(values, q)) <= 100 / bins * (1 + 1e-12)


def test_a_quantile_whose_order_statistic_lies_outside_the_range_is_undefined():
    spec = statistics_spec_from_args({"columns": [{"name": "v", "range": [0, 1], "bins": 2}], "quantiles": [0, 0.5]})
    got = by_key(statistics.figures(spec, statistics.site_sums(spec, {"v": np.array(["-1", "0.2", "0.7"])})))
    assert got[("all", "v", "quantile 0")] is None and 0 <= got[("all", "v", "quantile 0.5")] <= 0.5


# The vector of sums ---------------------------------------------------------------------------------------


def test_the_layout_is_the_sites_vector_and_travels_on_the_wire():
    spec = statistics_spec_from_args(HEART)
    table = statistics.read_table(DatasetSpec(kind="heart-disease", hospital="switzerland"))
    sums = statistics.site_sums(spec, table)
    expected = statistics.layout(spec)
    assert statistics.layout(spec) == expected and [n for n, _, _ in expected] == list(sums)
    assert all(sums[name].shape == shape and dtype == "F64" for name, dtype, shape in expected)
    layout, blob = wire.encode(sums)   # finite everywhere (empty groups' min/max too) and validly named
    assert layout == wire.Layout.build(expected)
    assert wire.decode(layout, bytes(blob)).keys() == sums.keys()
    assert {n.split("/")[0] for n, _, _ in expected} == {"stats", "min", "max"}


def test_min_max_are_combined_by_min_and_max_and_sums_by_addition():
    spec = statistics_spec_from_args({"columns": [{"name": "v"}]})
    a, b = ({"v": np.array(v)} for v in (["1", "5"], ["-3", ""]))
    pooled = statistics.combine_clear(spec, [statistics.site_sums(spec, a), statistics.site_sums(spec, b)])
    got = by_key(statistics.figures(spec, pooled))
    assert (got[("all", "v", "min")], got[("all", "v", "max")], got[("all", "v", "sum")]) == (-3, 5, 3)
    assert got[("all", "v", "missing")] == 1
    with pytest.raises(ValueError, match="missing \\['max/c0'\\]"):
        statistics.combine_clear(spec, [{k: v for k, v in pooled.items() if k != "max/c0"}])


BOUNDED = {"columns": [{"name": "x", "range": [-3, 7], "bins": 4}, {"name": "y", "range": [1000, 3000]},
                       {"name": "z", "categories": ["p", "q"]}],
           "group_by": {"column": "g", "categories": ["u", "v"]}, "covariance": True, "min_max": False}


def cell(value: float | None) -> str:
    return "" if value is None else repr(value)


def bounded_table(xs: list, ys: list) -> dict[str, np.ndarray]:
    n = min(len(xs), len(ys))
    return {"x": np.array([cell(v) for v in xs[:n]]), "y": np.array([cell(v) for v in ys[:n]]),
            "z": np.array(["p", "q", ""] * n)[:n], "g": np.array(["u", "v", "u", ""] * n)[:n]}


@settings(max_examples=100, deadline=None)
@given(xs=st.lists(st.one_of(st.none(), st.floats(-3, 7)), min_size=1, max_size=40),
       ys=st.lists(st.one_of(st.none(), st.floats(1000, 3000)), min_size=1, max_size=40))
def test_with_values_inside_their_ranges_no_sum_exceeds_the_sites_rows(xs, ys):
    """The secure-aggregation clip rule: clip >= the largest site's rows covers every value it sends."""
    spec = statistics_spec_from_args(BOUNDED)
    table = bounded_table(xs, ys)
    rows = len(table["x"])
    sums = statistics.site_sums(spec, table)
    assert max(float(np.max(np.abs(v))) for v in sums.values()) <= rows
    assert sums["stats/rows"][0] == rows


def test_numeric_sums_are_of_u_scaled_to_the_range_and_values_outside_it_are_summed_as_they_are():
    spec = statistics_spec_from_args({"columns": [{"name": "v", "range": [0, 10]}, {"name": "raw"}],
                                      "covariance": True})
    table = {"v": np.array(["-5", "4", "30"]), "raw": np.array(["1", "2", "3"])}
    sums = statistics.site_sums(spec, table)   # c = 5, w = 5: u = -2, -0.2, 5; without a range u = x
    assert sums["stats/c0/sum"].tolist() == pytest.approx([2.8]) and sums["stats/c0/sumsq"] == pytest.approx(29.04)
    assert sums["stats/c1/sum"].tolist() == [6.0] and sums["stats/c1/sumsq"].tolist() == [14.0]
    assert sums["stats/cov/c0-c1"][0] == pytest.approx([3, 2.8, 6, 29.04, 14, -2 - 0.4 + 15])
    frame = pd.DataFrame({"v": [-5.0, 4.0, 30.0], "raw": [1.0, 2.0, 3.0]})
    assert_equals_pandas(spec, statistics.figures(spec, sums), frame)


# Schema ---------------------------------------------------------------------------------------------------


def test_schema_problems_name_every_difference():
    spec = statistics_spec_from_args({"columns": [{"name": "x"}, {"name": "sex", "categories": ["Male", "Female"]},
                                                  {"name": "gone"}],
                                      "group_by": {"column": "site", "categories": ["a"]}})
    table = {"x": np.array(["1", "n/a", "", "2", "?", "x", "y", "z", "w", "3"]),
             "sex": np.array(["Male", "male", "F", "", "Female", "male", "M", "U", "X", "Y"]),
             "site": np.array(["a", "a", "b", "", "a", "a", "a", "a", "a", "a"])}
    problems = statistics.schema_problems(spec, table)
    assert problems == [
        "missing column(s) 'gone'",
        "column 'x': 6 cell(s) are not numbers (data rows 2, 5, 6, 7, 8, ...); a numeric column holds numbers and "
        "empty cells, or declare `categories` to count its values as text",
        "column 'sex': 7 cell(s) hold values not among its declared categories: 'male', 'F', 'M', 'U', 'X' and 1 "
        "more; add them to categories",
        "column 'site': 1 cell(s) hold values not among its declared group_by.categories: 'b'; add them to "
        "group_by.categories"]
    with pytest.raises(ValueError, match="does not match the statistics spec: missing column"):
        statistics.site_sums(spec, table)


def test_categories_match_the_cell_text_exactly():
    spec = statistics_spec_from_args({"columns": [{"name": "n", "categories": [0, 1]}]})
    assert statistics.schema_problems(spec, {"n": np.array(["0", "1", " 1 "])}) == []
    assert "'0.0'" in statistics.schema_problems(spec, {"n": np.array(["0.0", "1"])})[0]


def test_statistics_read_csv_and_heart_disease_only():
    with pytest.raises(ValueError, match="kind 'csv' or 'heart-disease'; this dataset is of kind 'npz'"):
        statistics.read_table(DatasetSpec(kind="npz", path=HEART_DISEASE_CSV))


# Small cells ----------------------------------------------------------------------------------------------


def test_small_cells_are_named_and_empty_cells_are_fine():
    spec = statistics_spec_from_args({"columns": [{"name": "x", "range": [0, 10], "bins": 2},
                                                  {"name": "c", "categories": ["p", "q", "r"]}],
                                      "group_by": {"column": "g", "categories": ["big", "tiny", "none"]},
                                      "min_max": False})
    table = {"x": np.array(["1"] * 6 + ["", "9", "9"]), "c": np.array(["p"] * 5 + ["q", "p", "p", "p"]),
             "g": np.array(["big"] * 7 + ["tiny", "tiny"])}
    assert statistics.site_sums(spec, table, min_cell_count=1)   # nothing has fewer than 1 row
    with pytest.raises(SmallCells) as info:
        statistics.site_sums(spec, table, min_cell_count=3)
    assert info.value.cells == ["all / x / histogram [5, 10]", "all / x / missing", "all / c / q",
                                "g=big / x / missing", "g=big / c / q", "group g=tiny (and every cell in it)"]
    assert "6 cell(s) would hold 1 to 2 rows, fewer than this site's min_cell_count 3" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_rows_whose_group_value_is_missing_are_a_cell_too():
    """"all" less the listed groups is the sums of the rows without a group value: 2 rows here, whose ages the
    released sums and sums of squares give exactly unless that difference is checked like any group."""
    spec = statistics_spec_from_args({"columns": [{"name": "age", "range": [0, 100]}],
                                      "group_by": {"column": "g", "categories": ["a", "b"]}, "min_max": False})
    table = {"age": np.array(["50"] * 10 + ["53", "52"]), "g": np.array(["a"] * 5 + ["b"] * 5 + ["", ""])}
    with pytest.raises(SmallCells) as info:
        statistics.site_sums(spec, table, min_cell_count=5)
    assert info.value.cells == ["group g=(missing or unlisted) (and every cell in it)"]
    assert statistics.site_sums(spec, {k: v[:10] for k, v in table.items()}, min_cell_count=5)   # none missing


def test_min_and_max_are_one_rows_value_so_a_min_cell_count_refuses_them():
    spec = statistics_spec_from_args({"columns": [{"name": "x"}]})
    with pytest.raises(SmallCells, match="min and max of the numeric columns"):
        statistics.site_sums(spec, {"x": np.array(["1"] * 10)}, min_cell_count=5)


def test_heart_hospitals_under_a_min_cell_count_name_their_small_groups():
    spec = statistics_spec_from_args({**HEART, "min_max": False})
    table = statistics.read_table(DatasetSpec(kind="heart-disease", hospital="cleveland"))
    with pytest.raises(SmallCells) as info:
        statistics.site_sums(spec, table, min_cell_count=20)
    assert "group num=4 (and every cell in it)" in info.value.cells
    assert "all / age / histogram [20, 30)" in info.value.cells


# Differential privacy -------------------------------------------------------------------------------------

DP_SPEC = {"columns": [{"name": "age", "range": [20, 80], "bins": 6}, {"name": "chol", "range": [0, 600]},
                       {"name": "sex", "categories": ["Male", "Female"]}],
           "group_by": {"column": "num", "categories": [0, 1, 2, 3, 4]}, "covariance": True, "min_max": False}


@pytest.mark.parametrize("mechanism, epsilon", [("laplace", 2.0), ("gaussian", 0.5)])
def test_dp_noise_has_the_stated_scale_and_each_query_its_epsilon(mechanism, epsilon):
    spec = statistics_spec_from_args({**DP_SPEC, "dp": {"mechanism": mechanism, "epsilon": epsilon,
                                                        "delta": 1e-6}})
    pooled = {name: np.zeros(shape) for name, _, shape in statistics.layout(spec)}
    rng = np.random.default_rng(7)
    draws = [statistics.add_dp_noise(spec, pooled, rng) for _ in range(400)]
    ledger = draws[0][1]
    queries = {q.query: q for q in ledger.queries}
    # Grouped: one row changes a cell in "all" and one in its group (L1 x2, L2 x sqrt 2). Every sum is of
    # u = (x − c)/w clamped to [-1, 1], so one row moves each cell by at most 1: counts and sums alike.
    grouped = 2 if mechanism == "laplace" else math.sqrt(2)
    assert {q.sensitivity for q in ledger.queries} == {grouped}
    assert {"count of 'age'", "sum of 'age'", "sum of squares of 'chol'", "sum_ij of 'age' × 'chol'"} <= set(queries)
    for q in ledger.queries:
        tensor, _, part = q.tensor.partition(":")
        noise = np.stack([d[tensor][..., statistics._COV_PARTS.index(part)] if part else d[tensor] for d, _ in draws])
        if mechanism == "laplace":
            assert q.scale == pytest.approx(q.sensitivity / epsilon)
            expected_std = q.scale * math.sqrt(2)
        else:
            assert q.scale == pytest.approx(q.sensitivity * math.sqrt(2 * math.log(1.25 / 1e-6)) / epsilon)
            expected_std = q.scale
        assert noise.std() == pytest.approx(expected_std, rel=0.08), q.query   # >= 2400 draws per query
        assert abs(noise.mean()) < 4 * expected_std / math.sqrt(noise.size)
        assert (q.epsilon, q.delta) == (epsilon, 1e-6 if mechanism == "gaussian" else 0.0)
    assert len(ledger.queries) == 1 + 5 + 4 + 2 + 6   # rows, age, chol, sex, the pair's six sums
    # In x's units the noise is that of a sensitivity of the half-width w, 30 for age: the sum figure is
    # n·c + w·Σu (c = 50 here), so beyond the noisy count's n·c it carries w times Σu's noise.
    unit = math.sqrt(2) if mechanism == "laplace" else 1.0   # the std of a unit-scale draw
    age = np.array([by_key(statistics.figures(spec, d))[("all", "age", "sum")] - 50 * d["stats/c0/count"][0]
                    for d, _ in draws])
    assert age.std() == pytest.approx(30 * queries["sum of 'age'"].scale * unit, rel=0.15)
    assert ledger.epsilon == pytest.approx(epsilon * len(ledger.queries))
    assert ledger.delta == pytest.approx((1e-6 if mechanism == "gaussian" else 0.0) * len(ledger.queries))


@settings(max_examples=60, deadline=None)
@given(xs=st.lists(st.one_of(st.none(), st.floats(-1e4, 1e4)), min_size=1, max_size=20),
       ys=st.lists(st.one_of(st.none(), st.floats(-1e4, 1e4)), min_size=1, max_size=20),
       extra=st.tuples(st.one_of(st.none(), st.floats(-1e4, 1e4)), st.one_of(st.none(), st.floats(-1e4, 1e4)),
                       st.sampled_from(["p", "q", ""]), st.sampled_from(["u", "v", ""])),
       mechanism=st.sampled_from(["laplace", "gaussian"]))
def test_one_row_added_moves_every_query_by_at_most_its_sensitivity(xs, ys, extra, mechanism):
    """The ledger's sensitivities hold for any values, those far outside the ranges too (clamped under dp)."""
    spec = statistics_spec_from_args({**BOUNDED, "dp": {"mechanism": mechanism, "epsilon": 0.5}})
    table = bounded_table(xs, ys)
    more = {name: np.append(values, cell(v) if name in ("x", "y") else v)
            for (name, values), v in zip(table.items(), extra)}
    before, after = statistics.site_sums(spec, table), statistics.site_sums(spec, more)
    for q in statistics.dp_ledger(spec).queries:
        tensor, _, part = q.tensor.partition(":")
        change = after[tensor] - before[tensor]
        if part:
            change = change[..., statistics._COV_PARTS.index(part)]
        norm = np.abs(change).sum() if mechanism == "laplace" else np.sqrt((change ** 2).sum())
        assert norm <= q.sensitivity * (1 + 1e-12), (q.query, norm, q.sensitivity)


def test_dp_noise_is_reproducible_from_the_rng_and_clamps_values_to_the_range():
    spec = statistics_spec_from_args({"columns": [{"name": "v", "range": [0, 10]}], "min_max": False,
                                      "dp": {"mechanism": "laplace", "epsilon": 1.0}})
    sums = statistics.site_sums(spec, {"v": np.array(["-5", "4", "30"])})
    assert statistics.figures(spec, sums)[3:5] == [Figure("all", "v", "sum", 14.0), Figure("all", "v", "mean",
                                                                                           14 / 3)]
    a, _ = statistics.add_dp_noise(spec, sums, np.random.default_rng(1))
    b, _ = statistics.add_dp_noise(spec, sums, np.random.default_rng(1))
    assert all(np.array_equal(a[k], b[k]) for k in a) and not np.array_equal(a["stats/c0/sum"], sums["stats/c0/sum"])


def test_noisy_sums_still_give_figures():
    spec = statistics_spec_from_args({**DP_SPEC, "quantiles": [0.5], "dp": {"mechanism": "laplace", "epsilon": 0.1}})
    noisy, ledger = statistics.add_dp_noise(spec, pooled_heart(spec), np.random.default_rng(3))
    rows = statistics.figures(spec, noisy)
    assert by_key(rows)[("all", "age", "mean")] == pytest.approx(53.5, abs=2)
    assert json.loads(statistics.to_json(rows, ledger))["dp"]["epsilon"] == pytest.approx(0.1 * 18)


# Output ---------------------------------------------------------------------------------------------------


def test_table_csv_and_json_carry_every_figure():
    spec = statistics_spec_from_args(SMALL)
    table = {"x": np.array(["1", "2", ""]), "y": np.array(["3", "4", "5"]), "z": np.array(["red", "", "blue"]),
             "g": np.array(["u", "u", "v"])}
    rows = statistics.figures(spec, statistics.site_sums(spec, table))
    text = statistics.to_table(rows).splitlines()
    assert text[0].split() == ["column", "statistic", "all", "g=u", "g=v", "g=w"]
    assert text[1].split() == ["rows", "3", "2", "1", "0"]
    assert text[5].split() == ["x", "mean", "1.5", "1.5", "-", "-"]   # no values in g=v, no rows in g=w
    parsed = list(csv.DictReader(io.StringIO(statistics.to_csv(rows))))
    assert len(parsed) == len(rows) and parsed[0] == {"group": "all", "column": "", "statistic": "rows", "value": "3.0"}
    x = {(r["group"], r["statistic"]): r["value"] for r in parsed if r["column"] == "x"}
    assert (x[("g=w", "count")], x[("g=w", "mean")], x[("all", "mean")]) == ("0.0", "", "1.5")
    loaded = json.loads(statistics.to_json(rows))
    assert loaded["dp"] is None and [Figure(**f) for f in loaded["figures"]] == rows


def test_output_is_safe_to_print_and_open_in_a_spreadsheet():
    rows = [Figure("all", "=HYPERLINK(1)", "count", 1.0), Figure("all", "a\x1b[2Jb", "count", None)]
    assert "'=HYPERLINK(1)" in statistics.to_csv(rows)
    assert "\x1b" not in statistics.to_table(rows) and "a\\x1b[2Jb" in statistics.to_table(rows)


# Configuration --------------------------------------------------------------------------------------------


def parse(text: str) -> StatisticsSpec:
    return typed_yaml.parse(textwrap.dedent(text), StatisticsSpec, source="stats.yaml", max_bytes=1 << 16,
                            checks=config._CROSS_CHECKS)


def test_the_block_reads_from_yaml_and_round_trips_through_plain_args():
    spec = parse("""\
        columns:
          - {name: age, range: [0, 100], bins: 10}
          - {name: chol, range: [0, 700]}
          - {name: sex, categories: [Male, Female]}
        group_by: {column: num, categories: [0, 1, 2, 3, 4]}
        quantiles: [0.25, 0.5, 0.75]
        covariance: true
        min_max: false
        dp: {mechanism: laplace, epsilon: 1.0}
        """)
    assert spec.group_by.categories == ("0", "1", "2", "3", "4") and spec.columns[0].range == (0.0, 100.0)
    args = statistics_args(spec)
    assert json.loads(json.dumps(args)) == args   # plain data
    assert "categories" not in args["columns"][0] and args["dp"] == {"mechanism": "laplace", "epsilon": 1.0,
                                                                      "delta": 1e-5}
    assert statistics_spec_from_args(args) == spec


@pytest.mark.parametrize("text, expected", [
    ("columns: [{name: a, bins: 3}]", "stats.yaml:1: columns[0].bins: needs `range: [lo, hi]`"),
    ("columns:\n  - {name: a}\n  - {name: b, range: [5, 1]}", "stats.yaml:3: columns[1].range: [5.0, 1.0] is not a"),
    ("columns:\n  - {name: s, categories: [x], bins: 2}", "stats.yaml:2: columns[0].bins: applies to numeric"),
    ("columns:\n  - {name: s, categories: [x, x]}", "stats.yaml:2: columns[0].categories: lists a value twice"),
    ("columns:\n  - {name: a}\n  - {name: a}", "stats.yaml:2: columns: lists column(s) ['a'] more than once"),
    ("columns: [{name: a}]\nquantiles: [0.5]", "stats.yaml:2: quantiles: are read from histograms"),
    ("columns: [{name: a, range: [0, 1], bins: 2}]\nquantiles: [1.5]", "stats.yaml:2: quantiles: 1.5 is not a"),
    ("columns: [{name: a}]\ncovariance: true", "stats.yaml:2: covariance: needs at least 2 numeric columns"),
    ("columns: [{name: a, range: [0, 1]}]\ndp: {mechanism: laplace, epsilon: 1}",
     "stats.yaml:1: min_max: cannot be released under dp"),
    ("columns: [{name: a}]\nmin_max: false\ndp: {mechanism: laplace, epsilon: 1}",
     "stats.yaml:3: dp: needs `range: [lo, hi]` on every numeric column"),
    ("columns: [{name: a, range: [0, 1]}]\nmin_max: false\ndp: {mechanism: gaussian, epsilon: 2}",
     "stats.yaml:3: dp: epsilon is 2, and the Gaussian mechanism"),
    ("columns: [{name: a}]\ndp: {mechanism: exponential, epsilon: 1}", "stats.yaml:2: dp.mechanism: 'exponential'"),
    ("columns: [{name: a}]\ngroup_by: {column: g, categories: [1, 1]}", "stats.yaml:2: group_by.categories: lists"),
    ("columns: [{name: a, rnage: [0, 1]}]", "stats.yaml:1: columns[0].rnage: unknown key"),
])
def test_config_mistakes_name_the_key_and_line(text, expected):
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert str(info.value).startswith(expected), str(info.value)
