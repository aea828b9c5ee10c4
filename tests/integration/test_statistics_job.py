"""`kind: statistics` over real gRPC + mTLS: the four heart-disease hospitals pool their sums, and the figures
`plexus job show` / `job download` give equal pandas on the pooled raw rows (in the clear exactly; under secure
aggregation within the fixed-point bound). A site under policy.min_cell_count declines, naming the cells."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from plexus import statistics as stats
from plexus.cli import main as cli
from plexus.config import DatasetSpec, parse_round_config
from plexus.datasets import HEART_DISEASE_CSV
from plexus.secagg.fixed_point import frac_bits

from integration.harness import HOSPITAL_OF, scaled

SITES = ("a", "b", "c", "d")   # cleveland, hungary, va, switzerland
HOSPITAL_ROWS = {"cleveland": "Cleveland", "hungary": "Hungary", "va": "VA Long Beach", "switzerland": "Switzerland"}
CLIP = 512   # the largest hospital, Cleveland, has 303 rows

CLEAR_JOB = f"""\
name: heart-stats
kind: statistics
data: {{dataset: heart-disease}}
statistics:
  columns:
    - {{name: age, range: [0, 100], bins: 10}}
    - {{name: chol}}
    - {{name: oldpeak, range: [-3, 7], bins: 5}}
    - {{name: sex, categories: [Male, Female]}}
  group_by: {{column: num, categories: [0, 1, 2, 3, 4]}}
  quantiles: [0.25, 0.5, 0.75]
  covariance: true
sites: {{min: 4, deadline_s: {scaled(30)}}}
"""

# Under secure aggregation every numeric column has a range, and its sums are of u = (x − c)/w: with values
# inside the ranges no sum exceeds a site's rows, so a clip above the largest site's rows covers them. chol's
# zeros (every Switzerland row, 49 of VA's) lie outside [100, 600] and are summed as they are (u = −1.4):
# Switzerland's Σu² is 241, above its 123 rows and still within the clip. A min is not a sum.
SECURE_JOB = f"""\
name: heart-stats-secure
kind: statistics
data: {{dataset: heart-disease}}
statistics:
  columns:
    - {{name: age, range: [0, 100], bins: 10}}
    - {{name: chol, range: [100, 600]}}
    - {{name: oldpeak, range: [-3, 7], bins: 5}}
    - {{name: sex, categories: [Male, Female]}}
  group_by: {{column: num, categories: [0, 1, 2, 3, 4]}}
  quantiles: [0.5]
  covariance: true
  min_max: false
sites: {{min: 4, deadline_s: {scaled(30)}}}
privacy: {{secure_aggregation: true, secagg: {{clip: {CLIP}, phase_timeout_s: {scaled(20)}}}}}
"""



def _run(federation, sites, job: str, **policy) -> str:
    for site in sites:
        federation.start_site(site, allowed_models=("statistics",), **policy.get(site, {}))
    federation.wait_online(*sites)
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    return job_id


def _pooled_rows(sites) -> pd.DataFrame:
    df = pd.read_csv(HEART_DISEASE_CSV, dtype=str, keep_default_na=False).apply(lambda c: c.str.strip())
    return df[df["dataset"].isin([HOSPITAL_ROWS[HOSPITAL_OF[s]] for s in sites])]


def _bin_labels(lo: float, hi: float, bins: int) -> list[str]:
    edges = np.linspace(lo, hi, bins + 1)
    inner = [f"[{a:g}, {b:g})" for a, b in zip(edges[:-1], edges[1:])]
    inner[-1] = inner[-1][:-1] + "]"
    return [f"< {lo:g}", *inner, f"> {hi:g}"]


def pandas_figures(rows: pd.DataFrame, spec) -> dict[tuple[str, str, str], float | None]:
    """The figures of a statistics spec computed by pandas on the raw rows (quantiles left out: a histogram's)."""
    def value(v) -> float | None:
        return None if pd.isna(v) else float(v)

    groups = {"all": rows}
    if spec.group_by is not None:
        for c in spec.group_by.categories:
            groups[f"{spec.group_by.column}={c}"] = rows[rows[spec.group_by.column] == c]
    out = {}
    numeric = {}
    for label, g in groups.items():
        out[(label, "", "rows")] = float(len(g))
        for column in spec.columns:
            cells = g[column.name]
            if column.categories is not None:
                out[(label, column.name, "count")] = float((cells != "").sum())
                out[(label, column.name, "missing")] = float((cells == "").sum())
                for category in column.categories:
                    out[(label, column.name, f"category {category}")] = float((cells == category).sum())
                continue
            x = pd.to_numeric(cells.replace("", np.nan))
            numeric[(label, column.name)] = x
            out[(label, column.name, "count")] = float(x.count())
            out[(label, column.name, "missing")] = float(x.isna().sum())
            out[(label, column.name, "sum")] = float(x.sum())
            for name in ("mean", "var", "std"):
                out[(label, column.name, name)] = value(getattr(x, name)())
            if spec.min_max:
                out[(label, column.name, "min")] = value(x.min())
                out[(label, column.name, "max")] = value(x.max())
            if column.bins is not None:
                lo, hi = column.range
                present = x.dropna()
                inner, _ = np.histogram(present[(present >= lo) & (present <= hi)], bins=column.bins, range=(lo, hi))
                counts = [(present < lo).sum(), *inner, (present > hi).sum()]
                for label_, n in zip(_bin_labels(lo, hi, column.bins), counts):
                    out[(label, column.name, f"histogram {label_}")] = float(n)
        if spec.covariance:
            names = [c.name for c in spec.columns if c.categories is None]
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    x, y = numeric[(label, a)], numeric[(label, b)]
                    pair = f"{a} × {b}"
                    out[(label, pair, "count")] = float((x.notna() & y.notna()).sum())
                    out[(label, pair, "cov")] = value(x.cov(y))
                    out[(label, pair, "corr")] = value(x.corr(y))
    return out


def fixed_point_tolerance(spec, rows: pd.DataFrame, e: float):
    """Each figure's bound under secure aggregation (docs/statistics.md#privacy), to first order in e, every
    pooled sum's bound in u units: counts e; sum (w + |c|)·e; mean w·e·a/n; var w²·e·(a² + s²)/(n − 1), with
    a = 1 + |ū|, ū = (mean − c)/w and s² = var/w²; std var's over 2·std; cov w_i·w_j·e·(a_i·a_j + |cov_u|)/(n − 1)
    and corr e·(a_i·a_j/√(M_i·M_j) + |corr|·(a_i²/M_i + a_j²/M_j)/2), M = (n − 1)·s², over the rows with both."""
    scale = {c.name: (sum(c.range) / 2, (c.range[1] - c.range[0]) / 2) for c in spec.columns if c.range}
    cells = {label: g for label, g in [("all", rows), *((f"num={k}", rows[rows["num"] == k])
                                                          for k in spec.group_by.categories)]}

    def values(label: str, *names: str) -> list[np.ndarray]:
        x = cells[label][list(names)].replace("", np.nan).apply(pd.to_numeric).dropna()
        return [(x[name].to_numpy() - scale[name][0]) / scale[name][1] for name in names]

    def spread(u: np.ndarray) -> tuple[float, float]:   # a, M
        return 1 + abs(u.mean()), float(((u - u.mean()) ** 2).sum())

    def tolerance(key) -> float:
        label, column, statistic = key
        if statistic in ("rows", "count", "missing") or statistic.startswith(("category ", "histogram ")):
            return e
        if " × " in column:
            i, j = column.split(" × ")
            ui, uj = values(label, i, j)
            n, (ai, mi), (aj, mj) = len(ui), spread(ui), spread(uj)
            mij = float(((ui - ui.mean()) * (uj - uj.mean())).sum())
            if statistic == "cov":
                return scale[i][1] * scale[j][1] * e * (ai * aj + abs(mij) / (n - 1)) / (n - 1)
            corr = mij / math.sqrt(mi * mj)
            return e * (ai * aj / math.sqrt(mi * mj) + abs(corr) * (ai ** 2 / mi + aj ** 2 / mj) / 2)
        (u,), (c, w) = values(label, column), scale[column]
        n, (a, m) = len(u), spread(u)
        if statistic == "sum":
            return (w + abs(c)) * e
        if statistic == "mean":
            return w * e * a / n
        var = w * w * e * (a * a + m / (n - 1)) / (n - 1)
        return var if statistic == "var" else var / (2 * w * math.sqrt(m / (n - 1)))

    return tolerance


def _figures_json(federation, job_id, tmp_path, capsys) -> dict:
    path = tmp_path / "figures.json"
    assert cli(["job", "download", job_id, "-o", str(path), *federation.cli_args()]) == 0
    assert f"to {path} (json)" in capsys.readouterr().out
    return json.loads(path.read_text())


def _compare(got: dict, spec, rows: pd.DataFrame, tolerance) -> None:
    expected = pandas_figures(rows, spec)
    figures = {(f["group"], f["column"], f["statistic"]): f["value"] for f in got["figures"]}
    quantiles = {k: v for k, v in figures.items() if k[2].startswith("quantile ")}
    assert set(figures) - set(quantiles) == set(expected)
    for key, want in expected.items():
        have = figures[key]
        assert (have is None) == (want is None), (key, have, want)
        if want is not None:
            assert have == pytest.approx(want, **tolerance(key)), key
    for (group, column, name), have in quantiles.items():   # estimated within one bin width, where defined
        spec_column = next(c for c in spec.columns if c.name == column)
        x = pd.to_numeric((rows if group == "all" else rows[rows["num"] == group.split("=")[1]])[column]
                          .replace("", np.nan)).dropna()
        width = (spec_column.range[1] - spec_column.range[0]) / spec_column.bins
        if have is not None:
            assert abs(have - x.quantile(float(name.split()[1]))) <= width, (group, column, name)


def test_statistics_in_the_clear_equal_pandas_on_the_pooled_rows(federation, tmp_path, capsys):
    job_id = _run(federation, SITES, CLEAR_JOB)
    spec = parse_round_config(CLEAR_JOB).statistics
    rows = _pooled_rows(SITES)
    exact = {"rel": 1e-12, "abs": 1e-9}   # the same sums, added in another order
    _compare(_figures_json(federation, job_id, tmp_path, capsys), spec, rows, lambda key: exact)

    assert cli(["job", "show", job_id, *federation.cli_args()]) == 0
    shown = capsys.readouterr().out
    assert "status: completed" in shown and "statistics of the pooled rows" in shown
    header = next(line for line in shown.splitlines() if line.startswith("column "))
    assert header.split() == ["column", "statistic", "all", "num=0", "num=1", "num=2", "num=3", "num=4"]
    mean_age = next(line for line in shown.splitlines() if line.split()[:2] == ["age", "mean"])
    assert float(mean_age.split()[2]) == pytest.approx(pd.to_numeric(rows["age"]).mean(), rel=1e-7)

    # A viewer may not download models, and the figures are this job's: the rest of the job is shown.
    assert cli(["job", "show", job_id, *federation.cli_args("viewer")]) == 0
    out, err = capsys.readouterr()
    assert "status: completed" in out and "statistics of the pooled rows" not in out
    assert "statistics not shown: " in err and "role 'operator'" in err

    path = tmp_path / "figures.csv"
    assert cli(["job", "download", job_id, "-o", str(path), *federation.cli_args()]) == 0
    table = pd.read_csv(path, dtype={"group": str, "column": str, "statistic": str}, keep_default_na=False)
    rows_all = table[(table["group"] == "all") & (table["statistic"] == "rows")]
    assert float(rows_all["value"].iloc[0]) == len(rows) == 920
    # No site evaluated the sums (the job ends with its one round), and each sent one update counting once.
    detail = federation.admin().job(job_id)
    assert [r.round for r in detail.rounds] == [1] and sorted(detail.rounds[0].contributors) == list(SITES)
    assert not [m for m in detail.metrics if m.kind == "eval"]


def test_statistics_under_secure_aggregation_equal_pandas_within_the_fixed_point_bound(federation, tmp_path,
                                                                                      capsys):
    job_id = _run(federation, SITES, SECURE_JOB)
    spec = parse_round_config(SECURE_JOB).statistics
    rows = _pooled_rows(SITES)
    # Each site sends round(Δ/K · 2**b), b = frac_bits(clip); K such roundings in the mean, times K: the sums.
    bound = len(SITES) ** 2 * 2.0 ** -frac_bits(CLIP) / 2
    assert bound == 16 * 2.0 ** -22   # clip 512: 21 fraction bits, sums within 3.8e-6 in u units
    _, sums = federation.admin().download(job_id)
    per_site = [stats.site_sums(spec, stats.read_table(agent.config.datasets["heart-disease"]))
                for agent, _ in federation.agents]
    exact = stats.combine_clear(spec, per_site)
    for name, value in exact.items():
        assert np.max(np.abs(sums[name] - value)) <= bound, name
    assert any(np.any(sums[name] != value) for name, value in exact.items())   # it was masked and quantised

    # Every figure within its stated bound, to first order: the slack covers second order (e² ~ 1e-11) and
    # float64 rounding, both far below the bound.
    within = fixed_point_tolerance(spec, rows, bound)
    _compare(_figures_json(federation, job_id, tmp_path, capsys), spec, rows,
             lambda key: {"abs": 1.01 * within(key), "rel": 1e-12})


def test_a_site_under_min_cell_count_declines_naming_its_small_cells(federation, tmp_path, capsys):
    job = CLEAR_JOB.replace("sites: {min: 4", "sites: {min: 3")
    job_id = _run(federation, SITES, job, d={"min_cell_count": 10})
    events = [e for e in federation.admin().job(job_id).site_events if e.site == "d"]
    assert [e.status for e in events] == ["declined"]
    reason = events[0].reason
    assert "min_cell_count 10" in reason and "group num=0 (and every cell in it)" in reason, reason
    assert "min and max of the numeric columns" in reason
    # The job completed from the other three; its figures are theirs.
    spec = parse_round_config(job).statistics
    exact = {"rel": 1e-12, "abs": 1e-9}
    _compare(_figures_json(federation, job_id, tmp_path, capsys), spec, _pooled_rows(("a", "b", "c")),
             lambda key: exact)


def test_a_clip_below_the_sums_fails_the_secure_round_loudly(federation):
    job = SECURE_JOB.replace(f"clip: {CLIP}", "clip: 16")
    for site in SITES:
        federation.start_site(site, allowed_models=("statistics",))
    federation.wait_online(*SITES)
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id) == "failed"
    failed = {e.site: e.reason for e in federation.admin().job(job_id).site_events if e.status == "failed"}
    assert sorted(failed) == list(SITES)
    assert all("beyond privacy.secagg.clip = 16" in why and "set privacy.secagg.clip to at least" in why
               for why in failed.values()), failed


TRAIN_JOB = f"""\
name: heart-train
model: {{name: logistic, args: {{in_features: 1, num_classes: 5}}}}
data:
  dataset: heart-disease
  label: {{column: num, classes: ["0", "1", "2", "3", "4"]}}
  features: [{{name: age}}]
rounds: 1
sites: {{min: 3, deadline_s: {scaled(30)}}}
train: {{epochs: 1, batch_size: 32, optimizer: {{name: sgd, lr: 0.1}}}}
"""


def test_hospitals_whose_csv_names_no_label_pool_statistics_and_decline_training(federation, tmp_path, capsys):
    sites = ("a", "b", "c")
    for site in sites:   # each hospital's export as its own CSV file, offered without a label column
        path = tmp_path / f"{site}.csv"
        _pooled_rows((site,)).to_csv(path, index=False)
        federation.start_site(site, allowed_models=("statistics", "logistic"),
                              datasets={"heart-disease": DatasetSpec(kind="csv", path=path)})
    federation.wait_online(*sites)
    job = CLEAR_JOB.replace("sites: {min: 4", "sites: {min: 3")
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    exact = {"rel": 1e-12, "abs": 1e-9}
    _compare(_figures_json(federation, job_id, tmp_path, capsys), parse_round_config(job).statistics,
             _pooled_rows(sites), lambda key: exact)

    job_id = federation.admin().submit(TRAIN_JOB).job_id
    assert federation.wait_job(job_id) == "failed"
    assert "(other sites — a: declined, b: declined, c: declined)" in federation.store.job(job_id).message
    assert federation.store.declines(job_id) == dict.fromkeys(
        sites, "dataset 'heart-disease': it serves statistics jobs only at this site: its entry in site.yaml names "
               "no label column; to train on it, the site adds `label: COLUMN` to the dataset in site.yaml")
