"""Virtual sites from one dataset: what each partition gives, that it is seeded, that every site's data loads,
and the errors for what cannot be partitioned."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from plexus.config import SITE_NAME, DatasetSpec, DataSpec, FeatureSpec, LabelSpec
from plexus.datasets import (
    FASHION_MNIST_DIR,
    HEART_DISEASE_CSV,
    HOSPITALS,
    dirichlet_partition,
    fashion_mnist,
    load_dataset,
    load_for_job,
    read_table,
)
from plexus.errors import ConfigError
from simulation.partition import Partition, parse_partition, virtual_sites

needs_fashion = pytest.mark.skipif(
    not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist is not installed",
)

HEART = f"csv:{HEART_DISEASE_CSV}"
HEART_ID = "csv:heart"   # HEART in parameters, so that test ids hold no absolute path
# The job's schema for the UCI heart-disease CSV: what a job training on its csv sites would declare.
HEART_SCHEMA = DataSpec(
    dataset="heart",
    label=LabelSpec(column="num", classes=("0", "1", "2", "3", "4")),
    features=(FeatureSpec(name="age", center=50.0, scale=10.0),
              FeatureSpec(name="sex", categories=("Female", "Male")),
              FeatureSpec(name="cp", categories=("typical angina", "atypical angina", "non-anginal", "asymptomatic"))))


def _heart(tmp_path: Path, partition: str, sites: int | None = None, *, seed: int = 0, out: str = "out",
           label: str = "num") -> dict[str, DatasetSpec]:
    found = virtual_sites(HEART, dataset="heart", out_dir=tmp_path / out, partition=parse_partition(partition),
                          sites=sites, label=label, seed=seed)
    return {name: datasets["heart"] for name, datasets in found.items()}


def _rows(spec: DatasetSpec) -> list[tuple[str, ...]]:
    return [tuple(row) for row in read_table(spec.path).rows]


def _skew(label_sets: list[np.ndarray], classes: int) -> float:
    """Mean total-variation distance between each site's label distribution and the pooled one."""
    pooled = np.bincount(np.concatenate(label_sets), minlength=classes) / sum(len(y) for y in label_sets)
    return float(np.mean([0.5 * np.abs(np.bincount(y, minlength=classes) / len(y) - pooled).sum()
                          for y in label_sets]))


def _write_csv(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --partition ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("iid", Partition("iid")),
    ("dirichlet:0.3", Partition("dirichlet", alpha=0.3)),
    ("dirichlet:5", Partition("dirichlet", alpha=5.0)),
    ("by-column:dataset", Partition("by-column", column="dataset")),
    (" by-column: hospital name ", Partition("by-column", column="hospital name")),
])
def test_partition_text_parses(text, expected):
    assert parse_partition(text) == expected


@pytest.mark.parametrize("text, problem", [
    ("shards:3", "unknown partition 'shards:3'"),
    ("", "unknown partition ''"),
    ("IID", "unknown partition 'IID'"),
    ("iid:2", "iid takes no argument"),
    ("dirichlet", "dirichlet needs an alpha"),
    ("dirichlet:", "dirichlet needs an alpha"),
    ("dirichlet:0", "dirichlet needs an alpha, a finite number > 0"),
    ("dirichlet:-1", "dirichlet needs an alpha, a finite number > 0"),
    ("dirichlet:nan", "dirichlet needs an alpha, a finite number > 0"),
    ("dirichlet:inf", "dirichlet needs an alpha, a finite number > 0"),
    ("dirichlet:lots", "dirichlet needs an alpha, a finite number > 0"),
    ("by-column", "by-column needs a column name"),
    ("by-column:  ", "by-column needs a column name"),
])
def test_bad_partition_text_says_what_is_wrong(text, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)) as caught:
        parse_partition(text)
    if "iid takes" not in problem:
        assert "dirichlet:ALPHA" in str(caught.value) and "by-column:COLUMN" in str(caught.value)


@pytest.mark.parametrize("kwargs, problem", [
    ({"kind": "shards"}, "unknown partition kind 'shards'"),
    ({"kind": "dirichlet"}, "dirichlet needs one"),
    ({"kind": "iid", "alpha": 1.0}, "alpha goes with dirichlet"),
    ({"kind": "dirichlet", "alpha": 0.0}, "alpha must be a finite number > 0"),
    ({"kind": "by-column"}, "by-column needs one"),
    ({"kind": "iid", "column": "x"}, "column goes with by-column"),
])
def test_a_partition_built_in_code_is_checked_too(kwargs, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        Partition(**kwargs)


# heart-disease ----------------------------------------------------------------------------------------------


def test_heart_disease_is_its_four_hospitals(tmp_path):
    found = virtual_sites("heart-disease", dataset="heart", out_dir=tmp_path / "out")
    assert found == {h: {"heart": DatasetSpec(kind="heart-disease", hospital=h)} for h in HOSPITALS}
    # FLamby's complete rows per hospital.
    rows = {h: len(load_dataset(s["heart"]).y_train) + len(load_dataset(s["heart"]).y_test) for h, s in found.items()}
    assert rows == {"cleveland": 303, "hungary": 261, "switzerland": 46, "va": 130}
    assert not (tmp_path / "out").exists()   # nothing to write


@pytest.mark.parametrize("kwargs", [{"partition": Partition("iid")}, {"sites": 4},
                                    {"partition": Partition("dirichlet", alpha=1.0), "sites": 4}])
def test_heart_disease_takes_no_partition_or_sites(tmp_path, kwargs):
    with pytest.raises(ConfigError, match=re.escape("heart-disease is partitioned by its hospitals; "
                                                    "leave out --partition and --sites")):
        virtual_sites("heart-disease", dataset="heart", out_dir=tmp_path, **kwargs)


# csv:PATH ---------------------------------------------------------------------------------------------------


def test_csv_iid_shares_are_near_equal_disjoint_and_cover_every_row(tmp_path):
    specs = _heart(tmp_path, "iid", 7)
    assert list(specs) == [f"site-00{i}" for i in range(7)]
    source = read_table(HEART_DISEASE_CSV)
    shares = {name: _rows(spec) for name, spec in specs.items()}
    assert {len(rows) for rows in shares.values()} == {131, 132}   # 920 rows over 7 sites
    pooled = [row for rows in shares.values() for row in rows]
    assert sorted(pooled) == sorted(tuple(row) for row in source.rows)
    assert len({row[0] for row in pooled}) == len(source.rows)      # ids are unique: no row twice
    for name, spec in specs.items():
        assert spec == DatasetSpec(kind="csv", path=(tmp_path / "out" / f"{name}.csv").resolve(), label="num")
        assert spec.path.is_absolute()
        assert read_table(spec.path).header == source.header      # same columns in the same order
        split = load_for_job(spec, HEART_SCHEMA)
        assert len(split.y_train) + len(split.y_test) == len(shares[name])
        assert split.x_train.shape[1] == 7


def test_csv_iid_keeps_each_sites_rows_in_file_order(tmp_path):
    ids = [int(row[0]) for row in _rows(_heart(tmp_path, "iid", 3)["site-001"])]
    assert ids == sorted(ids)


def test_csv_dirichlet_skews_the_labels_more_than_iid(tmp_path):
    def labels(specs):
        return [np.asarray([int(row[-1]) for row in _rows(spec)]) for spec in specs.values()]

    skewed = _heart(tmp_path, "dirichlet:0.3", 5, out="dirichlet")
    even = _heart(tmp_path, "iid", 5, out="iid")
    assert sum(len(y) for y in labels(skewed)) == 920
    assert _skew(labels(skewed), 5) > 0.25 > 0.05 > _skew(labels(even), 5)
    for spec in skewed.values():
        split = load_for_job(spec, HEART_SCHEMA)
        assert len(split.y_train) + len(split.y_test) == len(_rows(spec))


def test_csv_dirichlet_is_the_label_skew_partition_of_the_label_column(tmp_path):
    specs = _heart(tmp_path, "dirichlet:0.5", 4, seed=9)
    source = read_table(HEART_DISEASE_CSV)
    labels = np.asarray([int(row[-1]) for row in source.rows])
    expected = dirichlet_partition(labels, 4, 0.5, 9)
    assert [_rows(spec) for spec in specs.values()] == [[tuple(source.rows[i]) for i in part] for part in expected]


@pytest.mark.parametrize("partition", ["iid", "dirichlet:0.5"])
def test_csv_same_seed_same_bytes_other_seed_other_rows(tmp_path, partition):
    first = _heart(tmp_path, partition, 6, seed=3, out="first")
    again = _heart(tmp_path, partition, 6, seed=3, out="again")
    other = _heart(tmp_path, partition, 6, seed=4, out="other")
    assert [s.path.read_bytes() for s in first.values()] == [s.path.read_bytes() for s in again.values()]
    assert [_rows(s) for s in first.values()] != [_rows(s) for s in other.values()]


def test_csv_by_column_gives_one_site_per_value_with_only_its_rows(tmp_path):
    specs = _heart(tmp_path, "by-column:dataset")
    assert list(specs) == ["cleveland", "hungary", "switzerland", "va-long-beach"]
    at = read_table(HEART_DISEASE_CSV).columns["dataset"]
    values = {name: {row[at] for row in _rows(spec)} for name, spec in specs.items()}
    assert values == {"cleveland": {"Cleveland"}, "hungary": {"Hungary"}, "switzerland": {"Switzerland"},
                      "va-long-beach": {"VA Long Beach"}}
    assert {name: len(_rows(spec)) for name, spec in specs.items()} == {
        "cleveland": 304, "hungary": 293, "switzerland": 123, "va-long-beach": 200}
    assert read_table(specs["hungary"].path).header == read_table(HEART_DISEASE_CSV).header   # the column stays
    for spec in specs.values():
        split = load_for_job(spec, HEART_SCHEMA)
        assert len(split.y_train) + len(split.y_test) == len(_rows(spec))
    assert list(_heart(tmp_path, "by-column:dataset", 4, out="four")) == list(specs)   # --sites may say how many


def test_csv_by_column_names_odd_values_as_distinct_valid_site_names(tmp_path):
    values = ["Zürich", "zurich", "", "A/B", "--x--", "w" * 70, "W" * 70]
    path = _write_csv(tmp_path / "odd.csv", "city,x,y\n" + "".join(f'"{v}",{i},{i % 2}\n{v},{i},{1 - i % 2}\n'
                                                                    for i, v in enumerate(values)))
    found = virtual_sites(f"csv:{path}", dataset="d", out_dir=tmp_path / "out", partition=Partition(
        "by-column", column="city"), label="y")
    names = list(found)
    assert len(names) == len(set(names)) == len(values)
    assert all(re.fullmatch(SITE_NAME, name) for name in names)
    assert {"zurich", "zurich-2", "empty", "a-b", "x", "w" * 63, "w" * 61 + "-2"} == set(names)
    held = {tuple({row[0] for row in _rows(spec["d"])}) for spec in found.values()}
    assert held == {(v,) for v in values}
    schema = DataSpec(dataset="d", label=LabelSpec(column="y", classes=("0", "1")), features=(FeatureSpec(name="x"),))
    for spec in found.values():
        split = load_for_job(spec["d"], schema)
        assert len(split.y_train) + len(split.y_test) == 2


def _wide(tmp_path: Path, rows: int) -> Path:
    return _write_csv(tmp_path / "wide.csv", "x,z,y\n" + "".join(f"{i},{i % 7},{'abc'[i % 3]}\n" for i in range(rows)))


def test_csv_a_thousand_sites_named_with_as_many_digits_as_needed(tmp_path):
    path = _wide(tmp_path, 2100)
    found = virtual_sites(f"csv:{path}", dataset="d", out_dir=tmp_path / "k", partition=Partition("iid"),
                          sites=1000, label="y")
    assert list(found) == [f"site-{i:03d}" for i in range(1000)]
    more = virtual_sites(f"csv:{path}", dataset="d", out_dir=tmp_path / "k1", partition=Partition("iid"),
                         sites=1001, label="y")
    assert list(more)[0] == "site-0000" and list(more)[-1] == "site-1000"
    assert sum(len(_rows(s["d"])) for s in found.values()) == 2100
    split = load_dataset(found["site-999"]["d"])
    assert len(split.y_train) + len(split.y_test) == 2


# fashion-mnist ----------------------------------------------------------------------------------------------


@needs_fashion
def test_fashion_mnist_dirichlet_is_the_fashion_mnist_kinds_own_split(tmp_path):
    found = virtual_sites("fashion-mnist", dataset="fm", out_dir=tmp_path, partition=parse_partition("dirichlet:0.3"),
                          sites=4, seed=7)
    assert found == {f"site-00{i}": {"fm": DatasetSpec(kind="fashion-mnist", sites=4, index=i, alpha=0.3,
                                                       split_seed=7)} for i in range(4)}
    labels = fashion_mnist(sites=1, index=0, alpha=1.0).y_train
    parts = dirichlet_partition(labels, 4, 0.3, 7)
    shares = [load_dataset(s["fm"]).y_train for s in found.values()]
    assert [y.tolist() for y in shares] == [labels[p].tolist() for p in parts]
    assert np.array_equal(np.bincount(np.concatenate(shares)), np.bincount(labels))
    other = virtual_sites("fashion-mnist", dataset="fm", out_dir=tmp_path, partition=parse_partition("dirichlet:0.3"),
                          sites=4, seed=8)
    assert not np.array_equal(load_dataset(other["site-000"]["fm"]).y_train, shares[0])


@needs_fashion
def test_fashion_mnist_iid_sites_share_the_images_and_the_test_set(tmp_path):
    found = virtual_sites("fashion-mnist", dataset="fm", out_dir=tmp_path / "a", partition=Partition("iid"),
                          sites=6, seed=0)
    assert list(found) == [f"site-00{i}" for i in range(6)]
    assert all(s["fm"] == DatasetSpec(kind="npz", path=(tmp_path / "a" / f"{n}.npz").resolve())
               for n, s in found.items())
    whole = fashion_mnist(sites=1, index=0, alpha=1.0)
    splits = [load_dataset(s["fm"]) for s in found.values()]
    assert [len(s.y_train) for s in splits] == [10_000] * 6
    # The images are the training set's, scaled as the fashion-mnist kind scales them, each exactly once.
    assert all(s.x_train.dtype == np.float32 and s.x_train.shape[1:] == (1, 28, 28) for s in splits)
    assert _image_multiset(np.concatenate([s.x_train for s in splits])) == _image_multiset(whole.x_train)
    assert np.array_equal(np.bincount(np.concatenate([s.y_train for s in splits])), np.bincount(whole.y_train))
    # Test rows: a share of t10k each, covering it once, as balanced as t10k (1000 a class).
    assert [len(s.y_test) for s in splits] == [1667] * 4 + [1666] * 2
    assert all(np.bincount(s.y_test, minlength=10).max() - np.bincount(s.y_test, minlength=10).min() <= 1
               for s in splits)
    assert _image_multiset(np.concatenate([s.x_test for s in splits])) == _image_multiset(whole.x_test)
    # Near the pooled label mix, unlike a dirichlet split.
    assert _skew([s.y_train for s in splits], 10) < 0.02


@needs_fashion
def test_fashion_mnist_iid_same_seed_same_bytes_other_seed_other_rows(tmp_path):
    def files(seed, out):
        found = virtual_sites("fashion-mnist", dataset="fm", out_dir=tmp_path / out, partition=Partition("iid"),
                              sites=3, seed=seed)
        return [s["fm"].path.read_bytes() for s in found.values()]

    first = files(0, "first")
    assert files(0, "again") == first
    other = files(1, "other")
    assert [len(b) for b in other] == [len(b) for b in first] and other != first


def _image_multiset(images: np.ndarray) -> list[bytes]:
    """A digest per image, sorted: equal for the same float32 images in any order."""
    return sorted(hashlib.blake2b(image.tobytes(), digest_size=16).digest() for image in images)


# errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, kwargs, problem", [
    ("mnist", {}, "unknown data 'mnist'; accepted forms: heart-disease, fashion-mnist, csv:PATH"),
    ("csv:", {}, "unknown data 'csv:'"),
    ("heart-disease", {"label": "num"}, "leave out --label"),
    ("fashion-mnist", {"sites": 3}, "fashion-mnist needs --partition: iid; dirichlet:ALPHA"),
    ("fashion-mnist", {"partition": Partition("iid")}, "needs --sites"),
    ("fashion-mnist", {"partition": Partition("by-column", column="x"), "sites": 3},
     "fashion-mnist images have no columns"),
    ("fashion-mnist", {"partition": Partition("iid"), "sites": 3, "label": "y"}, "leave out --label"),
    (HEART_ID, {"sites": 3}, "needs --partition: iid; dirichlet:ALPHA"),
    (HEART_ID, {"partition": Partition("iid")}, "needs --sites"),
    (HEART_ID, {"partition": Partition("iid"), "sites": 3, "label": None}, "needs --label"),
    (HEART_ID, {"partition": Partition("iid"), "sites": 3, "label": "outcome"},
     "label column 'outcome' is not in"),
    (HEART_ID, {"partition": Partition("by-column", column="num")}, "would split by the label column"),
    (HEART_ID, {"partition": Partition("by-column", column="hospital")}, "column 'hospital' is not in"),
    (HEART_ID, {"partition": Partition("by-column", column="dataset"), "sites": 3},
     "column 'dataset' has 4 distinct values"),
    (HEART_ID, {"partition": Partition("by-column", column="id")}, "would get 1 row(s)"),
    (HEART_ID, {"partition": Partition("dirichlet", alpha=0.3), "sites": 4, "label": "chol"},
     "dirichlet needs a categorical label: column 'chol'"),
    (HEART_ID, {"partition": Partition("iid"), "sites": 461},
     "site site-459 would get 1 row(s) of the 920 in"),
    (HEART_ID, {"partition": Partition("dirichlet", alpha=0.5), "sites": 60},
     "site site-040 would get 1 row(s) of the 920 in"),
    (HEART_ID, {"partition": Partition("dirichlet", alpha=0.05), "sites": 100}, "raise alpha"),
    (HEART_ID, {"partition": Partition("iid"), "sites": 0}, "--sites must be a whole number from 1 to 10000, got 0"),
    (HEART_ID, {"partition": Partition("iid"), "sites": 10_001}, "from 1 to 10000, got 10001"),
    (HEART_ID, {"partition": Partition("iid"), "sites": True}, "from 1 to 10000, got True"),
    (HEART_ID, {"partition": Partition("iid"), "sites": 2.0}, "from 1 to 10000, got 2.0"),
    (HEART_ID, {"partition": Partition("iid"), "sites": 3, "seed": -1}, "seed must be a whole number >= 0"),
])
def test_what_cannot_be_partitioned_says_why(tmp_path, data, kwargs, problem):
    if data == HEART_ID:
        data, kwargs = HEART, {"label": "num", **kwargs}
    with pytest.raises(ConfigError, match=re.escape(problem)):
        virtual_sites(data, dataset="d", out_dir=tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()   # nothing written for a run that cannot start


def test_error_for_too_few_rows_says_how_to_fix_it(tmp_path):
    with pytest.raises(ConfigError) as caught:
        _heart(tmp_path, "iid", 461)
    assert "each site needs at least 2 rows" in str(caught.value) and "use fewer sites (at most 460)" in str(
        caught.value)
    with pytest.raises(ConfigError, match="use fewer sites or a larger alpha"):
        _heart(tmp_path, "dirichlet:0.5", 60)


def test_label_column_error_lists_the_columns(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("columns: ['id', 'age', 'sex', 'dataset'")):
        _heart(tmp_path, "iid", 2, label="outcome")


def test_a_missing_or_unreadable_csv_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        virtual_sites(f"csv:{tmp_path / 'nope.csv'}", dataset="d", out_dir=tmp_path / "out",
                      partition=Partition("iid"), sites=2, label="y")
    with pytest.raises(ConfigError, match="is not a file"):
        virtual_sites(f"csv:{tmp_path}", dataset="d", out_dir=tmp_path / "out", partition=Partition("iid"),
                      sites=2, label="y")
    latin = tmp_path / "latin.csv"
    latin.write_bytes("x,y\n1,Zürich\n2,Genève\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not utf-8 text"):
        virtual_sites(f"csv:{latin}", dataset="d", out_dir=tmp_path / "out", partition=Partition("iid"),
                      sites=2, label="y")
    semi = _write_csv(tmp_path / "semi.csv", "x;y\n1;a\n2;b\n")
    with pytest.raises(ConfigError, match="looks ';'-separated"):
        virtual_sites(f"csv:{semi}", dataset="d", out_dir=tmp_path / "out", partition=Partition("iid"),
                      sites=2, label="y")
