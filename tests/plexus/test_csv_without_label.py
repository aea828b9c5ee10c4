"""A CSV dataset entry without `label`: valid, read whole by statistics jobs, advertised with all its rows, and
declined by training jobs with the fix (add `label: COLUMN`) as the reason."""

from __future__ import annotations

import pytest

from plexus import statistics as stats
from plexus.config import DatasetSpec, DataSpec, FeatureSpec, LabelSpec, load_site_config
from plexus.datasets import DataError, csv_train_rows, load_for_job, train_rows

CSV = "age,sex,ward\n34,F,a\n51,M,a\n47,,b\n,M,b\n62,F,a\n"

SCHEMA = DataSpec(dataset="wards", label=LabelSpec(column="ward", classes=("a", "b")),
                  features=(FeatureSpec(name="age", impute="50"), FeatureSpec(name="sex", categories=("F", "M"),
                                                                                impute="F")))


@pytest.fixture
def spec(tmp_path) -> DatasetSpec:
    (tmp_path / "wards.csv").write_text(CSV)
    (tmp_path / "site.yaml").write_text("site: s\ncoordinator: 'c.example.org:8443'\nkit: kit\n"
                                        "datasets:\n  wards: {kind: csv, path: wards.csv}\n")
    return load_site_config(tmp_path / "site.yaml").datasets["wards"]


def test_a_csv_entry_without_label_is_valid(spec, tmp_path):
    assert spec == DatasetSpec(kind="csv", path=tmp_path / "wards.csv")


def test_statistics_read_every_row_and_column(spec):
    table = stats.read_table(spec)
    assert list(table) == ["age", "sex", "ward"]
    assert table["age"].tolist() == ["34", "51", "47", "", "62"]


def test_join_advertises_all_rows(spec):
    # No label, no train/test split: the statistics jobs it serves read every row.
    assert train_rows(spec) == csv_train_rows(spec) == 5


@pytest.mark.parametrize("data", [SCHEMA, DataSpec(dataset="wards"), DataSpec(dataset="wards", target="numeric")],
                         ids=["schema", "no schema", "numeric"])
def test_a_training_job_is_declined_with_the_fix(spec, data):
    with pytest.raises(DataError) as err:
        load_for_job(spec, data)
    assert err.value.remote == ("dataset 'wards': it serves statistics jobs only at this site: its entry in "
                                "site.yaml names no label column; to train on it, the site adds `label: COLUMN` "
                                "to the dataset in site.yaml")
    assert "serves statistics jobs only; add `label: COLUMN` to it to train on it" in str(err.value)


def test_with_a_label_the_same_file_trains(spec):
    split = load_for_job(DatasetSpec(kind="csv", path=spec.path, label="ward"), SCHEMA)
    assert len(split.y_train) + len(split.y_test) == 5
