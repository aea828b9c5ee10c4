"""Fashion-MNIST split across sites with a Dirichlet label skew, read from the original IDX files."""

from __future__ import annotations

import functools
import gzip
import math
from pathlib import Path
from typing import Any

import numpy as np

from plexus.datasets.checks import make_split, reject_fields
from plexus.datasets.split import Split, dirichlet_partition
from plexus.errors import ConfigError, IntegrityError

# Debian's dataset-fashion-mnist package installs the four original IDX files here.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = 10
_IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
_FASHION_SIDE = 28


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
    return make_split(x_train, y_train, x_test, y_test, (), num_classes=FASHION_MNIST_CLASSES)


def load(spec: Any) -> Split:
    reject_fields(spec, "fashion-mnist", ("label", "features", "hospital"))
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
