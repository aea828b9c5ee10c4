"""A site's CSV files: read as text, loaded as they are (every cell numeric), or encoded with a job's declared
schema; DataError keeps the local detail apart from what may leave the site."""

from __future__ import annotations

import codecs
import csv
import functools
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plexus.datasets.checks import (
    SPLIT_FIELDS,
    DataError,
    cell_number,
    first_rows,
    make_split,
    reject_fields,
    required_path,
)
from plexus.datasets.split import Split, random_split, stratified_split, test_rows
from plexus.errors import ConfigError
from plexus.text import listing

BAD_CELLS_SHOWN = 20   # bad cells one error lists in full; the others are counted


def feature_inputs(features: Any) -> tuple[str, ...]:
    """The model's inputs the declared features derive, in order: `name`, or `name=category` per one-hot slot."""
    return tuple(name for f in features
                 for name in ([f.name] if f.categories is None else [f"{f.name}={c}" for c in f.categories]))


def load(spec: Any) -> Split:
    """A CSV file read the way the site's own entry says (no job schema): every cell numeric."""
    reject_fields(spec, "csv", ("hospital", *SPLIT_FIELDS))
    path = required_path(spec, "csv")
    if spec.label is None:
        raise ConfigError("csv dataset needs `label` (the name of the label column) to load for training; "
                          "without it the file serves statistics jobs only")
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
    return make_split(x[train], y[train], x[test], y[test], features)


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
        remote = "; ".join(f"column {c!r}: {len(rs)} cell(s) {p} (data rows {first_rows(rs)})"
                           for (c, p), rs in rows.items())
        raise DataError(f"{self.path}: {len(self.cells)} bad cell(s):\n" + "\n".join(lines) + f"\n{fix}",
                        f"{len(self.cells)} bad cell(s) in the dataset file: {remote}")


def csv_train_rows(spec: Any) -> int:
    """Training rows of a CSV dataset, checking only what needs no job (the file reads, the label column exists).

    Without a label column the file serves statistics jobs only, which read every row: all rows, no split.
    """
    table = read_table(required_path(spec, "csv"), encoding=spec.encoding, delimiter=spec.delimiter)
    if spec.label is None:
        return len(table.rows)
    _require_label_column(table, spec.label)
    n = len(table.rows)
    return n - test_rows(n, spec.test_fraction)


def _require_label_column(table: Table, column: str) -> None:
    if column not in table.columns:
        raise DataError(f"label column {column!r} is not in {table.path}; columns: {listing(table.header)}"
                        f"{_delimiter_hint(table.header, table.delimiter)}",
                        f"the label column {column!r} is not in the dataset file")


def load_with_schema(spec: Any, data: Any) -> Split:
    """A CSV dataset encoded with the job's declared schema (data.label, data.features); DataError says why not."""
    table = read_table(required_path(spec, "csv"), encoding=spec.encoding, delimiter=spec.delimiter)
    _match_columns(table, spec, data)
    x, y = _encode_rows(table, data)
    numeric = data.target == "numeric"
    split = random_split if numeric else stratified_split   # numbers have no classes to stratify by
    try:
        train, test = split(y, spec.test_fraction, spec.split_seed)
    except ValueError as e:
        raise DataError(f"{table.path}: {e}", f"its {len(y)} rows cannot be split into train and test rows") from None
    return make_split(x[train], y[train], x[test], y[test], feature_inputs(data.features),
                      num_classes=None if numeric else len(data.label.classes), numeric=numeric)


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
    """Declared preprocessing, row by row: scaled numbers, one-hot categories, declared class indices (or, for a
    numeric target, the label cells as numbers)."""
    at = {name: i for i, name in enumerate(table.header)}
    numeric = data.target == "numeric"
    classes = {} if numeric else {c: i for i, c in enumerate(data.label.classes)}
    x = np.zeros((len(table.rows), len(feature_inputs(data.features))), dtype=np.float64)
    y = np.zeros(len(table.rows), dtype=np.float64 if numeric else np.int64)
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
        if numeric:
            target = cell_number(raw.strip())
            if target is None:
                bad.add(i, data.label.column, raw, "is empty; every row needs a target" if not raw.strip()
                        else "is not a finite number (the numeric target)")
            else:
                y[i - 1] = target
        elif raw.strip() in classes:
            y[i - 1] = classes[raw.strip()]
        else:
            bad.add(i, data.label.column, raw, "is not one of the declared classes")
    bad.check("fix these cells, or declare them in the job's data section (classes, categories, impute): "
              "see docs/data.md")
    return x, y
