"""Virtual sites from one dataset: `--data`, `--partition` and `--sites` become each site's DatasetSpec.

Every cut is seeded: the same data, partition, sites and seed give the same rows per site and byte-identical
files, so a simulation can be rerun and compared.
"""

from __future__ import annotations

import csv
import math
import re
import unicodedata
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from plexus.config import DatasetSpec
from plexus.datasets import HOSPITALS, DataError, Table, cell_number, dirichlet_partition, fashion_mnist, read_table
from plexus.datasets.split import test_rows
from plexus.errors import ConfigError
from plexus.text import listing

# How --partition is written, by kind.
PARTITIONS = {
    "iid": "iid",
    "dirichlet": "dirichlet:ALPHA (label skew; ALPHA > 0, smaller is more skewed)",
    "by-column": "by-column:COLUMN (one site per value of a CSV column)",
}
DATA_FORMS = ("heart-disease", "fashion-mnist", "csv:PATH")
MAX_SITES = 10_000   # DatasetSpec.sites' limit
# A label of numbers with more distinct values than this is a numeric target, not classes to skew.
MAX_NUMERIC_CLASSES = 100

_SITE_NAME_MAX = 63   # plexus.config.SITE_NAME
_CSV_TEST_FRACTION = next(f.default for f in fields(DatasetSpec) if f.name == "test_fraction")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Partition:
    """How one dataset is cut into virtual sites: `iid`, `dirichlet:ALPHA` or `by-column:COLUMN`."""

    kind: str
    alpha: float | None = None
    column: str | None = None

    def __post_init__(self):
        if self.kind not in PARTITIONS:
            raise ConfigError(f"unknown partition kind {self.kind!r}; use one of {sorted(PARTITIONS)}")
        if (self.alpha is not None) != (self.kind == "dirichlet"):
            raise ConfigError(f"partition {self.kind!r}: alpha goes with dirichlet, and dirichlet needs one")
        if (self.column is not None) != (self.kind == "by-column"):
            raise ConfigError(f"partition {self.kind!r}: column goes with by-column, and by-column needs one")
        if self.alpha is not None and not (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
                                           and math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"dirichlet alpha must be a finite number > 0, got {self.alpha!r}")
        if self.column is not None and (not isinstance(self.column, str) or not self.column):
            raise ConfigError(f"by-column needs a column name, got {self.column!r}")

    def __str__(self) -> str:
        return {"iid": "iid", "dirichlet": f"dirichlet:{self.alpha}", "by-column": f"by-column:{self.column}"}[
            self.kind]


def parse_partition(text: str) -> Partition:
    """The partition `--partition TEXT` names: "iid", "dirichlet:ALPHA" or "by-column:COLUMN"."""
    if not isinstance(text, str):
        raise TypeError(f"partition text must be a str, got {type(text).__name__}")
    kind, colon, arg = text.strip().partition(":")
    arg = arg.strip()
    forms = "; ".join(PARTITIONS.values())
    if kind == "iid":
        if colon:
            raise ConfigError(f"partition {text!r}: iid takes no argument; write `iid`")
        return Partition("iid")
    if kind == "dirichlet":
        alpha = cell_number(arg)
        if alpha is None or alpha <= 0:
            raise ConfigError(f"partition {text!r}: dirichlet needs an alpha, a finite number > 0 "
                              f"(e.g. dirichlet:0.3); accepted forms: {forms}")
        return Partition("dirichlet", alpha=alpha)
    if kind == "by-column":
        if not arg:
            raise ConfigError(f"partition {text!r}: by-column needs a column name (by-column:COLUMN); "
                              f"accepted forms: {forms}")
        return Partition("by-column", column=arg)
    raise ConfigError(f"unknown partition {text!r}; accepted forms: {forms}")


def virtual_sites(data: str, *, dataset: str, out_dir: Path, partition: Partition | None = None,
                  sites: int | None = None, label: str | None = None, seed: int = 0
                  ) -> dict[str, dict[str, DatasetSpec]]:
    """Site name -> {`dataset` -> its DatasetSpec}: `data` cut into virtual sites, files written under out_dir.

    heart-disease: its four hospitals, one site each. fashion-mnist: `sites` sites, `dirichlet:ALPHA` as the
    fashion-mnist kind's own split, `iid` as one .npz file per site (its test rows a balanced share of t10k,
    where the dirichlet split's sites each test on all of it). csv:PATH (a header, then rows; UTF-8,
    commas): one CSV file per site with the same header, `label` its label column. by-column keeps the
    column in the files (it is a feature like any other; leave it out of the job's features to drop it).
    """
    if not isinstance(data, str):
        raise TypeError(f"data must be a str, got {type(data).__name__}")
    if partition is not None and not isinstance(partition, Partition):
        raise TypeError(f"partition must be a Partition (parse_partition), got {type(partition).__name__}")
    if sites is not None and (isinstance(sites, bool) or not isinstance(sites, int) or not 1 <= sites <= MAX_SITES):
        raise ConfigError(f"--sites must be a whole number from 1 to {MAX_SITES}, got {sites!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a whole number >= 0, got {seed!r}")
    kind, colon, arg = data.partition(":")
    if kind == "heart-disease" and not colon:
        return _heart_disease(dataset, partition, sites, label)
    if kind == "fashion-mnist" and not colon:
        return _fashion_mnist(dataset, Path(out_dir), partition, sites, label, seed)
    if kind == "csv" and arg:
        return _csv(Path(arg), dataset, Path(out_dir), partition, sites, label, seed)
    raise ConfigError(f"unknown data {data!r}; accepted forms: {', '.join(DATA_FORMS)}")


def site_names(sites: int) -> list[str]:
    """site-000, site-001, ...: zero-padded to the width of the last index, at least three digits."""
    width = max(3, len(str(sites - 1)))
    return [f"site-{i:0{width}d}" for i in range(sites)]


def _heart_disease(dataset: str, partition: Partition | None, sites: int | None,
                   label: str | None) -> dict[str, dict[str, DatasetSpec]]:
    if partition is not None or sites is not None:
        raise ConfigError("heart-disease is partitioned by its hospitals; leave out --partition and --sites")
    if label is not None:
        raise ConfigError("--label names a csv:PATH file's label column; heart-disease's label is its diagnosis, "
                          "leave out --label")
    return {h: {dataset: DatasetSpec(kind="heart-disease", hospital=h)} for h in HOSPITALS}


def _fashion_mnist(dataset: str, out_dir: Path, partition: Partition | None, sites: int | None,
                   label: str | None, seed: int) -> dict[str, dict[str, DatasetSpec]]:
    if label is not None:
        raise ConfigError("--label names a csv:PATH file's label column; fashion-mnist's labels are its garment "
                          "classes, leave out --label")
    _require_partition(partition, "fashion-mnist", ("iid", "dirichlet"))
    if partition.kind == "by-column":
        raise ConfigError("fashion-mnist images have no columns to partition by; use --partition iid or "
                          "dirichlet:ALPHA")
    _require_sites(sites, "fashion-mnist", partition)
    names = site_names(sites)
    if partition.kind == "dirichlet":
        # Loading one site computes the partition every site will: a draw that leaves a site empty fails here.
        fashion_mnist(sites=sites, index=0, alpha=partition.alpha, split_seed=seed)
        return {name: {dataset: DatasetSpec(kind="fashion-mnist", sites=sites, index=i, alpha=partition.alpha,
                                            split_seed=seed)}
                for i, name in enumerate(names)}
    # One site's share of a split over one site is the whole training set, in file order, scaled as the
    # fashion-mnist kind scales it.
    full = fashion_mnist(sites=1, index=0, alpha=1.0)
    rng = np.random.default_rng(seed)
    train = [np.sort(share) for share in np.array_split(rng.permutation(len(full.y_train)), sites)]
    test = _dealt(full.y_test, sites, rng)   # 60,000 training and 10,000 test images: some of each per site
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = {}
    for name, rows, held_out in zip(names, train, test):
        path = (out_dir / f"{name}.npz").resolve()
        _write_npz(path, {"x_train": full.x_train[rows], "y_train": full.y_train[rows],
                          "x_test": full.x_test[held_out], "y_test": full.y_test[held_out]})
        specs[name] = {dataset: DatasetSpec(kind="npz", path=path)}
    return specs


def _dealt(labels: np.ndarray, sites: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Disjoint shares of the test rows covering them all, each as balanced as the whole.

    The fashion-mnist kind evaluates every site on the whole of t10k; one copy per iid site would be 31 MB
    each. A share of it instead keeps the weighted mean over the sites (what `plexus job metrics` reports)
    the accuracy on the whole of t10k, as it is for a dirichlet split.
    """
    order = rng.permutation(len(labels))
    order = order[np.argsort(labels[order], kind="stable")]   # class by class, shuffled within each class
    return [np.sort(order[i::sites]) for i in range(sites)]


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez's layout, but byte-identical for the same arrays: np.savez stamps each member with the time."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH), "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)


def _csv(path: Path, dataset: str, out_dir: Path, partition: Partition | None, sites: int | None,
         label: str | None, seed: int) -> dict[str, dict[str, DatasetSpec]]:
    if not path.is_file():
        raise ConfigError(f"dataset file {path} does not exist" if not path.exists()
                          else f"dataset file {path} is not a file")
    if label is None:
        raise ConfigError(f"csv:{path} needs --label, the name of its label column")
    _require_partition(partition, f"csv:{path}", tuple(PARTITIONS))
    if partition.kind != "by-column":   # by-column makes one site per value
        _require_sites(sites, f"csv:{path}", partition)
    try:
        table = read_table(path)
    except DataError as e:
        raise ConfigError(f"{e} (simulate reads csv:PATH as UTF-8 text with commas)") from None
    _require_column(table, label, "label column")
    minimum = _min_rows(_CSV_TEST_FRACTION)
    of_file = f"of the {len(table.rows)} in {path}"
    if partition.kind == "by-column":
        values, shares = _by_column(table, partition.column, label, sites)
        names = _value_names(values)
        _check_rows(names, shares, minimum, of_file,
                    f"drop or merge the rare values of column {partition.column!r}", values=values)
    else:
        names = site_names(sites)
        if partition.kind == "iid":
            order = np.random.default_rng(seed).permutation(len(table.rows))
            shares = [np.sort(share) for share in np.array_split(order, sites)]
            _check_rows(names, shares, minimum, of_file, f"use fewer sites (at most {len(table.rows) // minimum})")
        else:
            shares = _label_skew(table, label, sites, partition.alpha, seed)
            _check_rows(names, shares, minimum, of_file, "use fewer sites or a larger alpha")
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = {}
    for name, rows in zip(names, shares):
        site_path = (out_dir / f"{name}.csv").resolve()
        with site_path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(table.header)
            writer.writerows(table.rows[i] for i in rows.tolist())
        specs[name] = {dataset: DatasetSpec(kind="csv", path=site_path, label=label)}
    return specs


def _label_skew(table: Table, label: str, sites: int, alpha: float, seed: int) -> list[np.ndarray]:
    at = table.columns[label]
    cells = [row[at] for row in table.rows]
    classes, indices = np.unique(np.asarray(cells), return_inverse=True)
    filled = [c for c in classes.tolist() if c.strip()]   # an empty label fails where the site loads its file
    if len(filled) > MAX_NUMERIC_CLASSES and all(cell_number(c) is not None for c in filled):
        raise ConfigError(f"dirichlet needs a categorical label: column {label!r} of {table.path} holds "
                          f"{len(filled)} distinct numbers, a numeric target rather than classes (at most "
                          f"{MAX_NUMERIC_CLASSES} numbers count as classes); use --partition iid or by-column:COLUMN")
    try:
        return dirichlet_partition(indices.reshape(-1), sites, alpha, seed)
    except ValueError as e:
        raise ConfigError(f"csv:{table.path}, dirichlet:{alpha}: {e}") from None


def _by_column(table: Table, column: str, label: str, sites: int | None) -> tuple[list[str], list[np.ndarray]]:
    """The distinct values of `column` (sorted) and each one's rows."""
    if column == label:
        raise ConfigError(f"by-column:{column} would split by the label column: each site would hold one class; "
                          "choose another column, or use dirichlet:ALPHA for a label skew")
    _require_column(table, column, "column")
    at = table.columns[column]
    values, indices, counts = np.unique(np.asarray([row[at] for row in table.rows]), return_inverse=True,
                                        return_counts=True)
    if len(values) > MAX_SITES:
        raise ConfigError(f"by-column:{column} would make {len(values)} sites, one per distinct value, "
                          f"more than {MAX_SITES}; choose a column with fewer values")
    if sites is not None and sites != len(values):
        raise ConfigError(f"--sites is {sites}, but column {column!r} has {len(values)} distinct values, so "
                          f"by-column:{column} makes {len(values)} sites; leave out --sites or set it to {len(values)}")
    order = np.argsort(indices.reshape(-1), kind="stable")
    return values.tolist(), [np.sort(share) for share in np.split(order, np.cumsum(counts)[:-1])]


def _value_names(values: list[str]) -> list[str]:
    """A distinct site name per value: lowercase ASCII, runs of other characters as '-', then -2, -3 on a clash."""
    names: list[str] = []
    taken = set()
    for value in values:
        ascii_text = unicodedata.normalize("NFKD", value).encode("ascii", "ignore").decode().lower()
        base = re.sub(r"[^a-z0-9_-]+", "-", ascii_text).strip("-_")[:_SITE_NAME_MAX].rstrip("-_") or "empty"
        name, k = base, 2
        while name in taken:
            suffix = f"-{k}"
            name, k = base[:_SITE_NAME_MAX - len(suffix)] + suffix, k + 1
        taken.add(name)
        names.append(name)
    return names


def _require_partition(partition: Partition | None, data: str, kinds: tuple[str, ...]) -> None:
    if partition is None:
        raise ConfigError(f"{data} needs --partition: {'; '.join(PARTITIONS[k] for k in kinds)}")


def _require_sites(sites: int | None, data: str, partition: Partition) -> None:
    if sites is None:
        raise ConfigError(f"{data} with --partition {partition} needs --sites, how many virtual sites to make")


def _require_column(table: Table, column: str, role: str) -> None:
    if column not in table.columns:
        hint = ""
        if len(table.header) == 1:
            found = next((d for d in ";\t|" if d in table.header[0]), None)
            hint = f" (the header looks {found!r}-separated; simulate reads comma-separated files)" if found else ""
        raise ConfigError(f"{role} {column!r} is not in {table.path}; columns: {listing(table.header)}{hint}")


def _min_rows(test_fraction: float) -> int:
    """The fewest rows a CSV site can split into at least one training and one test row."""
    n = 2
    while not 1 <= test_rows(n, test_fraction) <= n - 1:
        n += 1
    return n


def _check_rows(names: list[str], shares: list[np.ndarray], minimum: int, of: str, fix: str, *,
                values: list[str] | None = None) -> None:
    """ConfigError naming the first site with fewer than `minimum` rows, if any has."""
    short = [i for i, share in enumerate(shares) if len(share) < minimum]
    if not short:
        return
    i = short[0]
    what = f" ({values[i]!r})" if values is not None else ""
    others = f", and {len(short) - 1} other site(s) fewer than {minimum} too" if len(short) > 1 else ""
    raise ConfigError(f"site {names[i]}{what} would get {len(shares[i])} row(s) {of}{others}; each site needs at "
                      f"least {minimum} rows (a training and a test row); {fix}")
