"""The checks every dataset loader shares, in one place: which spec fields a kind takes, the file it
needs, numbers in cells, arrays read from a file, and the Split every loader returns."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from plexus.datasets.split import Split
from plexus.errors import ConfigError, IntegrityError
from plexus.text import bounded

# Fields only a Dirichlet-split image dataset uses; every other kind rejects them.
SPLIT_FIELDS = ("sites", "index", "alpha", "limit")
REMOTE_REASON_MAX = 1000   # characters of what a site tells the coordinator about its data


class DataError(IntegrityError):
    """This site's data cannot serve a job.

    ``str(error)`` is the local detail (the file, rows, cell values) for the site's own log
    and `plexus site check`; ``remote`` is what may leave the site: no paths, no cell values.
    """

    def __init__(self, local: str, remote: str):
        super().__init__(bounded(local))   # lists of columns are shortened where they are written; this is the cap
        self.remote = bounded(remote, REMOTE_REASON_MAX)


def first_rows(numbers: list[int], shown: int = 5) -> str:
    """The first few of a list of row numbers, "..." after them if there are more."""
    return ", ".join(map(str, numbers[:shown])) + (", ..." if len(numbers) > shown else "")


def reject_fields(spec: Any, kind: str, fields: tuple[str, ...]) -> None:
    for name in fields:
        if getattr(spec, name, None) is not None:
            raise ConfigError(f"`{name}` does not apply to a dataset of kind {kind!r}")


def required_path(spec: Any, kind: str) -> Path:
    if spec.path is None:
        raise ConfigError(f"{kind} dataset needs `path`")
    path = Path(spec.path)
    if not path.is_file():
        raise ConfigError(f"dataset file {path} does not exist")
    return path


def open_text(path: Path):
    try:
        return path.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"dataset file {path} does not exist") from None


def cell_number(text: str) -> float | None:
    """The cell as a finite number, or None."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def parse_number(value: str, path: Path, column: str, where: str) -> float:
    number = cell_number(value)
    if number is None:
        raise IntegrityError(
            f"{path}: {where}, column {column!r}: {value!r} is not a finite number; "
            "every feature must be numeric (encode categories and fill gaps before training)"
        )
    return number


def check_xy(x: np.ndarray, y: np.ndarray, path: Path, xname: str, yname: str, *,
             numeric: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(x, labels): int64 class indices, or float64 targets if `numeric` (DataError naming the rows without a
    finite one)."""
    if x.dtype.kind not in "biuf":
        raise IntegrityError(f"{path}: {xname} has dtype {x.dtype}; features must be numeric")
    if numeric and y.dtype.kind not in "iuf":
        raise DataError(f"{path}: {yname} has dtype {y.dtype}; numeric targets must be numbers "
                        "(y.astype(np.float64))",
                        f"array {yname!r} holds {y.dtype.name} values, and the job's numeric target needs numbers")
    if not numeric and y.dtype.kind not in "biu":
        raise IntegrityError(
            f"{path}: {yname} has dtype {y.dtype}; labels must be integers (y.astype(np.int64)), or, for a "
            "regression job, the job declares data.target: numeric"
        )
    if x.ndim < 2:
        raise IntegrityError(f"{path}: {xname} has shape {x.shape}; expected (n, features...)")
    if y.ndim != 1 or len(y) != len(x):
        raise IntegrityError(f"{path}: {yname} has shape {y.shape}; expected ({len(x)},) to match {xname}")
    if len(y) == 0:
        raise IntegrityError(f"{path}: {xname} and {yname} are empty")
    if not np.isfinite(x).all():
        raise IntegrityError(f"{path}: {xname} contains NaN or infinite values")
    if numeric:
        bad = np.flatnonzero(~np.isfinite(y)).tolist()
        if bad:
            rows = f"{len(bad)} row(s) of array {yname!r} (counted from 0: {first_rows(bad)})"
            raise DataError(f"{path}: {rows} hold NaN or an infinite target; every row needs a finite number",
                            f"{rows} have no finite target (NaN or infinite)")
        return x, y.astype(np.float64)
    if y.min() < 0:
        raise IntegrityError(f"{path}: {yname} has negative labels; labels must be 0..K-1")
    return x, y.astype(np.int64)


def make_split(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
               feature_names: tuple[str, ...], *, num_classes: int | None = None, numeric: bool = False) -> Split:
    """The Split every loader returns: float32 features and int64 labels, C-contiguous (arrays that already are
    stay the same objects, read-only ones too); `num_classes` defaults to the largest label + 1. A numeric
    target keeps float64 labels and num_classes 0."""
    labels = np.float64 if numeric else np.int64
    if numeric:
        num_classes = 0
    elif num_classes is None:
        num_classes = int(max(y_train.max(), y_test.max())) + 1
    return Split(
        x_train=np.ascontiguousarray(x_train, dtype=np.float32),
        y_train=np.ascontiguousarray(y_train, dtype=labels),
        x_test=np.ascontiguousarray(x_test, dtype=np.float32),
        y_test=np.ascontiguousarray(y_test, dtype=labels),
        num_classes=num_classes,
        feature_names=tuple(feature_names),
    )
