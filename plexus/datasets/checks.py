"""The checks every dataset loader shares, in one place: which spec fields a kind takes, the file it
needs, numbers in cells, arrays read from a file, and the Split every loader returns."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from plexus.datasets.split import Split
from plexus.errors import ConfigError, IntegrityError

# Fields only a Dirichlet-split image dataset uses; every other kind rejects them.
SPLIT_FIELDS = ("sites", "index", "alpha", "limit")


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


def check_xy(x: np.ndarray, y: np.ndarray, path: Path, xname: str, yname: str) -> tuple[np.ndarray, np.ndarray]:
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


def make_split(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
               feature_names: tuple[str, ...], *, num_classes: int | None = None) -> Split:
    """The Split every loader returns: float32 features and int64 labels, C-contiguous (arrays that already are
    stay the same objects, read-only ones too); `num_classes` defaults to the largest label + 1."""
    return Split(
        x_train=np.ascontiguousarray(x_train, dtype=np.float32),
        y_train=np.ascontiguousarray(y_train, dtype=np.int64),
        x_test=np.ascontiguousarray(x_test, dtype=np.float32),
        y_test=np.ascontiguousarray(y_test, dtype=np.int64),
        num_classes=int(max(y_train.max(), y_test.max())) + 1 if num_classes is None else num_classes,
        feature_names=tuple(feature_names),
    )
