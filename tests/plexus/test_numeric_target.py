"""A job's numeric target (data.target: numeric): its config checks, and float64 labels from npz and csv files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plexus.cli import main as cli
from plexus.config import DatasetSpec, DataSpec, FeatureSpec, LabelSpec, dump_round_config, parse_round_config
from plexus.datasets import DataError, load_as_stored, load_dataset, load_for_job, random_split, train_rows
from plexus.errors import ConfigError, IntegrityError

REGRESSION = """\
name: r
model: {{name: {model}, args: {{in_features: 2}}}}
rounds: 5
strategy: {{name: {strategy}}}
data:
  dataset: d
{data}"""


def _job(data: str = "  target: numeric\n", *, model: str = "linear", strategy: str = "lbfgs") -> str:
    return REGRESSION.format(data=data, model=model, strategy=strategy)


# config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["lbfgs", "newton"])
def test_a_numeric_linear_job_parses_and_round_trips_with_its_target(strategy):
    cfg = parse_round_config(_job("  target: numeric\n  label: {column: y}\n  features: [{name: a}, {name: b}]\n",
                                  strategy=strategy))
    assert cfg.data.target == "numeric" and cfg.data.label == LabelSpec(column="y")
    dumped = dump_round_config(cfg)
    assert "target: numeric" in dumped and "classes" not in dumped
    assert parse_round_config(dumped) == cfg


def test_a_class_job_dumps_as_before_without_the_target_key():
    cfg = parse_round_config(_job("  target: class\n", model="logistic", strategy="fedavg"))
    assert cfg.data.target == "class"
    assert "target" not in dump_round_config(cfg)   # older agents, which reject unknown keys, still read it


@pytest.mark.parametrize(("job", "expected"), [
    (_job("", strategy="fedavg"),
     "job.yaml:6: data: model 'linear' fits numeric targets (squared error), and data.target is 'class'; add "
     "`target: numeric` to data"),
    (_job(model="logistic", strategy="fedavg"),
     "job.yaml:2: model: 'logistic' is not a regression model, and data.target is 'numeric'; use linear, or "
     "remove `target: numeric`"),
    (_job(strategy="fedavg"),
     "job.yaml:4: strategy: 'fedavg' trains by minibatch steps, which site training runs for classifiers only, and "
     "data.target is 'numeric'; use strategy lbfgs or newton"),
    (_job("  target: numbers\n"),
     "job.yaml:7: data.target: 'numbers' is not allowed; use one of: class, numeric"),
    (_job("  target: numeric\n  label: {column: y, classes: [a, b]}\n  features: [{name: x}]\n", strategy="fedavg"),
     "job.yaml:8: data.label: classes apply to a class target, and target is 'numeric' (column 'y' holds the "
     "numbers to fit); remove label.classes"),
    (_job("  label: {column: y}\n  features: [{name: x}]\n", model="logistic", strategy="fedavg"),
     "job.yaml:7: data.label: column 'y' has no `classes`, and target is 'class'; list the classes in order"),
])
def test_target_mistakes_name_the_key_and_line_with_the_fix(job, expected):
    with pytest.raises(ConfigError) as err:
        parse_round_config(job, source="job.yaml")
    assert str(err.value).startswith(expected), str(err.value)


# npz -----------------------------------------------------------------------------------------------------------
def _npz(path: Path, **arrays) -> DatasetSpec:
    np.savez(path, **arrays)
    return DatasetSpec(kind="npz", path=path, test_fraction=0.25, split_seed=3)


NUMERIC = DataSpec(dataset="d", target="numeric")


@pytest.mark.parametrize("y", [np.linspace(-2.5, 7.0, 12), np.arange(-6, 6, dtype=np.int32)])
def test_npz_float_and_integer_targets_load_as_float64_labels(tmp_path, y):
    x = np.arange(24, dtype=np.float64).reshape(12, 2)
    split = load_for_job(_npz(tmp_path / "d.npz", x=x, y=y), NUMERIC)
    assert split.y_train.dtype == split.y_test.dtype == np.float64 and split.num_classes == 0
    assert (len(split.y_train), len(split.y_test)) == (9, 3)   # ceil(0.25 * 12) test rows, as a class split takes
    # Every row lands once, its target beside its own features (x's first column is 2 * row).
    rows = np.concatenate([split.x_train[:, 0], split.x_test[:, 0]]) / 2
    assert sorted(rows.tolist()) == list(range(12))
    assert np.array_equal(np.concatenate([split.y_train, split.y_test]), y[rows.astype(int)].astype(np.float64))


def test_npz_explicit_split_keeps_its_numeric_targets_exactly(tmp_path):
    y_train, y_test = np.array([0.1, -3.25, 1e300]), np.array([2.5])
    split = load_for_job(_npz(tmp_path / "d.npz", x_train=np.ones((3, 2)), y_train=y_train,
                              x_test=np.ones((1, 2)), y_test=y_test), NUMERIC)
    assert np.array_equal(split.y_train, y_train) and np.array_equal(split.y_test, y_test)


def test_the_numeric_split_is_seeded_and_keeps_the_class_split_sizes():
    a, b = random_split(np.zeros(50), 0.34, 7), random_split(np.zeros(50), 0.34, 7)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    train, test = a
    assert len(test) == 17 and sorted(np.concatenate(a).tolist()) == list(range(50))
    with pytest.raises(ValueError, match="train and test would not both be non-empty"):
        random_split(np.zeros(1), 0.5, 0)


def test_npz_non_finite_targets_are_declined_naming_the_rows_not_the_values(tmp_path):
    y = np.arange(10, dtype=np.float64)
    y[[3, 7]] = [np.nan, -np.inf]
    with pytest.raises(DataError) as err:
        load_for_job(_npz(tmp_path / "d.npz", x=np.zeros((10, 2)), y=y), NUMERIC)
    assert err.value.remote == ("dataset 'd': 2 row(s) of array 'y' (counted from 0: 3, 7) have no finite target "
                                "(NaN or infinite)")
    assert str(tmp_path) in str(err.value) and str(tmp_path) not in err.value.remote


def test_npz_text_targets_are_declined_with_the_reason(tmp_path):
    with pytest.raises(DataError) as err:
        load_for_job(_npz(tmp_path / "d.npz", x=np.zeros((4, 2)), y=np.array(["a", "b", "c", "d"])), NUMERIC)
    assert err.value.remote == "dataset 'd': array 'y' holds str32 values, and the job's numeric target needs numbers"


def test_npz_float_labels_stay_refused_for_a_class_target(tmp_path):
    spec = _npz(tmp_path / "d.npz", x=np.zeros((4, 2)), y=np.linspace(0, 1, 4))
    with pytest.raises(IntegrityError, match="labels must be integers.*declares data.target: numeric"):
        load_dataset(spec)
    with pytest.raises(DataError) as err:
        load_for_job(spec, DataSpec(dataset="d"))
    assert err.value.remote == "dataset 'd' cannot be loaded at this site (IntegrityError); the site's log says why"


def test_join_advertises_an_npz_as_its_file_stores_the_labels(tmp_path):
    floats = _npz(tmp_path / "f.npz", x=np.zeros((12, 2)), y=np.linspace(0, 1, 12))
    assert load_as_stored(floats).num_classes == 0 and train_rows(floats) == 9
    ints = _npz(tmp_path / "i.npz", x=np.zeros((12, 2)), y=np.arange(12) % 3)
    assert load_as_stored(ints).num_classes == 3 and train_rows(ints) == 9
    bad = _npz(tmp_path / "b.npz", x=np.zeros((4, 2)), y=np.array([0.0, np.nan, 1.0, 2.0]))
    with pytest.raises(DataError):   # as before for a class npz: a file that does not load is not advertised
        train_rows(bad)


@pytest.mark.parametrize(("spec", "why"), [
    (DatasetSpec(kind="heart-disease", hospital="va"), "its label is the diagnosis, a class"),
    (DatasetSpec(kind="fashion-mnist", sites=2, index=0, alpha=1.0), "its labels are Fashion-MNIST's ten garment"),
])
def test_class_only_kinds_decline_a_numeric_target_with_the_reason(spec, why):
    with pytest.raises(DataError) as err:
        load_for_job(spec, NUMERIC)
    assert err.value.remote.startswith(f"dataset 'd': it is a {spec.kind} dataset at this site, and {why}")
    assert err.value.remote.endswith("numeric targets come from csv or npz datasets")


# csv -----------------------------------------------------------------------------------------------------------
CSV_SCHEMA = DataSpec(dataset="d", target="numeric", label=LabelSpec(column="los"),
                      features=(FeatureSpec(name="age", center=60.0, scale=20.0), FeatureSpec(name="ward",
                                                                                            categories=("a", "b"))))


def _csv(path: Path, rows: list[str]) -> DatasetSpec:
    path.write_text("id,age,ward,los\n" + "\n".join(rows) + "\n")
    return DatasetSpec(kind="csv", path=path, label="los", test_fraction=0.25, split_seed=1)


def test_csv_numeric_target_loads_the_label_cells_as_float64(tmp_path):
    rows = [f"{i},{40 + i},{'ab'[i % 2]},{1.5 * i - 2}" for i in range(8)]
    split = load_for_job(_csv(tmp_path / "d.csv", rows), CSV_SCHEMA)
    assert split.y_train.dtype == np.float64 and split.num_classes == 0
    assert (len(split.y_train), len(split.y_test)) == (6, 2)
    x = np.concatenate([split.x_train, split.x_test])
    y = np.concatenate([split.y_train, split.y_test])
    row = np.rint(x[:, 0] * 20 + 60 - 40).astype(int)   # age back to the row it came from
    assert np.array_equal(y, 1.5 * row - 2) and np.array_equal(x[:, 1], (row % 2 == 0).astype(np.float32))


def test_csv_bad_target_cells_are_declined_naming_rows_and_column_not_values(tmp_path):
    rows = [f"{i},{40 + i},a,{v}" for i, v in enumerate(["1.5", "", "n/a", "inf", "2", "3"])]
    with pytest.raises(DataError) as err:
        load_for_job(_csv(tmp_path / "d.csv", rows), CSV_SCHEMA)
    assert err.value.remote == ("dataset 'd': 3 bad cell(s) in the dataset file: column 'los': 1 cell(s) is empty "
                                "(data rows 2); column 'los': 2 cell(s) is not a finite number (the numeric target) "
                                "(data rows 3, 4)")
    assert "'n/a'" in str(err.value) and "n/a" not in err.value.remote


def test_a_csv_numeric_job_without_a_schema_is_declined_saying_what_to_declare(tmp_path):
    with pytest.raises(DataError) as err:
        load_for_job(_csv(tmp_path / "d.csv", ["0,40,a,1"]), NUMERIC)
    assert "add data.label (column, and classes for a class target) and data.features" in err.value.remote


# plexus site check ---------------------------------------------------------------------------------------------
def test_site_check_shows_an_npz_of_float_labels_as_numeric_targets_advertised_at_join(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", x=np.zeros((12, 2)), y=np.linspace(0, 1, 12))
    (tmp_path / "site.yaml").write_text("site: s\ncoordinator: 'c.example.org:8443'\nkit: kit\n"
                                        "datasets:\n  d: {kind: npz, path: d.npz, test_fraction: 0.25}\n")
    code = cli(["site", "check", "--config", str(tmp_path / "site.yaml")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "  9 training rows, 3 test rows, numeric targets, input shape (2,)\n  advertised at Join with 9" in out


def test_site_check_prints_a_numeric_jobs_targets(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", x=np.zeros((12, 2)), y=np.arange(12.0))
    (tmp_path / "site.yaml").write_text("site: s\ncoordinator: 'c.example.org:8443'\nkit: kit\n"
                                        "datasets:\n  d: {kind: npz, path: d.npz, test_fraction: 0.25}\n")
    (tmp_path / "job.yaml").write_text(_job())
    code = cli(["site", "check", "--config", str(tmp_path / "site.yaml"), "--job", str(tmp_path / "job.yaml")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "  this site accepts the job: 9 training rows, 3 test rows, model input shape (2,), numeric target\n" in out
    y = load_for_job(DatasetSpec(kind="npz", path=tmp_path / "d.npz", test_fraction=0.25), NUMERIC).y_train
    assert (f"  training targets: mean {y.mean():.6g}, std {y.std():.6g}, from {y.min():.6g} to {y.max():.6g}\n"
            in out + "\n")
