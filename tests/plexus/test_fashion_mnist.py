import gzip
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexus.config import DatasetSpec, load_site_config
from plexus.datasets import FASHION_MNIST_DIR, dirichlet_partition, fashion_mnist, load_dataset
from plexus.errors import ConfigError, IntegrityError

needs_files = pytest.mark.skipif(
    not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist is not installed",
)

SITE = "site: cleveland\ncoordinator: coord.example.org:8443\nkit: kit\n"


def _idx(path, magic, shape, data):
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in shape)
    with gzip.open(path, "wb") as f:
        f.write(header + bytes(data))


def _fake_dir(tmp_path, n_train=40, n_test=10, *, images_magic=0x803, truncate=0):
    for part, n in (("train", n_train), ("t10k", n_test)):
        pixels = bytes(range(256)) * (n * 784 // 256 + 1)
        _idx(tmp_path / f"{part}-images-idx3-ubyte.gz", images_magic, (n, 28, 28), pixels[:n * 784 - truncate])
        _idx(tmp_path / f"{part}-labels-idx1-ubyte.gz", 0x801, (n,), [i % 10 for i in range(n)])
    return tmp_path


@needs_files
def test_real_files_load_with_shapes_dtypes_and_range():
    spec = DatasetSpec(kind="fashion-mnist", sites=8, index=3, alpha=0.3, split_seed=0)
    split = load_dataset(spec)
    assert split.x_train.dtype == np.float32 and split.x_train.shape[1:] == (1, 28, 28)
    assert split.y_train.dtype == np.int64 and len(split.y_train) == len(split.x_train) > 0
    assert split.x_test.shape == (10_000, 1, 28, 28) and split.y_test.shape == (10_000,)
    # t10k is balanced: 1000 images of each class.
    assert np.bincount(split.y_test).tolist() == [1000] * 10
    assert split.num_classes == 10
    assert 0.0 <= split.x_train.min() and split.x_train.max() <= 1.0 and split.x_train.max() > 0.99
    assert split.x_train.flags.c_contiguous


@needs_files
def test_sites_of_a_split_cover_the_training_set():
    shares = [fashion_mnist(sites=4, index=i, alpha=0.3, limit=2000) for i in range(4)]
    assert sum(len(s.y_train) for s in shares) == 2000
    # Same rows as the pure partition, so the shares are disjoint.
    labels = np.concatenate([s.y_train for s in shares])
    assert np.bincount(labels, minlength=10).sum() == 2000


@needs_files
def test_decoded_arrays_are_cached_and_read_only():
    a = fashion_mnist(sites=8, index=0, alpha=0.3, limit=1000)
    b = fashion_mnist(sites=8, index=1, alpha=0.3, limit=1000)
    assert a.x_test is b.x_test
    assert not a.x_train.flags.writeable and not a.x_test.flags.writeable


@needs_files
def test_label_skew_is_real_at_alpha_0_3():
    labels = load_dataset(DatasetSpec(kind="fashion-mnist", sites=1, index=0, alpha=1.0)).y_train
    assert len(labels) == 60_000
    parts = dirichlet_partition(labels, 8, 0.3, 0)
    max_share = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    # A uniform split would give about 0.1.
    assert np.mean(max_share) > 0.3


def test_partition_is_disjoint_covering_and_deterministic():
    labels = np.random.default_rng(1).integers(0, 10, size=5000)
    parts = dirichlet_partition(labels, 8, 0.3, 0)
    assert len(parts) == 8
    assert all(p.dtype == np.int64 and len(p) > 0 and np.all(np.diff(p) > 0) for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(5000))
    again = dirichlet_partition(labels, 8, 0.3, 0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = dirichlet_partition(labels, 8, 0.3, 1)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_large_alpha_is_close_to_uniform():
    labels = np.repeat(np.arange(10), 1000)
    parts = dirichlet_partition(labels, 4, 1000.0, 0)
    assert all(abs(len(p) - 2500) < 150 for p in parts)


@settings(max_examples=50, deadline=None)
@given(sites=st.integers(1, 12), per_site=st.integers(20, 40), alpha=st.floats(0.1, 10.0),
       seed=st.integers(0, 2**32))
def test_every_site_gets_rows(sites, per_site, alpha, seed):
    labels = np.random.default_rng(seed).integers(0, 5, size=sites * per_site)
    parts = dirichlet_partition(labels, sites, alpha, seed)
    assert all(len(p) > 0 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_a_singleton_class_can_land_at_any_site():
    # Row 1 is the only member of class 1; floor cuts would always give it to the last site.
    labels = np.array([0, 1])
    homes = {next(k for k, part in enumerate(dirichlet_partition(labels, 2, 1.0, seed)) if 1 in part)
             for seed in range(20)}
    assert homes == {0, 1}


@pytest.mark.parametrize(("args", "match"), [
    ({"sites": 0, "alpha": 1.0}, "sites must be a positive integer"),
    ({"sites": 2, "alpha": 0.0}, "alpha must be"),
    ({"sites": 2, "alpha": float("nan")}, "alpha must be"),
    ({"sites": 11, "alpha": 1.0}, "only 10 rows"),
])
def test_partition_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        dirichlet_partition(np.zeros(10, dtype=np.int64), seed=0, **args)


def test_fake_files_parse(tmp_path):
    split = fashion_mnist(sites=2, index=1, alpha=5.0, path=_fake_dir(tmp_path))
    assert split.x_test.shape == (10, 1, 28, 28)
    assert split.x_test[0, 0, 0, :3].tolist() == pytest.approx([0.0, 1 / 255, 2 / 255])
    assert split.y_test.tolist() == [i % 10 for i in range(10)]


def test_wrong_magic_number_is_an_integrity_error(tmp_path):
    with pytest.raises(IntegrityError, match="magic number is 0x00000801, expected 0x00000803"):
        fashion_mnist(sites=2, index=0, alpha=1.0, path=_fake_dir(tmp_path, images_magic=0x801))


def test_truncated_file_is_an_integrity_error(tmp_path):
    with pytest.raises(IntegrityError, match="truncated or corrupt"):
        fashion_mnist(sites=2, index=0, alpha=1.0, path=_fake_dir(tmp_path, truncate=5))


def test_not_gzip_is_an_integrity_error(tmp_path):
    _fake_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(IntegrityError, match="not a readable gzip file"):
        fashion_mnist(sites=2, index=0, alpha=1.0, path=tmp_path)


def test_image_and_label_counts_must_match(tmp_path):
    _fake_dir(tmp_path)
    _idx(tmp_path / "train-labels-idx1-ubyte.gz", 0x801, (39,), [0] * 39)
    with pytest.raises(IntegrityError, match="40 images but 39 labels"):
        fashion_mnist(sites=2, index=0, alpha=1.0, path=tmp_path)


def test_missing_folder_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="dataset-fashion-mnist"):
        fashion_mnist(sites=2, index=0, alpha=1.0, path=tmp_path / "nowhere")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sites": 2, "index": 2, "alpha": 1.0}, "index 2 is not a site of the split; use 0..1"),
    ({"sites": 8, "index": 0, "alpha": 1.0, "limit": 4}, "limit 4 leaves fewer rows than the 8 sites"),
])
def test_loader_rejects_bad_split(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        fashion_mnist(path=_fake_dir(tmp_path), **kwargs)


def test_loader_rejects_fields_of_other_kinds():
    with pytest.raises(ConfigError, match="`hospital` does not apply"):
        load_dataset(DatasetSpec(kind="fashion-mnist", sites=2, index=0, alpha=1.0, hospital="va"))
    with pytest.raises(ConfigError, match="`alpha` does not apply to a dataset of kind 'heart-disease'"):
        load_dataset(DatasetSpec(kind="heart-disease", hospital="va", alpha=0.3))


def test_site_config_reads_a_fashion_mnist_dataset(tmp_path):
    text = SITE + "datasets:\n  fmnist: {kind: fashion-mnist, sites: 8, index: 3, alpha: 0.3, split_seed: 0, " \
                  "path: images, limit: 12000}\n"
    (tmp_path / "site.yaml").write_text(text)
    spec = load_site_config(tmp_path / "site.yaml").datasets["fmnist"]
    assert spec == DatasetSpec(kind="fashion-mnist", sites=8, index=3, alpha=0.3, split_seed=0,
                               path=tmp_path / "images", limit=12000)


@pytest.mark.parametrize(("entry", "prefix", "detail"), [
    ("{kind: fashion-mnist, sites: 8, index: 8, alpha: 0.3}", "5: datasets.f.index: 8 is not a share", "0..7"),
    ("{kind: fashion-mnist, sites: 8, index: 0}", "5: datasets.f.alpha: required for kind 'fashion-mnist'",
     "add 'alpha: <Dirichlet concentration, e.g. 0.3>'"),
    ("{kind: fashion-mnist, index: 0, alpha: 0.3}", "5: datasets.f.sites: required", "add 'sites:"),
    ("{kind: fashion-mnist, sites: 8, alpha: 0.3}", "5: datasets.f.index: required", "add 'index:"),
    ("{kind: fashion-mnist, sites: 8, index: 0, alpha: 0}", "5: datasets.f.alpha: 0.0 is out of range", "> 0"),
    ("{kind: fashion-mnist, sites: 0, index: 0, alpha: 1}", "5: datasets.f.sites: 0 is out of range", ""),
    ("{kind: fashion-mnist, sites: 8, index: -1, alpha: 1}", "5: datasets.f.index: -1 is out of range", ""),
    ("{kind: fashion-mnist, sites: 8, index: 0, alpha: 1, limit: 3}", "5: datasets.f.limit: 3 rows cannot",
     "at least 8"),
    ("{kind: fashion-mnist, sites: 8, index: 0, alpha: 1, hospital: va}",
     "5: datasets.f.hospital: does not apply to kind 'fashion-mnist'", "remove it"),
    ("{kind: heart-disease, hospital: va, sites: 4}", "5: datasets.f.sites: does not apply to kind 'heart-disease'",
     "path, hospital"),
    ("{kind: csv, path: x.csv, label: y, alpha: 0.3}", "5: datasets.f.alpha: does not apply to kind 'csv'", ""),
])
def test_site_config_errors(tmp_path, entry, prefix, detail):
    (tmp_path / "site.yaml").write_text(SITE + f"datasets:\n  f: {entry}\n")
    with pytest.raises(ConfigError) as info:
        load_site_config(tmp_path / "site.yaml")
    message = str(info.value)
    assert prefix in message, message
    assert detail in message, message


def test_config_line_points_at_the_offending_key(tmp_path):
    text = SITE + textwrap.dedent("""\
        datasets:
          f:
            kind: fashion-mnist
            sites: 4
            index: 4
            alpha: 0.3
    """)
    (tmp_path / "site.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"site.yaml:8: datasets.f.index"):
        load_site_config(tmp_path / "site.yaml")
