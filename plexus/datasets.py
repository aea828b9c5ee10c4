"""Datasets a site trains on: Fed-Heart-Disease, a Fashion-MNIST label-skew split, local CSV / NPZ files."""

from __future__ import annotations

import codecs
import csv
import functools
import gzip
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from plexus.errors import ConfigError, IntegrityError
from plexus.text import bounded, listing

HOSPITALS = ("cleveland", "hungary", "switzerland", "va")

HEART_DISEASE_CSV = Path(__file__).parent / "data" / "heart_disease_uci.csv"

# Debian's dataset-fashion-mnist package installs the four original IDX files here.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = 10
_IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
_FASHION_SIDE = 28
# Fields only a Dirichlet-split image dataset uses; every other kind rejects them.
_SPLIT_FIELDS = ("sites", "index", "alpha", "limit")

# Hospital name in a config -> value of the CSV's `dataset` column.
_HOSPITAL_COLUMN = {
    "cleveland": "Cleveland",
    "hungary": "Hungary",
    "switzerland": "Switzerland",
    "va": "VA Long Beach",
}

# Fixed, data-independent scaling (value / constant, roughly the clinical upper
# bound of each measurement). Per-site standardisation would give every
# hospital a different feature space and leak site statistics; pooled
# statistics would need sharing data. Constants are documented in
# plexus/data/HEART_DISEASE_NOTICE.md.
_HEART_SCALE = {"age": 100.0, "trestbps": 200.0, "chol": 600.0, "thalch": 220.0, "oldpeak": 6.0}

_HEART_FEATURES = (
    "age",
    "sex",
    "cp_atypical_angina",
    "cp_non_anginal",
    "cp_asymptomatic",
    "trestbps",
    "chol",
    "fbs",
    "restecg_st_t_abnormality",
    "restecg_lv_hypertrophy",
    "thalch",
    "exang",
    "oldpeak",
)
_HEART_COLUMNS = ("id", "dataset", "age", "sex", "cp", "trestbps", "chol", "fbs",
                  "restecg", "thalch", "exang", "oldpeak", "num")
_SEX = {"Male": 1.0, "Female": 0.0}
_BOOL = {"TRUE": 1.0, "FALSE": 0.0}
# FLamby's codes: cp 1..4, restecg 0..2; one-hot with the first level dropped.
_CP = {"typical angina": 1, "atypical angina": 2, "non-anginal": 3, "asymptomatic": 4}
_RESTECG = {"normal": 0, "st-t abnormality": 1, "lv hypertrophy": 2}


@dataclass(frozen=True, eq=False)
class Split:
    """A train/test split of one site's data, ready for torch."""

    x_train: np.ndarray  # float32 (n, ...) C-contiguous
    y_train: np.ndarray  # int64 (n,)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    feature_names: tuple[str, ...]


def load_dataset(spec: Any) -> Split:
    """Load the dataset a DatasetSpec describes (dispatch on ``spec.kind``)."""
    try:
        loader = KINDS[spec.kind]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown dataset kind {spec.kind!r}; expected one of {sorted(KINDS)}"
        ) from None
    return loader(spec)


def heart_disease(
    hospital: str, *, path: Path | None = None, test_fraction: float = 0.34, seed: int = 43
) -> Split:
    """One hospital of Fed-Heart-Disease, preprocessed as FLamby does, split train/test."""
    if hospital not in _HOSPITAL_COLUMN:
        raise ConfigError(f"unknown hospital {hospital!r}; expected one of {list(HOSPITALS)}")
    path = HEART_DISEASE_CSV if path is None else Path(path)
    x, y = _heart_rows(path, _HOSPITAL_COLUMN[hospital])
    train, test = stratified_split(y, test_fraction, seed)
    return _make_split(x[train], y[train], x[test], y[test], _HEART_FEATURES)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) index arrays with each label's share kept; same seed, same split.

    The test set has ceil(test_fraction * n) rows (scikit-learn's convention,
    which reproduces FLamby's split sizes); rows are shared out between labels
    by largest remainder.
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {y.shape}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n = len(y)
    n_test = _test_rows(n, test_fraction)
    if not 1 <= n_test <= n - 1:
        raise ValueError(
            f"cannot split {n} samples with test_fraction={test_fraction}: "
            "train and test would not both be non-empty"
        )
    classes, counts = np.unique(y, return_counts=True)
    quotas = counts * n_test / n
    per_class = np.floor(quotas).astype(np.int64)
    short = n_test - int(per_class.sum())
    per_class[np.argsort(-(quotas - per_class), kind="stable")[:short]] += 1

    rng = np.random.default_rng(seed)
    train, test = [], []
    for label, k in zip(classes, per_class):
        members = rng.permutation(np.flatnonzero(y == label))
        test.append(members[:k])
        train.append(members[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _test_rows(n: int, test_fraction: float) -> int:
    # round() first: 0.34 * 50 is 17.000000000000004 in floating point.
    return math.ceil(round(test_fraction * n, 9))


def _load_heart_disease(spec: Any) -> Split:
    _reject_fields(spec, "heart-disease", ("label", "features", *_SPLIT_FIELDS))
    if spec.hospital is None:
        raise ConfigError(f"heart-disease dataset needs `hospital`, one of {list(HOSPITALS)}")
    return heart_disease(
        spec.hospital, path=spec.path, test_fraction=spec.test_fraction, seed=spec.split_seed
    )


def fashion_mnist(
    *, sites: int, index: int, alpha: float, split_seed: int = 0,
    path: Path | None = None, limit: int | None = None,
) -> Split:
    """Site ``index`` of a Dirichlet(alpha) label-skew split of Fashion-MNIST's training set.

    Every site computes the same partition from (sites, alpha, split_seed,
    limit), so the shares are disjoint and cover the training rows without
    any coordination. ``limit`` keeps only the first N training images (before
    splitting), for fast runs. The test rows are the whole balanced 10k t10k
    set at every site: the question a label-skew benchmark asks is how well the
    federated model does on the population, not on one site's skewed slice.
    Images are float32 (n, 1, 28, 28) in [0, 1]; the arrays are read-only
    (the test set is shared between sites of one process).
    """
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < sites:
        raise ConfigError(f"fashion-mnist: index {index!r} is not a site of the split; use 0..{sites - 1}")
    directory = FASHION_MNIST_DIR if path is None else Path(path)
    images, labels = _fashion_part(directory, "train")
    if limit is not None:
        if limit < sites:
            raise ConfigError(f"fashion-mnist: limit {limit} leaves fewer rows than the {sites} sites; "
                              f"raise limit to at least {sites}")
        images, labels = images[:limit], labels[:limit]
    try:
        rows = dirichlet_partition(labels, sites, alpha, split_seed)[index]
    except ValueError as e:
        raise ConfigError(f"fashion-mnist: {e}") from None
    x_test, y_test = _fashion_test(directory)
    x_train = _read_only(_scale(images[rows]))
    y_train = _read_only(labels[rows].astype(np.int64))
    return Split(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                 num_classes=FASHION_MNIST_CLASSES, feature_names=())


def dirichlet_partition(labels: np.ndarray, sites: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Split row indices across ``sites`` with a Dirichlet(alpha) label skew; sorted int64 index arrays.

    For each class (in sorted order), proportions p ~ Dir(alpha * 1_sites) are
    drawn from ``np.random.default_rng(seed)`` and the class's shuffled rows are
    cut at round(cumsum(p) * n_class). (Rounding, not the usual floor: floor
    hands every class's remainder to the last site, which matters for small
    classes.) The result is disjoint and covers every row. If a site ends up
    empty the whole draw is repeated with the same generator, so the result
    still depends on the arguments alone.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if isinstance(sites, bool) or not isinstance(sites, (int, np.integer)) or sites < 1:
        raise ValueError(f"sites must be a positive integer, got {sites!r}")
    if not (isinstance(alpha, (int, float, np.floating)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if len(labels) < sites:
        raise ValueError(f"cannot give each of {sites} sites a row: there are only {len(labels)} rows")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(1000):
        shares: list[list[np.ndarray]] = [[] for _ in range(sites)]
        for label in classes:
            members = rng.permutation(np.flatnonzero(labels == label))
            cuts = np.rint(np.cumsum(rng.dirichlet(np.full(sites, float(alpha))))[:-1] * len(members))
            cuts = cuts.astype(np.int64)
            for share, chunk in zip(shares, np.split(members, cuts)):
                share.append(chunk)
        parts = [np.sort(np.concatenate(share)).astype(np.int64) for share in shares]
        if min(len(part) for part in parts) > 0:
            return parts
    raise ValueError(
        f"1000 Dirichlet draws with alpha={alpha} each left a site without rows; "
        f"raise alpha, use fewer sites than {sites} or more rows than {len(labels)}"
    )


def _load_fashion_mnist(spec: Any) -> Split:
    _reject_fields(spec, "fashion-mnist", ("label", "features", "hospital"))
    for name in ("sites", "index", "alpha"):
        if getattr(spec, name, None) is None:
            raise ConfigError(f"fashion-mnist dataset needs `{name}`")
    return fashion_mnist(sites=spec.sites, index=spec.index, alpha=spec.alpha, split_seed=spec.split_seed,
                         path=spec.path, limit=getattr(spec, "limit", None))


@functools.lru_cache(maxsize=2)
def _fashion_part(directory: Path, part: str) -> tuple[np.ndarray, np.ndarray]:
    # Decoding 60k images takes a while; the bench loads many sites in one process.
    images = _read_idx(directory / f"{part}-images-idx3-ubyte.gz", _IDX_IMAGES_MAGIC, 3)
    labels = _read_idx(directory / f"{part}-labels-idx1-ubyte.gz", _IDX_LABELS_MAGIC, 1)
    if images.shape[1:] != (_FASHION_SIDE, _FASHION_SIDE):
        raise IntegrityError(f"{directory}: {part} images are {images.shape[1:]}, Fashion-MNIST's are 28x28")
    if len(images) != len(labels):
        raise IntegrityError(f"{directory}: {part} has {len(images)} images but {len(labels)} labels")
    if len(labels) == 0:
        raise IntegrityError(f"{directory}: {part} holds no images")
    if labels.max() >= FASHION_MNIST_CLASSES:
        raise IntegrityError(f"{directory}: {part} has label {labels.max()}; Fashion-MNIST's are 0..9")
    return _read_only(images), _read_only(labels)


@functools.lru_cache(maxsize=1)
def _fashion_test(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = _fashion_part(directory, "t10k")
    return _read_only(_scale(images)), _read_only(labels.astype(np.int64))


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """An IDX file (LeCun's MNIST format, gzip-compressed) as a uint8 array, its header checked."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"dataset file {path} does not exist; install Debian's dataset-fashion-mnist package "
            "or set `path` to a folder with the four *-ubyte.gz files"
        ) from None
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise IntegrityError(f"{path} is not a readable gzip file: {e}") from None
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IntegrityError(f"{path} is {len(data)} bytes, too short for an IDX header of {header} bytes")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise IntegrityError(f"{path}: IDX magic number is {found:#010x}, expected {magic:#010x} "
                             f"(unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    if len(data) - header != math.prod(shape):
        raise IntegrityError(f"{path}: header says shape {shape} ({math.prod(shape)} bytes of data), "
                             f"the file holds {len(data) - header}; the file is truncated or corrupt")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _scale(images: np.ndarray) -> np.ndarray:
    return (images.astype(np.float32) / np.float32(255.0)).reshape(-1, 1, _FASHION_SIDE, _FASHION_SIDE)


def _read_only(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    array.flags.writeable = False
    return array


def _heart_rows(path: Path, hospital_column: str) -> tuple[np.ndarray, np.ndarray]:
    with _open(path) as f:
        reader = csv.DictReader(f)
        missing = [c for c in _HEART_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise IntegrityError(f"{path} is not the UCI heart-disease CSV: missing columns {missing}")
        features, labels = [], []
        for row in reader:
            if _hospital_of(row) != hospital_column:
                continue
            # FLamby drops every row with a missing value among the kept columns.
            if any(row[c] == "" for c in _HEART_COLUMNS):
                continue
            features.append(_heart_features(row, path))
            labels.append(1 if int(row["num"]) > 0 else 0)
    if not labels:
        raise IntegrityError(f"{path} has no complete rows for hospital {hospital_column!r}")
    return np.asarray(features, dtype=np.float32), np.asarray(labels, dtype=np.int64)


def _hospital_of(row: dict[str, str]) -> str:
    # The merged CSV labels the first Hungarian patient (id 304: 28-year-old
    # man, chol 132, thalch 185) as Cleveland. UCI's processed.cleveland.data
    # has 303 rows, its youngest patient is 29, and this row is the first line
    # of processed.hungarian.data; moving it back restores FLamby's 303/261.
    if row["id"] == "304" and row["age"] == "28" and row["chol"] == "132" and row["thalch"] == "185":
        return "Hungary"
    return row["dataset"]


def _heart_features(row: dict[str, str], path: Path) -> list[float]:
    def lookup(table: dict[str, Any], column: str) -> Any:
        try:
            return table[row[column]]
        except KeyError:
            raise IntegrityError(
                f"{path}: id {row['id']}: unexpected {column} value {row[column]!r}; "
                f"expected one of {sorted(table)}"
            ) from None

    def number(column: str) -> float:
        return _parse_number(row[column], path, column, f"id {row['id']}") / _HEART_SCALE[column]

    cp = lookup(_CP, "cp")
    restecg = lookup(_RESTECG, "restecg")
    return [
        number("age"),
        lookup(_SEX, "sex"),
        float(cp == 2), float(cp == 3), float(cp == 4),
        number("trestbps"),
        number("chol"),
        lookup(_BOOL, "fbs"),
        float(restecg == 1), float(restecg == 2),
        number("thalch"),
        lookup(_BOOL, "exang"),
        number("oldpeak"),
    ]


def feature_inputs(features: Any) -> tuple[str, ...]:
    """The model's inputs the declared features derive, in order: `name`, or `name=category` per one-hot slot."""
    return tuple(name for f in features
                 for name in ([f.name] if f.categories is None else [f"{f.name}={c}" for c in f.categories]))


def _load_csv(spec: Any) -> Split:
    """A CSV file read the way the site's own entry says (no job schema): every cell numeric."""
    _reject_fields(spec, "csv", ("hospital", *_SPLIT_FIELDS))
    path = _required_path(spec, "csv")
    if spec.label is None:
        raise ConfigError("csv dataset needs `label`: the name of the label column")
    table = read_table(path, encoding=getattr(spec, "encoding", None), delimiter=getattr(spec, "delimiter", None))
    header, at = table.header, table.columns
    if spec.label not in at:
        raise ConfigError(f"label column {spec.label!r} is not in {path}; columns: {listing(header)}")
    if spec.features is None:
        features = tuple(c for c in header if c != spec.label)
    else:
        features = tuple(spec.features)
        unknown = [c for c in features if c not in at]
        if unknown:
            raise ConfigError(f"feature columns {listing(unknown)} are not in {path}; columns: {listing(header)}")
        if spec.label in features:
            raise ConfigError(f"label column {spec.label!r} is also listed in features")
        if len(set(features)) != len(features):
            raise ConfigError(f"features lists a column twice: {listing(features)}")
    if not features:
        raise ConfigError(f"{path} has no feature columns besides the label {spec.label!r}")

    label_at = at[spec.label]
    columns = [(c, at[c]) for c in features]
    x = np.empty((len(table.rows), len(columns)), dtype=np.float64)
    raw_labels = []
    bad = _BadCells(path)
    for i, row in enumerate(table.rows, start=1):
        for j, (name, at) in enumerate(columns):
            x[i - 1, j] = bad.number(row[at], i, name)
        if row[label_at] == "":
            bad.add(i, spec.label, "", "is empty; every row needs a label")
        raw_labels.append(row[label_at])
    bad.check("every feature must be numeric (encode categories and fill gaps before training, "
              "or declare the schema in the job's data section: see docs/data.md)")
    y = _encode_labels(raw_labels)
    train, test = stratified_split(y, spec.test_fraction, spec.split_seed)
    return _make_split(x[train], y[train], x[test], y[test], features)


def _encode_labels(raw: list[str]) -> np.ndarray:
    # Non-negative integer labels are kept as they are: a site that lacks a
    # class must still put the others at the indices the other sites use.
    try:
        ints = np.asarray([int(v) for v in raw], dtype=np.int64)
    except ValueError:
        ints = None
    if ints is not None and ints.min() >= 0:
        return ints
    try:
        values = sorted(set(raw), key=float)
    except ValueError:
        values = sorted(set(raw))
    index = {v: i for i, v in enumerate(values)}
    return np.asarray([index[v] for v in raw], dtype=np.int64)


# CSV with a job's declared schema ---------------------------------------------------------------

BAD_CELLS_SHOWN = 20   # bad cells one error lists in full; the others are counted
REMOTE_REASON_MAX = 1000   # characters of what a site tells the coordinator about its data


class DataError(IntegrityError):
    """This site's data cannot serve a job.

    ``str(error)`` is the local detail (the file, rows, cell values) for the site's own log
    and `plexus site check`; ``remote`` is what may leave the site: no paths, no cell values.
    """

    def __init__(self, local: str, remote: str):
        super().__init__(bounded(local))   # lists of columns are shortened where they are written; this is the cap
        self.remote = bounded(remote, REMOTE_REASON_MAX)


@dataclass(frozen=True, eq=False)
class Table:
    """A CSV file as text: its header and data rows (blank lines dropped), each row one field per column."""

    path: Path
    header: tuple[str, ...]
    rows: list[list[str]]
    delimiter: str

    @functools.cached_property
    def columns(self) -> dict[str, int]:
        """Column name -> index (a header of 2,000,000 names is searched often)."""
        return {name: i for i, name in enumerate(self.header)}


def read_table(path: Path, *, encoding: str | None = None, delimiter: str | None = None) -> Table:
    """Read a CSV file in ``encoding`` (default UTF-8; a byte-order mark is dropped) split on ``delimiter``."""
    path = Path(path)
    encoding = encoding or "utf-8"
    codec = "utf-8-sig" if codecs.lookup(encoding).name == "utf-8" else encoding
    try:
        with path.open(newline="", encoding=codec) as f:
            records = list(csv.reader(f, delimiter=delimiter or ","))
    except FileNotFoundError:
        raise DataError(f"dataset file {path} does not exist", "the dataset file does not exist at this site") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not {encoding} text ({e.reason}); set the dataset's "
                        "`encoding:` to the file's encoding (e.g. latin-1 or cp1252)",
                        f"the dataset file is not {encoding} text; the site must set its `encoding:`") from None
    except csv.Error as e:
        raise DataError(f"{path} is not a readable CSV file: {e}",
                        "the dataset file is not a readable CSV file") from None
    except OSError as e:
        raise DataError(f"cannot read dataset file {path}: {e.strerror or e}",
                        "the dataset file cannot be read at this site") from None
    if not records:
        raise DataError(f"{path} is empty; expected a header row and data rows", "the dataset file is empty")
    header = tuple(name.strip() for name in records[0])
    twice = sorted(name for name, n in Counter(header).items() if n > 1)
    if twice:
        raise DataError(f"{path}: duplicate column names {listing(twice)} in header {listing(header)}",
                        f"the dataset file's header names columns {listing(twice)} more than once")
    rows = [row for row in records[1:] if row]  # csv.reader yields [] for blank lines
    if not rows:
        raise DataError(f"{path} has a header but no data rows", "the dataset file has a header but no data rows")
    ragged = [(i, len(row)) for i, row in enumerate(rows, start=1) if len(row) != len(header)]
    if ragged:
        shown = ", ".join(f"data row {i} has {n} fields" for i, n in ragged[:BAD_CELLS_SHOWN])
        more = f" and {len(ragged) - BAD_CELLS_SHOWN} more" if len(ragged) > BAD_CELLS_SHOWN else ""
        raise DataError(f"{path}: {len(ragged)} data row(s) do not have the header's {len(header)} fields: "
                        f"{shown}{more}{_delimiter_hint(header, delimiter or ',')}",
                        f"{len(ragged)} data row(s) of the dataset file do not have its header's {len(header)} fields")
    return Table(path, header, rows, delimiter or ",")


def _delimiter_hint(header: tuple[str, ...], delimiter: str) -> str:
    if len(header) == 1:
        for other in ";\t|,":
            if other != delimiter and other in header[0]:
                return f" (the header looks {other!r}-separated: set the dataset's `delimiter: {other!r}`)"
    return ""


class _BadCells:
    """Every bad cell of one file, gathered so that one error reports them all."""

    def __init__(self, path: Path):
        self.path = path
        self.cells: list[tuple[int, str, str, str]] = []   # (data row, column, cell text, problem)

    def add(self, row: int, column: str, text: str, problem: str) -> None:
        self.cells.append((row, column, text, problem))

    def number(self, text: str, row: int, column: str) -> float:
        """The cell as a finite number, or NaN after noting it (the caller raises with check())."""
        value = cell_number(text)
        if value is None:
            self.add(row, column, text, "is not a finite number")
            return math.nan
        return value

    def check(self, fix: str) -> None:
        """Raise one DataError listing the first BAD_CELLS_SHOWN bad cells, if there are any."""
        if not self.cells:
            return
        lines = [f"  data row {r}, column {c!r}: {t!r} {p}" for r, c, t, p in self.cells[:BAD_CELLS_SHOWN]]
        if len(self.cells) > BAD_CELLS_SHOWN:
            lines.append(f"  ... and {len(self.cells) - BAD_CELLS_SHOWN} more")
        rows: dict[tuple[str, str], list[int]] = {}
        for r, c, _, p in self.cells:   # grouped by column and problem (without the fix after any ";")
            rows.setdefault((c, p.split(";")[0]), []).append(r)
        remote = "; ".join(f"column {c!r}: {len(rs)} cell(s) {p} (data rows {_first(rs)})"
                           for (c, p), rs in rows.items())
        raise DataError(f"{self.path}: {len(self.cells)} bad cell(s):\n" + "\n".join(lines) + f"\n{fix}",
                        f"{len(self.cells)} bad cell(s) in the dataset file: {remote}")


def _first(numbers: list[int], shown: int = 5) -> str:
    return ", ".join(map(str, numbers[:shown])) + (", ..." if len(numbers) > shown else "")


def load_for_job(spec: Any, data: Any) -> Split:
    """The split a job trains and evaluates on at this site.

    ``spec`` is the site's dataset entry, ``data`` the job's data section. A CSV dataset
    needs the job's declared schema (label classes and features by name); the other kinds
    take none. Any problem raises DataError, whose ``remote`` text is the reason the site
    declines the job with.
    """
    name = data.dataset
    try:
        if spec.kind != "csv":
            if data.label is not None:
                raise DataError(f"dataset {name!r} is of kind {spec.kind!r} at this site",
                                f"it is a {spec.kind} dataset at this site; data.label and data.features "
                                "describe CSV datasets only")
            return load_dataset(spec)
        if data.label is None:
            raise DataError(f"dataset {name!r} is a CSV file and the job declares no schema",
                            "it is a CSV file at this site and the job declares no schema: add data.label "
                            "(column and classes) and data.features (columns by name) to the round config, so "
                            "that every site encodes the same classes and the same columns")
        return _csv_with_schema(spec, data)
    except DataError as e:
        raise DataError(str(e), f"dataset {name!r}: {e.remote}") from None
    except (ValueError, OSError) as e:   # the other kinds' errors name files: those stay at the site
        raise DataError(str(e), f"dataset {name!r} cannot be loaded at this site ({type(e).__name__}); "
                                "the site's log says why") from None


def csv_train_rows(spec: Any) -> int:
    """Training rows of a CSV dataset, checking only what needs no job (the file reads, the label column exists)."""
    table = read_table(_required_path(spec, "csv"), encoding=spec.encoding, delimiter=spec.delimiter)
    _require_label_column(table, spec.label)
    n = len(table.rows)
    return n - _test_rows(n, spec.test_fraction)


def _require_label_column(table: Table, column: str) -> None:
    if column not in table.columns:
        raise DataError(f"label column {column!r} is not in {table.path}; columns: {listing(table.header)}"
                        f"{_delimiter_hint(table.header, table.delimiter)}",
                        f"the label column {column!r} is not in the dataset file")


def _csv_with_schema(spec: Any, data: Any) -> Split:
    table = read_table(_required_path(spec, "csv"), encoding=spec.encoding, delimiter=spec.delimiter)
    _match_columns(table, spec, data)
    x, y = _encode_rows(table, data)
    try:
        train, test = stratified_split(y, spec.test_fraction, spec.split_seed)
    except ValueError as e:
        raise DataError(f"{table.path}: {e}", f"its {len(y)} rows cannot be split into train and test rows") from None
    return Split(x_train=np.ascontiguousarray(x[train], dtype=np.float32), y_train=y[train],
                 x_test=np.ascontiguousarray(x[test], dtype=np.float32), y_test=y[test],
                 num_classes=len(data.label.classes), feature_names=feature_inputs(data.features))


def schema_differences(table: Table, spec: Any, data: Any) -> tuple[list[str], list[str]]:
    """(problems, extra columns): why this file cannot take the job's columns, and the columns it leaves unused."""
    label = data.label.column
    declared = [f.name for f in data.features]
    problems = []
    if label != spec.label:
        problems.append(f"the job's label column {label!r} is not this site's label column {spec.label!r}")
    missing = [c for c in [label, *declared] if c not in table.columns]
    if missing:
        problems.append(f"missing column(s) {listing(missing)}")
    if spec.features is not None:
        offered = set(spec.features)
        withheld = [c for c in declared if c not in offered]
        if withheld:
            problems.append(f"column(s) {listing(withheld)} are not among the features this site offers")
    named = {label, *declared}
    extra = [c for c in table.header if c not in named]
    return problems, extra


def _match_columns(table: Table, spec: Any, data: Any) -> None:
    problems, extra = schema_differences(table, spec, data)
    if problems:
        unused = f"; the file's columns the job does not declare (left unused): {listing(extra)}" if extra else ""
        raise DataError(f"{table.path}: " + "; ".join(problems) + f"; the file's columns: {listing(table.header)}"
                        + _delimiter_hint(table.header, table.delimiter),
                        "; ".join(problems) + unused)


def _encode_rows(table: Table, data: Any) -> tuple[np.ndarray, np.ndarray]:
    """Declared preprocessing, row by row: scaled numbers, one-hot categories, declared class indices."""
    at = {name: i for i, name in enumerate(table.header)}
    classes = {c: i for i, c in enumerate(data.label.classes)}
    x = np.zeros((len(table.rows), len(feature_inputs(data.features))), dtype=np.float64)
    y = np.zeros(len(table.rows), dtype=np.int64)
    bad = _BadCells(table.path)
    for i, row in enumerate(table.rows, start=1):
        slot = 0
        for f in data.features:
            raw = row[at[f.name]]
            text = raw.strip() or (f.impute or "")
            if f.categories is None:
                value = cell_number(text)
                if value is None:
                    bad.add(i, f.name, raw, "is empty; declare `impute`" if not text else "is not a finite number")
                else:
                    x[i - 1, slot] = (value - f.center) / f.scale
                slot += 1
            else:
                if text in f.categories:
                    x[i - 1, slot + f.categories.index(text)] = 1.0
                else:
                    bad.add(i, f.name, raw, "is empty; declare `impute`" if not text
                            else "is not one of the declared categories")
                slot += len(f.categories)
        raw = row[at[data.label.column]]
        if raw.strip() in classes:
            y[i - 1] = classes[raw.strip()]
        else:
            bad.add(i, data.label.column, raw, "is not one of the declared classes")
    bad.check("fix these cells, or declare them in the job's data section (classes, categories, impute): "
              "see docs/data.md")
    return x, y


def _load_npz(spec: Any) -> Split:
    _reject_fields(spec, "npz", ("label", "features", "hospital", *_SPLIT_FIELDS))
    path = _required_path(spec, "npz")
    try:
        # NEVER allow_pickle: unpickling a crafted file runs arbitrary code.
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise IntegrityError(f"{path} is not a readable .npz archive of numeric arrays: {e}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise IntegrityError(f"{path} holds a single array; expected an .npz archive (np.savez)")
    with archive:
        names = set(archive.files)
        if {"x_train", "y_train", "x_test", "y_test"} <= names:
            wanted = ("x_train", "y_train", "x_test", "y_test")
        elif {"x", "y"} <= names:
            wanted = ("x", "y")
        else:
            raise IntegrityError(
                f"{path} must hold arrays x_train, y_train, x_test, y_test or x, y; "
                f"it holds {sorted(names)}"
            )
        arrays = {name: _npz_array(archive, name, path) for name in wanted}
        names_array = _npz_array(archive, "feature_names", path) if "feature_names" in names else None

    if "x" in arrays:
        x, y = _check_xy(arrays["x"], arrays["y"], path, "x", "y")
        train, test = stratified_split(y, spec.test_fraction, spec.split_seed)
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    else:
        x_train, y_train = _check_xy(arrays["x_train"], arrays["y_train"], path, "x_train", "y_train")
        x_test, y_test = _check_xy(arrays["x_test"], arrays["y_test"], path, "x_test", "y_test")
        if x_train.shape[1:] != x_test.shape[1:]:
            raise IntegrityError(
                f"{path}: x_train rows have shape {x_train.shape[1:]}, x_test rows {x_test.shape[1:]}"
            )
    return _make_split(x_train, y_train, x_test, y_test, _npz_feature_names(names_array, x_train, path))


def _npz_array(archive: Any, name: str, path: Path) -> np.ndarray:
    try:
        return archive[name]
    except ValueError:
        raise IntegrityError(
            f"{path}: array {name!r} has object dtype, which needs pickle; "
            "Plexus never unpickles data: save numeric arrays instead"
        ) from None


def _check_xy(x: np.ndarray, y: np.ndarray, path: Path, xname: str, yname: str) -> tuple[np.ndarray, np.ndarray]:
    if x.dtype.kind not in "biuf":
        raise IntegrityError(f"{path}: {xname} has dtype {x.dtype}; features must be numeric")
    if y.dtype.kind not in "biu":
        raise IntegrityError(
            f"{path}: {yname} has dtype {y.dtype}; labels must be integers (y.astype(np.int64))"
        )
    if x.ndim < 2:
        raise IntegrityError(f"{path}: {xname} has shape {x.shape}; expected (n, features...)")
    if y.ndim != 1 or len(y) != len(x):
        raise IntegrityError(f"{path}: {yname} has shape {y.shape}; expected ({len(x)},) to match {xname}")
    if len(y) == 0:
        raise IntegrityError(f"{path}: {xname} and {yname} are empty")
    if not np.isfinite(x).all():
        raise IntegrityError(f"{path}: {xname} contains NaN or infinite values")
    if y.min() < 0:
        raise IntegrityError(f"{path}: {yname} has negative labels; labels must be 0..K-1")
    return x, y.astype(np.int64)


def _npz_feature_names(names: np.ndarray | None, x: np.ndarray, path: Path) -> tuple[str, ...]:
    if names is None:
        return tuple(f"x{i}" for i in range(x.shape[1])) if x.ndim == 2 else ()
    if names.dtype.kind != "U" or names.shape != (math.prod(x.shape[1:]),):
        raise IntegrityError(
            f"{path}: feature_names must be a 1-D string array with one name per feature"
        )
    return tuple(str(n) for n in names)


def _make_split(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                feature_names: tuple[str, ...]) -> Split:
    return Split(
        x_train=np.ascontiguousarray(x_train, dtype=np.float32),
        y_train=np.ascontiguousarray(y_train, dtype=np.int64),
        x_test=np.ascontiguousarray(x_test, dtype=np.float32),
        y_test=np.ascontiguousarray(y_test, dtype=np.int64),
        num_classes=int(max(y_train.max(), y_test.max())) + 1,
        feature_names=tuple(feature_names),
    )


def cell_number(text: str) -> float | None:
    """The cell as a finite number, or None."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _parse_number(value: str, path: Path, column: str, where: str) -> float:
    number = cell_number(value)
    if number is None:
        raise IntegrityError(
            f"{path}: {where}, column {column!r}: {value!r} is not a finite number; "
            "every feature must be numeric (encode categories and fill gaps before training)"
        )
    return number


def _reject_fields(spec: Any, kind: str, fields: tuple[str, ...]) -> None:
    for name in fields:
        if getattr(spec, name, None) is not None:
            raise ConfigError(f"`{name}` does not apply to a dataset of kind {kind!r}")


def _required_path(spec: Any, kind: str) -> Path:
    if spec.path is None:
        raise ConfigError(f"{kind} dataset needs `path`")
    path = Path(spec.path)
    if not path.is_file():
        raise ConfigError(f"dataset file {path} does not exist")
    return path


def _open(path: Path):
    try:
        return path.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"dataset file {path} does not exist") from None


KINDS: dict[str, Callable[[Any], Split]] = {
    "csv": _load_csv,
    "npz": _load_npz,
    "heart-disease": _load_heart_disease,
    "fashion-mnist": _load_fashion_mnist,
}
