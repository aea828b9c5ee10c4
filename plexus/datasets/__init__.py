"""Datasets a site trains on: Fed-Heart-Disease, a Fashion-MNIST label-skew split, local CSV / NPZ files.

One module per kind (heart, fashion, tables for CSV, npz), each a `load(spec) -> Split` in the KINDS registry;
the checks they share live once in checks, the splits in split. `load_dataset` and `load_for_job` are the
front door.
"""

from __future__ import annotations

from typing import Any, Callable

from plexus.datasets import fashion, heart, npz, tables
from plexus.datasets.checks import REMOTE_REASON_MAX, DataError, cell_number
from plexus.datasets.fashion import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, fashion_mnist
from plexus.datasets.heart import HEART_DISEASE_CSV, HOSPITALS, heart_disease
from plexus.datasets.split import Split, dirichlet_partition, random_split, stratified_split
from plexus.datasets.tables import (
    BAD_CELLS_SHOWN,
    Table,
    csv_train_rows,
    feature_inputs,
    load_with_schema,
    read_table,
    schema_differences,
)
from plexus.errors import ConfigError

__all__ = ["BAD_CELLS_SHOWN", "CLASS_LABELS_ONLY", "FASHION_MNIST_CLASSES", "FASHION_MNIST_DIR", "HEART_DISEASE_CSV",
           "HOSPITALS", "KINDS", "NUMERIC_KINDS", "REMOTE_REASON_MAX", "DataError", "Split", "Table", "cell_number",
           "csv_train_rows", "dirichlet_partition", "fashion_mnist", "feature_inputs", "heart_disease",
           "load_as_stored", "load_dataset", "load_for_job", "random_split", "read_table", "schema_differences",
           "stratified_split", "train_rows"]

KINDS: dict[str, Callable[[Any], Split]] = {
    "csv": tables.load,
    "npz": npz.load,
    "heart-disease": heart.load,
    "fashion-mnist": fashion.load,
}


def load_dataset(spec: Any) -> Split:
    """Load the dataset a DatasetSpec describes (dispatch on ``spec.kind``)."""
    try:
        loader = KINDS[spec.kind]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown dataset kind {spec.kind!r}; expected one of {sorted(KINDS)}"
        ) from None
    return loader(spec)


# The kinds whose files may hold numeric targets (a job's data.target: numeric); the others' labels are classes.
NUMERIC_KINDS = ("csv", "npz")
CLASS_LABELS_ONLY = {
    "heart-disease": "its label is the diagnosis, a class (heart disease or not)",
    "fashion-mnist": "its labels are Fashion-MNIST's ten garment classes",
}


def load_for_job(spec: Any, data: Any) -> Split:
    """The split a job trains and evaluates on at this site.

    ``spec`` is the site's dataset entry, ``data`` the job's data section. A CSV dataset
    needs a label column in its entry (without one it serves statistics jobs only) and the
    job's declared schema (label, its classes for a class target, and features by name); the
    other kinds take none. A numeric ``data.target`` gives float64 labels (csv and
    npz kinds only). Any problem raises DataError, whose ``remote`` text is the reason the site
    declines the job with.
    """
    name = data.dataset
    numeric = data.target == "numeric"
    try:
        if numeric and spec.kind not in NUMERIC_KINDS:
            why = CLASS_LABELS_ONLY.get(spec.kind, "its labels are classes")
            raise DataError(f"dataset {name!r} is of kind {spec.kind!r} at this site: {why}",
                            f"it is a {spec.kind} dataset at this site, and {why}, not the number the job's "
                            f"`target: numeric` fits; numeric targets come from {' or '.join(NUMERIC_KINDS)} "
                            "datasets")
        if spec.kind != "csv":
            if data.label is not None:
                raise DataError(f"dataset {name!r} is of kind {spec.kind!r} at this site",
                                f"it is a {spec.kind} dataset at this site; data.label and data.features "
                                "describe CSV datasets only")
            return npz.load(spec, numeric=True) if numeric else load_dataset(spec)
        if spec.label is None:
            raise DataError(f"dataset {name!r} is a CSV file whose entry in site.yaml names no `label`, so it serves "
                            "statistics jobs only; add `label: COLUMN` to it to train on it",
                            "it serves statistics jobs only at this site: its entry in site.yaml names no label "
                            "column; to train on it, the site adds `label: COLUMN` to the dataset in site.yaml")
        if data.label is None:
            raise DataError(f"dataset {name!r} is a CSV file and the job declares no schema",
                            "it is a CSV file at this site and the job declares no schema: add data.label "
                            "(column, and classes for a class target) and data.features (columns by name) to the "
                            "round config, so that every site encodes the same labels and the same columns")
        return load_with_schema(spec, data)
    except DataError as e:
        raise DataError(str(e), f"dataset {name!r}: {e.remote}") from None
    except (ValueError, OSError) as e:   # the other kinds' errors name files: those stay at the site
        raise DataError(str(e), f"dataset {name!r} cannot be loaded at this site ({type(e).__name__}); "
                                "the site's log says why") from None


def load_as_stored(spec: Any) -> Split:
    """A dataset without a job: as load_dataset, but an npz archive's float labels are read as numeric targets."""
    return npz.load_as_stored(spec) if spec.kind == "npz" else load_dataset(spec)


def train_rows(spec: Any) -> int:
    """Training rows of a dataset that loads without a job, whatever the job's target: what Join advertises.

    A CSV file is only read (the job's schema encodes it): one without a label column advertises all its rows,
    which the statistics jobs it serves read. Other kinds are loaded, their labels as stored.
    """
    return csv_train_rows(spec) if spec.kind == "csv" else len(load_as_stored(spec).y_train)
