"""Split learning's messages on the wire (the Split RPC), numpy only: both sides read each tensor through
`array_of`, which refuses a dtype, shape or byte count that is off, and anything not finite, before any of it is
used.

A session (site → coordinator, one message in flight each way):
    SplitOpen (task binding, the batch plan)        → message
    SplitBatch (seq, activations[, labels])         → the gradient at the cut (vanilla: with the loss), or, u-shaped,
                                                       the server part's output
    SplitGrad (seq, gradient at that output)        → the gradient at the cut (u-shaped only)
    SplitDone (rows, metrics[, the site's parts])   → message
An evaluation session sends its batches the same way; the server steps nothing and answers a vanilla batch with
its summed loss and correct count, a u-shaped one with the server part's output.

Synchronous SplitFed (coordinator/drivers/split_sync.py) numbers its messages by turn, answers each once every
site's part of the turn is in, and ends each turn with
    SplitSum (seq, the gradients of the site's parts)   → their sum over the sites (the forward's reply also
                                                          carries the turn's rows, which weigh the site's loss)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from plexus.errors import IntegrityError, Reason
from plexus.proto.plexus.v1 import federation_pb2 as fpb

_DTYPES = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8")}
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 28          # 1 GiB of float32: far beyond a batch at any cut; gRPC's message limit comes first


def tensor_message(array: np.ndarray, name: str = "") -> fpb.TensorData:
    """A float32 or int64 array as a TensorData (raw little-endian bytes, C order)."""
    array = np.asarray(array)
    dtype = "F32" if array.dtype.kind == "f" else "I64"
    data = np.ascontiguousarray(array, dtype=_DTYPES[dtype])
    return fpb.TensorData(dtype=dtype, shape=list(data.shape), data=data.tobytes(), name=name)


def array_of(message: fpb.TensorData, *, dtype: str, what: str, shape: tuple[int, ...] | None = None,
             rows: tuple[int, int] | None = None, finite: bool = True) -> np.ndarray:
    """The array a TensorData carries, checked: `dtype` ("F32" or "I64"), the whole `shape` if given, else a first
    dimension within `rows` (lo, hi); its bytes exactly those; float values finite (unless `finite` is False: a
    reader that checks the values itself, as the coordinator's compute worker does). IntegrityError otherwise."""
    if message.dtype != dtype:
        raise IntegrityError(f"{what}: dtype {message.dtype or 'unset'!r}, expected {dtype}", reason=Reason.LAYOUT)
    dims = tuple(int(n) for n in message.shape)
    if not 1 <= len(dims) <= MAX_DIMS or any(n < 0 for n in dims):
        raise IntegrityError(f"{what}: shape {list(dims)} is not a tensor of 1 to {MAX_DIMS} dimensions",
                             reason=Reason.LAYOUT)
    if shape is not None and dims != tuple(shape):
        raise IntegrityError(f"{what}: shape {list(dims)}, expected {list(shape)}", reason=Reason.LAYOUT)
    if rows is not None and not rows[0] <= dims[0] <= rows[1]:
        raise IntegrityError(f"{what}: {dims[0]} rows, expected {rows[0]} to {rows[1]}", reason=Reason.LAYOUT)
    count = math.prod(dims)   # Python ints: [2**32, 2**32] overflows int64 to 0
    if count > MAX_ELEMENTS or len(message.data) != count * _DTYPES[dtype].itemsize:
        raise IntegrityError(f"{what}: {len(message.data)} bytes of data for shape {list(dims)} {dtype}",
                             reason=Reason.LAYOUT)
    array = np.frombuffer(message.data, dtype=_DTYPES[dtype]).reshape(dims)
    if finite and dtype == "F32" and not np.isfinite(array).all():
        raise IntegrityError(f"{what} contains NaN or Inf; refusing it", reason=Reason.NON_FINITE)
    return array


def weights_of(messages, expected: Mapping[str, tuple[int, ...]], *, what: str) -> dict[str, np.ndarray]:
    """A site's parts (SplitDone.weights): exactly the `expected` names (name -> shape), each float32 and finite."""
    out: dict[str, np.ndarray] = {}
    for message in messages:
        if message.name not in expected:
            raise IntegrityError(f"{what}: {message.name!r} is not a tensor of the site's parts "
                                 f"({', '.join(sorted(expected))})", reason=Reason.LAYOUT)
        if message.name in out:
            raise IntegrityError(f"{what}: {message.name!r} is sent twice", reason=Reason.LAYOUT)
        out[message.name] = array_of(message, dtype="F32", what=f"{what} {message.name}",
                                     shape=expected[message.name])
    missing = sorted(set(expected) - set(out))
    if missing:
        raise IntegrityError(f"{what}: missing {', '.join(missing)}", reason=Reason.LAYOUT)
    return out
