"""Fed-Heart-Disease: one of the four UCI hospitals, preprocessed as FLamby does."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from plexus.datasets.checks import SPLIT_FIELDS, make_split, open_text, parse_number, reject_fields
from plexus.datasets.split import Split, stratified_split
from plexus.datasets.tables import Table, read_table
from plexus.errors import ConfigError, IntegrityError

HOSPITALS = ("cleveland", "hungary", "switzerland", "va")

HEART_DISEASE_CSV = Path(__file__).parents[1] / "data" / "heart_disease_uci.csv"

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


def heart_disease(
    hospital: str, *, path: Path | None = None, test_fraction: float = 0.34, seed: int = 43
) -> Split:
    """One hospital of Fed-Heart-Disease, preprocessed as FLamby does, split train/test."""
    if hospital not in _HOSPITAL_COLUMN:
        raise ConfigError(f"unknown hospital {hospital!r}; expected one of {list(HOSPITALS)}")
    path = HEART_DISEASE_CSV if path is None else Path(path)
    x, y = _heart_rows(path, _HOSPITAL_COLUMN[hospital])
    train, test = stratified_split(y, test_fraction, seed)
    return make_split(x[train], y[train], x[test], y[test], _HEART_FEATURES)


def load(spec: Any) -> Split:
    reject_fields(spec, "heart-disease", ("label", "features", *SPLIT_FIELDS))
    if spec.hospital is None:
        raise ConfigError(f"heart-disease dataset needs `hospital`, one of {list(HOSPITALS)}")
    return heart_disease(
        spec.hospital, path=spec.path, test_fraction=spec.test_fraction, seed=spec.split_seed
    )


def hospital_table(hospital: str, *, path: Path | None = None) -> Table:
    """Every row of one hospital in the UCI CSV, as text, none dropped (statistics describe them all)."""
    if hospital not in _HOSPITAL_COLUMN:
        raise ConfigError(f"unknown hospital {hospital!r}; expected one of {list(HOSPITALS)}")
    table = read_table(HEART_DISEASE_CSV if path is None else Path(path))
    missing = [c for c in _HEART_COLUMNS if c not in table.columns]
    if missing:
        raise IntegrityError(f"{table.path} is not the UCI heart-disease CSV: missing columns {missing}")
    rows = [row for row in table.rows if _hospital_of(dict(zip(table.header, row))) == _HOSPITAL_COLUMN[hospital]]
    if not rows:
        raise IntegrityError(f"{table.path} has no rows for hospital {_HOSPITAL_COLUMN[hospital]!r}")
    return Table(table.path, table.header, rows, table.delimiter)


def _heart_rows(path: Path, hospital_column: str) -> tuple[np.ndarray, np.ndarray]:
    with open_text(path) as f:
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
        return parse_number(row[column], path, column, f"id {row['id']}") / _HEART_SCALE[column]

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
