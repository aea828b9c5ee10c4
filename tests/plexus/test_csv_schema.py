"""CSV datasets read through a job's declared schema: classes, columns by name, declared preprocessing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plexus.config import DatasetSpec, DataSpec, FeatureSpec, LabelSpec, TrainSpec
from plexus.datasets import (
    BAD_CELLS_SHOWN,
    DataError,
    csv_train_rows,
    load_dataset,
    load_for_job,
    read_table,
    schema_differences,
)
from plexus.models import build_model
from site_agent.training import train_local

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "triage"

SCHEMA = DataSpec(
    dataset="triage",
    label=LabelSpec(column="outcome", classes=("home", "readmitted", "icu")),
    features=(FeatureSpec(name="age", center=60.0, scale=20.0),
              FeatureSpec(name="bmi", impute="26", center=26.0, scale=5.0),
              FeatureSpec(name="sex", categories=("F", "M")),
              FeatureSpec(name="ward", categories=("cardio", "general", "ortho"))))

ROWS = [  # age, bmi, sex, ward, outcome
    ("64", "31.2", "F", "cardio", "readmitted"), ("51", "24.8", "M", "general", "home"),
    ("77", "", "F", "cardio", "icu"), ("45", "22.1", "M", "ortho", "home"),
    ("69", "29.5", "M", "cardio", "icu"), ("58", "27.3", "F", "general", "readmitted"),
    ("39", "21.4", "F", "ortho", "home"), ("72", "28.0", "M", "general", "readmitted"),
    ("81", "26.9", "F", "cardio", "icu"), ("47", "25.5", "M", "general", "home"),
]
COLUMNS = ("age", "bmi", "sex", "ward", "outcome")


def _write(path: Path, columns, rows, *, delimiter=",", encoding="utf-8", bom=False) -> Path:
    lines = [delimiter.join(columns)] + [delimiter.join(row) for row in rows]
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + ("\n".join(lines) + "\n").encode(encoding))
    return path


def _reordered(order, rows=ROWS):
    at = [COLUMNS.index(c) for c in order]
    return order, [tuple(row[i] for i in at) for row in rows]


def _spec(path: Path, **kw) -> DatasetSpec:
    return DatasetSpec(kind="csv", path=path, label="outcome", test_fraction=0.3, split_seed=5, **kw)


def _all(split):
    return np.concatenate([split.x_train, split.x_test]), np.concatenate([split.y_train, split.y_test])


def test_a_site_missing_a_class_keeps_the_declared_indices(tmp_path):
    # Before: labels were encoded per site (sorted), so "readmitted" was 2 at a site with all three
    # classes and 1 (= "icu" elsewhere) at a site without any "icu" row, with no warning.
    full = load_for_job(_spec(_write(tmp_path / "a.csv", COLUMNS, ROWS)), SCHEMA)
    no_icu = [row for row in ROWS if row[4] != "icu"]
    lacking = load_for_job(_spec(_write(tmp_path / "b.csv", COLUMNS, no_icu)), SCHEMA)
    for split, rows in ((full, ROWS), (lacking, no_icu)):
        x, y = _all(split)
        assert split.num_classes == 3
        by_age = dict(zip(np.round(x[:, 0] * 20 + 60).astype(int).tolist(), y.tolist()))
        assert by_age == {int(r[0]): SCHEMA.label.classes.index(r[4]) for r in rows}
    assert 2 not in _all(lacking)[1]


def test_a_label_value_the_job_does_not_declare_declines_without_the_value(tmp_path):
    rows = ROWS + [("50", "25.0", "M", "general", "transferred")]
    path = _write(tmp_path / "a.csv", COLUMNS, rows)
    with pytest.raises(DataError) as err:
        load_for_job(_spec(path), SCHEMA)
    assert "data row 11, column 'outcome': 'transferred' is not one of the declared classes" in str(err.value)
    assert str(path) in str(err.value)
    remote = err.value.remote
    assert remote.startswith("dataset 'triage': 1 bad cell(s) in the dataset file: column 'outcome': ")
    assert "transferred" not in remote and str(tmp_path) not in remote and "a.csv" not in remote


def test_reordered_columns_train_the_same_model_bits(tmp_path):
    # Before: without `features`, columns were taken in the file's order, so a site whose export
    # put bmi before age trained a model whose first weight meant something else, silently.
    ordered = load_for_job(_spec(_write(tmp_path / "a.csv", COLUMNS, ROWS)), SCHEMA)
    order, rows = _reordered(("outcome", "ward", "bmi", "sex", "age"))
    shuffled = load_for_job(_spec(_write(tmp_path / "b.csv", order, rows)), SCHEMA)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert np.array_equal(getattr(ordered, name), getattr(shuffled, name))
    assert ordered.feature_names == shuffled.feature_names == (
        "age", "bmi", "sex=F", "sex=M", "ward=cardio", "ward=general", "ward=ortho")

    def trained(split):
        model = build_model("logistic", {"in_features": 7, "num_classes": 3}, seed=0)
        train_local(model, split.x_train, split.y_train, TrainSpec(epochs=3, batch_size=4), seed=1)
        return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}

    assert trained(ordered) == trained(shuffled)


def test_an_undeclared_id_column_is_not_a_feature(tmp_path):
    columns = ("patient_id", *COLUMNS)
    rows = [(f"P{i}", *row) for i, row in enumerate(ROWS)]
    path = _write(tmp_path / "a.csv", columns, rows)
    split = load_for_job(_spec(path), SCHEMA)
    assert split.x_train.shape[1] == 7 and "patient_id" not in split.feature_names
    assert schema_differences(read_table(path), _spec(path), SCHEMA) == ([], ["patient_id"])


def test_a_missing_column_declines_naming_it_and_the_unused_ones(tmp_path):
    columns = ("mrn", "age", "sex", "ward", "outcome")
    rows = [("M1", *row[:1], *row[2:]) for row in ROWS]
    path = _write(tmp_path / "a.csv", columns, rows)
    with pytest.raises(DataError) as err:
        load_for_job(_spec(path), SCHEMA)
    assert err.value.remote == ("dataset 'triage': missing column(s) ['bmi']; the file's columns the job does "
                                "not declare (left unused): ['mrn']")
    assert str(path) in str(err.value)


def test_a_2_000_000_column_file_gives_a_short_error_that_still_names_the_problem(tmp_path):
    """Reported: a 2,000,000-column CSV produced a 22.9 MB error. Every list of columns is shortened, and the
    messages capped, both what the site logs and what it tells the coordinator."""
    columns = [f"c{i}" for i in range(2_000_000)] + ["age", "sex", "ward", "outcome"]   # no bmi
    row = ["0"] * 2_000_000 + ["64", "F", "cardio", "home"]
    path = _write(tmp_path / "wide.csv", columns, [row, row])
    with pytest.raises(DataError) as err:
        load_for_job(_spec(path), SCHEMA)
    local, remote = str(err.value), err.value.remote
    assert len(local.encode()) < 4096 and len(remote.encode()) < 4096, (len(local), len(remote))
    assert remote.startswith("dataset 'triage': missing column(s) ['bmi']; the file's columns the job does not "
                             "declare (left unused): ['c0', 'c1', ")
    assert "… and 1999980 more]" in remote
    assert str(path) in local and "missing column(s) ['bmi']" in local
    lacking = DatasetSpec(kind="csv", path=path, label="bmi")   # read without a job: at Join, or schema-less
    for read in (csv_train_rows, load_dataset):
        with pytest.raises(ValueError) as err:
            read(lacking)
        assert len(str(err.value).encode()) < 4096 and "label column 'bmi' is not in" in str(err.value)


def test_a_label_column_or_feature_the_site_does_not_offer_declines(tmp_path):
    path = _write(tmp_path / "a.csv", COLUMNS, ROWS)
    with pytest.raises(DataError, match="not this site's label column 'age'") as err:
        load_for_job(DatasetSpec(kind="csv", path=path, label="age"), SCHEMA)
    with pytest.raises(DataError) as err:
        load_for_job(_spec(path, features=("age", "sex", "ward")), SCHEMA)
    assert "column(s) ['bmi'] are not among the features this site offers" in err.value.remote


def test_one_hot_impute_and_scale_with_declared_constants(tmp_path):
    rows = [("70", "", "M", "ortho", "icu"), ("40", "31", "F", "", "home"), ("60", "26", "F", "cardio", "home")]
    schema = DataSpec(dataset="triage", label=SCHEMA.label, features=(
        FeatureSpec(name="age", center=60.0, scale=20.0),
        FeatureSpec(name="bmi", impute="26", center=26.0, scale=5.0),
        FeatureSpec(name="sex", categories=("F", "M")),
        FeatureSpec(name="ward", categories=("cardio", "general", "ortho"), impute="general")))
    spec = DatasetSpec(kind="csv", path=_write(tmp_path / "a.csv", COLUMNS, rows), label="outcome", test_fraction=0.34)
    x, y = _all(load_for_job(spec, schema))
    expected = {  # by hand: (age - 60) / 20, (bmi or 26 - 26) / 5, sex one-hot, ward one-hot (empty -> general)
        (0.5, 0.0, 0, 1, 0, 0, 1): 2,
        (-1.0, 1.0, 1, 0, 0, 1, 0): 0,
        (0.0, 0.0, 1, 0, 1, 0, 0): 0,
    }
    assert {tuple(row.tolist()): label for row, label in zip(x, y.tolist())} == expected
    assert x.dtype == np.float32


def test_bom_semicolons_and_latin1_read_like_a_plain_utf8_file(tmp_path):
    rows = [(*row[:3], "général" if row[3] == "general" else row[3], row[4]) for row in ROWS]
    schema = DataSpec(dataset="triage", label=SCHEMA.label, features=(
        *SCHEMA.features[:3], FeatureSpec(name="ward", categories=("cardio", "général", "ortho"))))
    plain = load_for_job(_spec(_write(tmp_path / "plain.csv", COLUMNS, rows)), schema)
    variants = [
        (_write(tmp_path / "bom.csv", COLUMNS, rows, bom=True), {}),
        (_write(tmp_path / "semi.csv", COLUMNS, rows, delimiter=";"), {"delimiter": ";"}),
        (_write(tmp_path / "latin.csv", COLUMNS, rows, encoding="latin-1"), {"encoding": "latin-1"}),
    ]
    for path, options in variants:
        split = load_for_job(_spec(path, **options), schema)
        assert np.array_equal(split.x_train, plain.x_train) and np.array_equal(split.y_train, plain.y_train), path


def test_the_wrong_encoding_or_delimiter_says_which_setting_to_change(tmp_path):
    latin = _write(tmp_path / "latin.csv", COLUMNS, [(*ROWS[0][:3], "général", "home")] + ROWS, encoding="latin-1")
    with pytest.raises(DataError, match="is not utf-8 text.*set the dataset's `encoding:`") as err:
        load_for_job(_spec(latin), SCHEMA)
    assert err.value.remote == "dataset 'triage': the dataset file is not utf-8 text; the site must set its `encoding:`"
    semi = _write(tmp_path / "semi.csv", COLUMNS, ROWS, delimiter=";")
    with pytest.raises(DataError, match="header looks ';'-separated: set the dataset's `delimiter: ';'`"):
        load_for_job(_spec(semi), SCHEMA)


def test_many_bad_cells_make_one_capped_error_naming_the_file(tmp_path):
    rows = [(f"old{i}", "", "X", "cardio", "home") for i in range(40)] + ROWS
    path = _write(tmp_path / "ward.csv", COLUMNS, rows)
    with pytest.raises(DataError) as err:
        load_for_job(_spec(path), DataSpec(dataset="triage", label=SCHEMA.label, features=(
            FeatureSpec(name="age"), FeatureSpec(name="bmi"), *SCHEMA.features[2:])))
    local = str(err.value)
    assert local.startswith(f"{path}: 121 bad cell(s):\n")
    assert local.count("\n  data row ") == BAD_CELLS_SHOWN and f"... and {121 - BAD_CELLS_SHOWN} more" in local
    assert "data row 1, column 'age': 'old0' is not a finite number" in local
    remote = err.value.remote
    assert "column 'age': 40 cell(s) is not a finite number (data rows 1, 2, 3, 4, 5, ...)" in remote
    assert "column 'bmi': 41 cell(s) is empty" in remote
    assert "column 'sex': 40 cell(s) is not one of the declared categories" in remote
    assert "old" not in remote and "'X'" not in remote and str(tmp_path) not in remote and len(remote) <= 1000


def test_a_csv_job_without_a_schema_and_a_schema_on_another_kind_are_declined(tmp_path):
    path = _write(tmp_path / "a.csv", COLUMNS, ROWS)
    with pytest.raises(DataError, match="declares no schema") as err:
        load_for_job(_spec(path), DataSpec(dataset="triage"))
    assert "add data.label" in err.value.remote and str(tmp_path) not in err.value.remote
    with pytest.raises(DataError, match="kind 'heart-disease'") as err:
        load_for_job(DatasetSpec(kind="heart-disease", hospital="va"), SCHEMA)
    assert "describe CSV datasets only" in err.value.remote
    # other kinds load as before; their errors (which name files) stay at the site
    assert load_for_job(DatasetSpec(kind="heart-disease", hospital="va"), DataSpec(dataset="h")).x_train.shape[1] == 13
    with pytest.raises(DataError) as err:
        load_for_job(DatasetSpec(kind="heart-disease", hospital="va", path=tmp_path / "gone.csv"), DataSpec("h"))
    assert str(tmp_path) in str(err.value) and str(tmp_path) not in err.value.remote
    assert err.value.remote == ("dataset 'h' cannot be loaded at this site (ConfigError); the site's log says why")


def test_the_example_sites_see_the_same_inputs_and_classes():
    for site, options in (("ward-a", {}), ("ward-b", {"delimiter": ";"})):
        split = load_for_job(_spec(EXAMPLES / f"{site}.csv", **options), SCHEMA)
        assert split.num_classes == 3 and split.x_train.shape[1] == 7
