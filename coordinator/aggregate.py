"""Streaming, exact weighted sums of model updates.

Each update is quantised to 64-bit fixed point *before* it is folded in, so the
running sum is integer arithmetic: associative, hence the same bits whatever
order the sites' updates arrive in. That is what makes a seeded federated run
reproducible bit for bit. Memory is one int64 per model element, whatever the
number of sites.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from plexus.errors import IntegrityError
from plexus.wire import DTYPES, Layout, decode

FRAC_BITS = 32                  # resolution 2**-32 ≈ 2.3e-10, finer than float32 for |x| > 2**-9
_SCALE = float(2 ** FRAC_BITS)
_LIMIT = float(2 ** 62)         # headroom below int64's 2**63 so no partial sum can overflow
MAX_WEIGHT = 2 ** 31
FOLD_ELEMENTS = 1 << 15         # elements per step: the float64/int64 scratch stays in L2 cache


class WeightedSum:
    """Σ w_k · x_k over updates that share one layout, folded one chunk at a time."""

    def __init__(self, layout: Layout):
        self.layout = layout
        # One int64 array per tensor, so the mean can hand each one back as soon as it is written.
        self._parts: list[np.ndarray | None] = [np.zeros(t.numel, dtype=np.int64) for t in layout.tensors]
        self.total_weight = 0
        self.count = 0
        self._bound = 0.0
        self._poisoned = ""
        self._f64 = np.empty(FOLD_ELEMENTS, np.float64)   # scratch, reused by every fold
        self._i64 = np.empty(FOLD_ELEMENTS, np.int64)

    def check_fits(self, weight: int, max_abs: float) -> None:
        """Refuse an update that could overflow the exact range; call before fold()."""
        if not 1 <= weight <= MAX_WEIGHT:
            raise IntegrityError(f"num_samples must be between 1 and {MAX_WEIGHT}; got {weight}")
        if (self._bound + weight * max_abs) * _SCALE >= _LIMIT:
            raise IntegrityError(
                f"update too large to aggregate exactly: max |value| {max_abs:.3g} × num_samples {weight} "
                f"exceeds the fixed-point range (Σ n·|x| < {_LIMIT / _SCALE:.3g}); the site's training "
                "has probably diverged")

    def fold(self, pieces: Iterable[bytes | memoryview], weight: int, max_abs: float, *, nbytes: int) -> None:
        """Add weight × (an update blob of nbytes, arriving as consecutive pieces).

        Everything that can be checked up front is, so a refused update leaves the sum
        untouched without a second model-sized buffer. Should the pieces then disagree
        with nbytes (a source changing under us), the sum is poisoned and mean() refuses.
        """
        total = self.layout.total_bytes
        if nbytes != total:
            raise IntegrityError(f"update blob has {nbytes} bytes; the layout needs {total}; it was not folded")
        self.check_fits(weight, max_abs)
        self._require_clean()
        pending = bytearray()   # only an element split across two pieces is ever copied here
        position = 0  # byte position in the blob
        try:
            for piece in pieces:
                if pending:   # an element straddled the last edge: fold through the small buffer
                    pending += piece
                    used = self._fold_bytes(position, memoryview(pending), weight)
                    del pending[:used]
                else:         # the common case: straight from the piece, no copy
                    data = memoryview(piece)
                    used = self._fold_bytes(position, data, weight)
                    pending += data[used:]
                position += used
                if position + len(pending) > total:
                    break
        except BaseException as exc:
            self._poisoned = f"folding an update failed part-way ({type(exc).__name__})"
            raise
        if pending or position != total:
            self._poisoned = f"an update declared {total} bytes but delivered {position + len(pending)}"
            self._require_clean()
        self._bound += weight * max_abs
        self.total_weight += weight
        self.count += 1

    @property
    def acc(self) -> np.ndarray:
        """The whole fixed-point sum as one array (a copy, for inspection)."""
        self._require_clean()
        return np.concatenate(self._parts) if self._parts else np.zeros(0, np.int64)

    def _require_clean(self) -> None:
        if self._poisoned:
            raise IntegrityError(f"this round's sum is unusable: {self._poisoned}; the round must fail")

    def _fold_bytes(self, position: int, data: memoryview, weight: int) -> int:
        """Fold as many whole elements of data (starting at blob byte position) as possible."""
        used = 0
        for t, into in zip(self.layout.tensors, self._parts):
            end = t.offset + t.nbytes
            start = position + used
            if start >= end or start < t.offset:
                continue
            dtype = DTYPES[t.dtype]
            n = min(end - start, len(data) - used) // dtype.itemsize
            if n == 0:
                break
            elem = (start - t.offset) // dtype.itemsize
            for k in range(0, n, FOLD_ELEMENTS):
                m = min(FOLD_ELEMENTS, n - k)
                values = np.frombuffer(data, dtype=dtype, count=m, offset=used + k * dtype.itemsize)
                scaled, fixed = self._f64[:m], self._i64[:m]
                np.multiply(values, _SCALE, out=scaled, dtype=np.float64)   # in float64: exact for float32 input
                np.rint(scaled, out=scaled)
                np.copyto(fixed, scaled, casting="unsafe")                  # integral values below 2**62: exact
                if weight != 1:
                    np.multiply(fixed, weight, out=fixed)
                target = into[elem + k:elem + k + m]
                np.add(target, fixed, out=target)
            used += n * dtype.itemsize
        return used

    def mean_blob(self, *, release: bool = False) -> np.ndarray:
        """The weighted mean as a wire blob, written block by block.

        With release=True each tensor's part of the sum is freed once written, so the peak is
        the sum plus one tensor rather than the sum plus the whole new model; the sum is spent.
        """
        self._require_clean()
        if self.total_weight == 0:
            raise IntegrityError("no update was aggregated; there is no mean to take")
        # calloc'd: pages become resident only as tensors are written, while released parts shrink.
        blob = np.zeros(self.layout.total_bytes, dtype=np.uint8)
        for i, t in enumerate(self.layout.tensors):
            out, part = np.frombuffer(blob, dtype=DTYPES[t.dtype], count=t.numel, offset=t.offset), self._parts[i]
            for k in range(0, t.numel, FOLD_ELEMENTS):   # block by block: the scratch stays small
                m = min(FOLD_ELEMENTS, t.numel - k)
                values = self._f64[:m]
                np.copyto(values, part[k:k + m], casting="unsafe")
                values /= _SCALE * self.total_weight
                if DTYPES[t.dtype].kind != "f":
                    np.rint(values, out=values)
                out[k:k + m] = values
            if release:
                self._parts[i] = None
        if release:
            self._poisoned = "its mean was taken and its memory released"
        return blob

    def mean(self) -> dict[str, np.ndarray]:
        """The weighted mean, cast back to each tensor's dtype (views over mean_blob())."""
        return decode(self.layout, self.mean_blob())


class MaskedSum:
    """Σ y_u mod 2**32 over secure aggregation's masked inputs (U32 blobs), folded piece by piece.

    Wrap-around is the point: masks are uniform mod 2**32 and cancel only in the
    modular sum. Nothing here can tell a masked vector from noise, by design.
    """

    def __init__(self, layout: Layout):
        if any(t.dtype != "U32" for t in layout.tensors):
            raise TypeError("a masked layout holds U32 tensors only")
        self.layout = layout
        self.acc = np.zeros(layout.total_elements, dtype=np.uint32)
        self.count = 0
        self._poisoned = ""

    def fold(self, pieces: Iterable[bytes | memoryview], *, nbytes: int) -> None:
        """Add one masked blob; its declared length is checked before anything is added."""
        if nbytes != self.layout.total_bytes:
            raise IntegrityError(f"masked input has {nbytes} bytes; the layout needs {self.layout.total_bytes}")
        if self._poisoned:
            raise IntegrityError(f"this round's masked sum is unusable: {self._poisoned}")
        pending, element = bytearray(), 0
        try:
            for piece in pieces:
                pending += piece
                whole = len(pending) // 4
                if element + whole > self.acc.size:
                    break
                self.acc[element:element + whole] += np.frombuffer(pending, dtype="<u4", count=whole)
                del pending[:whole * 4]
                element += whole
        except BaseException as exc:
            self._poisoned = f"folding a masked input failed part-way ({type(exc).__name__})"
            raise
        if pending or element != self.acc.size:
            self._poisoned = "a masked input broke its declared length"
            raise IntegrityError(f"this round's masked sum is unusable: {self._poisoned}")
        self.count += 1
