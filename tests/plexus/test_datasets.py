import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexus.datasets import HEART_DISEASE_CSV, HOSPITALS, KINDS, Split, heart_disease, load_dataset, stratified_split
from plexus.errors import ConfigError, IntegrityError


@dataclasses.dataclass(frozen=True)
class Spec:
    kind: str
    path: Path | None = None
    label: str | None = None
    hospital: str | None = None
    features: tuple[str, ...] | None = None
    test_fraction: float = 0.34
    split_seed: int = 43


# Rows after FLamby's preprocessing (train, test); FLamby reports 303/261/46/130.
HEART_COUNTS = {"cleveland": (199, 104), "hungary": (172, 89), "switzerland": (30, 16), "va": (85, 45)}


@pytest.mark.parametrize("hospital", HOSPITALS)
def test_heart_disease_counts_features_and_labels(hospital):
    split = heart_disease(hospital)
    assert (len(split.y_train), len(split.y_test)) == HEART_COUNTS[hospital]
    assert split.x_train.shape[1:] == split.x_test.shape[1:] == (13,)
    assert len(split.feature_names) == 13
    assert split.x_train.dtype == np.float32 and split.x_train.flags.c_contiguous
    assert split.y_train.dtype == np.int64
    assert set(np.unique(np.concatenate([split.y_train, split.y_test]))) <= {0, 1}
    assert split.num_classes == 2
    assert np.isfinite(split.x_train).all()
    # Fixed scaling keeps every feature within a small range at every site.
    assert np.abs(split.x_train).max() <= 1.1


def test_heart_disease_total_matches_flamby():
    assert sum(a + b for a, b in HEART_COUNTS.values()) == 303 + 261 + 46 + 130


def test_heart_disease_row_is_encoded_as_flamby_does():
    # CSV id 1: 63, Male, typical angina, 145, 233, TRUE, lv hypertrophy, 150, FALSE, 2.3, num 0
    split = heart_disease("cleveland")
    x = np.concatenate([split.x_train, split.x_test])
    y = np.concatenate([split.y_train, split.y_test])
    (row,) = np.flatnonzero(np.isclose(x[:, 0], 0.63) & np.isclose(x[:, 6], 233 / 600))
    expected = [0.63, 1, 0, 0, 0, 145 / 200, 233 / 600, 1, 0, 1, 150 / 220, 0, 2.3 / 6]
    assert np.allclose(x[row], expected, atol=1e-6)
    assert y[row] == 0


def test_heart_disease_split_is_deterministic_and_seeded():
    a, b = heart_disease("hungary"), heart_disease("hungary")
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    c = heart_disease("hungary", seed=7)
    assert not np.array_equal(a.x_train, c.x_train)


def test_heart_disease_split_is_stratified():
    split = heart_disease("cleveland")
    assert abs(split.y_train.mean() - split.y_test.mean()) < 0.02


def test_different_hospitals_differ():
    a, b = heart_disease("cleveland"), heart_disease("va")
    assert a.y_train.mean() != b.y_train.mean()
    assert not np.array_equal(a.x_train[:10], b.x_train[:10])


def test_unknown_hospital_lists_hospitals():
    with pytest.raises(ConfigError, match="cleveland.*hungary.*switzerland.*va"):
        heart_disease("boston")


def test_heart_disease_through_load_dataset():
    split = load_dataset(Spec(kind="heart-disease", hospital="switzerland"))
    assert (len(split.y_train), len(split.y_test)) == HEART_COUNTS["switzerland"]
    with pytest.raises(ConfigError, match="hospital"):
        load_dataset(Spec(kind="heart-disease"))


def test_heart_disease_from_explicit_path(tmp_path):
    copy = tmp_path / "heart.csv"
    shutil.copy(HEART_DISEASE_CSV, copy)
    assert np.array_equal(heart_disease("va", path=copy).x_test, heart_disease("va").x_test)


def test_unknown_kind_lists_kinds():
    with pytest.raises(ConfigError) as err:
        load_dataset(Spec(kind="parquet"))
    assert str(sorted(KINDS)) in str(err.value)


# stratified_split


def test_stratified_split_is_disjoint_complete_and_deterministic():
    y = np.array([0] * 25 + [1] * 15 + [2] * 10)
    train, test = stratified_split(y, 0.34, seed=1)
    assert len(test) == 17  # ceil(0.34 * 50)
    assert np.intersect1d(train, test).size == 0
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(50))
    # quotas 8.5, 5.1, 3.4: floors 8, 5, 3 and the spare row to the largest remainder
    assert [int((y[test] == c).sum()) for c in range(3)] == [9, 5, 3]
    again = stratified_split(y, 0.34, seed=1)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    assert not np.array_equal(test, stratified_split(y, 0.34, seed=2)[1])


def test_stratified_split_avoids_float_rounding_up():
    train, test = stratified_split(np.zeros(50, dtype=np.int64), 0.34, seed=0)
    assert len(test) == 17  # 0.34 * 50 is 17.000000000000004 in floating point


@settings(max_examples=50, deadline=None)
@given(
    labels=st.lists(st.integers(0, 3), min_size=2, max_size=80),
    fraction=st.floats(0.05, 0.95),
    seed=st.integers(0, 2**32 - 1),
)
def test_stratified_split_properties(labels, fraction, seed):
    y = np.array(labels)
    try:
        train, test = stratified_split(y, fraction, seed)
    except ValueError:
        return  # too few samples for this fraction
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(len(y)))
    for c in np.unique(y):
        share = (y == c).sum() * len(test) / len(y)
        assert abs((y[test] == c).sum() - share) < 1 + 1e-9


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_stratified_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        stratified_split(np.array([0, 1, 0, 1]), fraction, seed=0)


def test_stratified_split_needs_two_samples():
    with pytest.raises(ValueError, match="non-empty"):
        stratified_split(np.array([1]), 0.5, seed=0)


# csv


def _write(path, text):
    path.write_text(text)
    return path


def _csv_spec(path, **kw):
    return Spec(kind="csv", path=path, label=kw.pop("label", "target"), **kw)


def test_csv_happy_path(tmp_path):
    lines = ["a,b,target"] + [f"{i},{i * 0.5},{'yes' if i % 2 else 'no'}" for i in range(20)]
    path = _write(tmp_path / "d.csv", "\n".join(lines) + "\n")
    split = load_dataset(_csv_spec(path, test_fraction=0.25, split_seed=3))
    assert isinstance(split, Split)
    assert split.feature_names == ("a", "b")
    assert split.num_classes == 2
    assert (len(split.y_train), len(split.y_test)) == (15, 5)
    x = np.concatenate([split.x_train, split.x_test])
    y = np.concatenate([split.y_train, split.y_test])
    # "no" < "yes": odd rows (yes) get label 1
    assert np.array_equal(y, (x[:, 0] % 2).astype(np.int64))
    assert np.allclose(x[:, 1], x[:, 0] * 0.5)


def test_csv_selected_features_and_integer_labels_kept(tmp_path):
    lines = ["id,a,b,target"] + [f"{i},{i},{-i},{2 * (i % 2)}" for i in range(10)]
    path = _write(tmp_path / "d.csv", "\n".join(lines))
    split = load_dataset(_csv_spec(path, features=("b", "a")))
    assert split.feature_names == ("b", "a")
    # labels {0, 2} stay as they are: another site may hold class 1
    assert set(np.concatenate([split.y_train, split.y_test])) == {0, 2}
    assert split.num_classes == 3
    assert np.array_equal(split.x_train[:, 0], -split.x_train[:, 1])


def test_csv_numeric_string_labels_sorted_numerically(tmp_path):
    lines = ["a,target"] + [f"{i},{v}" for i, v in enumerate(["-1", "10", "2", "-1", "10", "2"])]
    split = load_dataset(_csv_spec(_write(tmp_path / "d.csv", "\n".join(lines)), test_fraction=0.5))
    x = np.concatenate([split.x_train, split.x_test])[:, 0]
    y = np.concatenate([split.y_train, split.y_test])
    assert dict(zip(x.tolist(), y.tolist())) == {0: 0, 1: 2, 2: 1, 3: 0, 4: 2, 5: 1}


def test_csv_missing_label_column_lists_columns(tmp_path):
    path = _write(tmp_path / "d.csv", "a,b\n1,2\n3,4\n")
    with pytest.raises(ConfigError, match=r"'target'.*\['a', 'b'\]"):
        load_dataset(_csv_spec(path))


def test_csv_non_numeric_feature_names_column_row_and_value(tmp_path):
    path = _write(tmp_path / "d.csv", "a,b,target\n1,2,0\n3,oops,1\n")
    with pytest.raises(IntegrityError, match=r"row 2.*'b'.*'oops'"):
        load_dataset(_csv_spec(path))


def test_csv_empty_feature_value_is_rejected(tmp_path):
    path = _write(tmp_path / "d.csv", "a,target\n1,0\n,1\n")
    with pytest.raises(IntegrityError, match=r"row 2.*'a'.*''"):
        load_dataset(_csv_spec(path))


def test_csv_unknown_feature_column(tmp_path):
    path = _write(tmp_path / "d.csv", "a,target\n1,0\n2,1\n")
    with pytest.raises(ConfigError, match="'zzz'"):
        load_dataset(_csv_spec(path, features=("zzz",)))


def test_csv_label_listed_as_feature(tmp_path):
    path = _write(tmp_path / "d.csv", "a,target\n1,0\n2,1\n")
    with pytest.raises(ConfigError, match="also listed"):
        load_dataset(_csv_spec(path, features=("a", "target")))


def test_csv_ragged_row(tmp_path):
    path = _write(tmp_path / "d.csv", "a,target\n1,0\n2,1,9\n")
    with pytest.raises(IntegrityError, match="row 2 has 3 fields"):
        load_dataset(_csv_spec(path))


def test_csv_empty_label(tmp_path):
    path = _write(tmp_path / "d.csv", "a,target\n1,0\n2,\n")
    with pytest.raises(IntegrityError, match="row 2.*empty"):
        load_dataset(_csv_spec(path))


def test_csv_header_only_and_empty_file(tmp_path):
    with pytest.raises(IntegrityError, match="no data rows"):
        load_dataset(_csv_spec(_write(tmp_path / "h.csv", "a,target\n")))
    with pytest.raises(IntegrityError, match="empty"):
        load_dataset(_csv_spec(_write(tmp_path / "e.csv", "")))


def test_csv_needs_label_and_existing_path(tmp_path):
    with pytest.raises(ConfigError, match="label"):
        load_dataset(Spec(kind="csv", path=_write(tmp_path / "d.csv", "a\n1\n")))
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset(_csv_spec(tmp_path / "missing.csv"))
    with pytest.raises(ConfigError, match="path"):
        load_dataset(Spec(kind="csv", label="target"))


# npz


def test_npz_with_explicit_split(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, x_train=rng.normal(size=(8, 1, 4, 4)), y_train=np.arange(8) % 3,
             x_test=rng.normal(size=(3, 1, 4, 4)), y_test=np.array([0, 1, 4], dtype=np.int32))
    split = load_dataset(Spec(kind="npz", path=path))
    assert split.x_train.shape == (8, 1, 4, 4) and split.x_train.dtype == np.float32
    assert split.x_train.flags.c_contiguous
    assert split.y_test.dtype == np.int64
    assert split.num_classes == 5
    assert split.feature_names == ()


def test_npz_with_x_y_is_split(tmp_path):
    path = tmp_path / "d.npz"
    x = np.arange(40, dtype=np.float64).reshape(20, 2)
    np.savez(path, x=x, y=np.arange(20) % 2)
    split = load_dataset(Spec(kind="npz", path=path, test_fraction=0.5, split_seed=1))
    assert (len(split.y_train), len(split.y_test)) == (10, 10)
    assert split.feature_names == ("x0", "x1")
    assert sorted(np.concatenate([split.x_train, split.x_test])[:, 0].tolist()) == list(range(0, 40, 2))


def test_npz_object_dtype_is_refused(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.array([[1.0], [2.0]]), y=np.array([0, 1], dtype=object))
    with pytest.raises(IntegrityError, match="object dtype"):
        load_dataset(Spec(kind="npz", path=path))


def test_npz_pickle_file_is_refused(tmp_path):
    import pickle

    path = tmp_path / "d.npz"
    path.write_bytes(pickle.dumps({"x": [[1.0]], "y": [0]}))
    with pytest.raises(IntegrityError, match="not a readable .npz"):
        load_dataset(Spec(kind="npz", path=path))


def test_npz_missing_arrays_are_named(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.zeros((2, 2)), y_train=np.zeros(2, dtype=np.int64))
    with pytest.raises(IntegrityError, match=r"x_train, y_train, x_test, y_test or x, y.*\['x_train', 'y_train'\]"):
        load_dataset(Spec(kind="npz", path=path))


def test_npz_float_labels_and_shape_mismatch_refused(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(IntegrityError, match="labels must be integers"):
        load_dataset(Spec(kind="npz", path=path))
    np.savez(path, x=np.zeros((4, 2)), y=np.zeros(3, dtype=np.int64))
    with pytest.raises(IntegrityError, match="shape"):
        load_dataset(Spec(kind="npz", path=path))


def test_misattributed_hungarian_patient_is_moved_back():
    # CSV id 304 (aged 28) is labelled Cleveland but is the first row of UCI's Hungarian file.
    def ages(hospital):
        split = heart_disease(hospital)
        return np.round(np.concatenate([split.x_train, split.x_test])[:, 0] * 100).astype(int)

    assert 28 not in ages("cleveland")
    assert 28 in ages("hungary")
