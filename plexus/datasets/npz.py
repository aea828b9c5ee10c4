"""A site's own .npz archive of numeric arrays (never pickled objects)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from plexus.datasets.checks import SPLIT_FIELDS, check_xy, make_split, reject_fields, required_path
from plexus.datasets.split import Split, random_split, stratified_split
from plexus.errors import IntegrityError


def load(spec: Any, *, numeric: bool = False) -> Split:
    """The archive's rows; labels are class indices, or float64 targets if `numeric` (a job's data.target)."""
    path, archive = _open(spec)
    with archive:
        names = set(archive.files)
        arrays = {name: _npz_array(archive, name, path) for name in _wanted(names, path)}
        names_array = _npz_array(archive, "feature_names", path) if "feature_names" in names else None

    if "x" in arrays:
        x, y = check_xy(arrays["x"], arrays["y"], path, "x", "y", numeric=numeric)
        split = random_split if numeric else stratified_split   # numbers have no classes to stratify by
        train, test = split(y, spec.test_fraction, spec.split_seed)
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    else:
        x_train, y_train = check_xy(arrays["x_train"], arrays["y_train"], path, "x_train", "y_train", numeric=numeric)
        x_test, y_test = check_xy(arrays["x_test"], arrays["y_test"], path, "x_test", "y_test", numeric=numeric)
        if x_train.shape[1:] != x_test.shape[1:]:
            raise IntegrityError(
                f"{path}: x_train rows have shape {x_train.shape[1:]}, x_test rows {x_test.shape[1:]}"
            )
    return make_split(x_train, y_train, x_test, y_test, _npz_feature_names(names_array, x_train, path),
                      numeric=numeric)


def load_as_stored(spec: Any) -> Split:
    """The archive with its labels read as the file stores them: floats as numeric targets, integers as classes."""
    path, archive = _open(spec)
    with archive:
        labels = _npz_array(archive, "y" if "y" in _wanted(set(archive.files), path) else "y_train", path)
    return load(spec, numeric=labels.dtype.kind == "f")


def _open(spec: Any) -> tuple[Path, Any]:
    reject_fields(spec, "npz", ("label", "features", "hospital", *SPLIT_FIELDS))
    path = required_path(spec, "npz")
    try:
        # NEVER allow_pickle: unpickling a crafted file runs arbitrary code.
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise IntegrityError(f"{path} is not a readable .npz archive of numeric arrays: {e}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise IntegrityError(f"{path} holds a single array; expected an .npz archive (np.savez)")
    return path, archive


def _wanted(names: set[str], path: Path) -> tuple[str, ...]:
    if {"x_train", "y_train", "x_test", "y_test"} <= names:
        return ("x_train", "y_train", "x_test", "y_test")
    if {"x", "y"} <= names:
        return ("x", "y")
    raise IntegrityError(f"{path} must hold arrays x_train, y_train, x_test, y_test or x, y; it holds {sorted(names)}")


def _npz_array(archive: Any, name: str, path: Path) -> np.ndarray:
    try:
        return archive[name]
    except ValueError:
        raise IntegrityError(
            f"{path}: array {name!r} has object dtype, which needs pickle; "
            "Plexus never unpickles data: save numeric arrays instead"
        ) from None


def _npz_feature_names(names: np.ndarray | None, x: np.ndarray, path: Path) -> tuple[str, ...]:
    if names is None:
        return tuple(f"x{i}" for i in range(x.shape[1])) if x.ndim == 2 else ()
    if names.dtype.kind != "U" or names.shape != (math.prod(x.shape[1:]),):
        raise IntegrityError(
            f"{path}: feature_names must be a 1-D string array with one name per feature"
        )
    return tuple(str(n) for n in names)
