"""Streaming, exact weighted sums of model updates.

Each update is quantised to 64-bit fixed point *before* it is folded in, so the
running sum is integer arithmetic: associative, hence the same bits whatever
order the sites' updates arrive in. That is what makes a seeded federated run
reproducible bit for bit. Memory is one int64 per model element, whatever the
number of sites.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from plexus.errors import IntegrityError, Reason, RoundClosed
from plexus.files import Blocks
from plexus.wire import DTYPES, Layout, decode

FRAC_BITS = 32                  # resolution 2**-32 ≈ 2.3e-10, finer than float32 for |x| > 2**-9
_SCALE = float(2 ** FRAC_BITS)
_LIMIT = float(2 ** 62)         # headroom below int64's 2**63 so no partial sum can overflow
MAX_WEIGHT = 2 ** 31
FOLD_ELEMENTS = 1 << 16         # elements per step: the float64 scratch (512 KiB) stays in L2 cache
# Quantising by addition: for |v| < 2**19, the float64 v + 1.5·2**20 lies in [2**20, 2**21), whose spacing
# is 2**-32, so the addition itself rounds v to the fixed-point grid (half to even, as rint), and the
# result's bit pattern is _MAGIC_BITS + rint(v·2**32). Adding those bit patterns as int64 is the exact
# fixed-point sum plus _MAGIC_BITS per update, which the mean takes off again (mod 2**64, so wrapping on
# the way does no harm). One float add replaces multiply, rint and a slow float→int64 conversion.
_MAGIC = 1.5 * 2.0 ** 20
_MAGIC_BITS = int(np.array(_MAGIC).view(np.int64))
_MAGIC_INT64 = np.int64(_MAGIC_BITS)
_FAST_LIMIT = 2.0 ** 18         # weight · max|x| below this takes the addition path, with margin


class WeightedSum:
    """Σ w_k · x_k over updates that share one layout, folded piece by piece as they arrive.

    Several updates may stream in at once (begin() each); their pieces are folded one at a time
    under a lock, so the sum is never touched by two folds together. Integer arithmetic is
    exactly invertible, so an update that fails part-way is taken out again (Fold.undo) and the
    sum is as if it had never arrived.
    """

    def __init__(self, layout: Layout, *, sites: int = 1):
        self.layout = layout
        # One int64 array per tensor, so the mean can hand each one back as soon as it is written.
        self._parts: list[np.ndarray | None] = [None] * len(layout.tensors)
        self._f64 = np.empty(FOLD_ELEMENTS, np.float64)   # scratch, reused by every fold
        self._bits = self._f64.view(np.int64)
        self._i64 = np.empty(FOLD_ELEMENTS, np.int64)
        self._lock = threading.Lock()
        self.reset(sites=sites)

    def reset(self, *, sites: int = 1) -> None:
        """Empty the sum for a new round of updates from `sites` sites, reusing its memory: zeroing resident
        pages costs a fraction of faulting in fresh ones, which at 50M parameters took longer than folding
        an update. Each site's update may take only its 1/sites part of the fixed-point range, so no one
        site can leave too little range for the others' honest updates."""
        for i, t in enumerate(self.layout.tensors):
            if self._parts[i] is None:
                self._parts[i] = np.zeros(t.numel, dtype=np.int64)
            else:
                self._parts[i].fill(0)
        self.total_weight = 0
        self.count = 0   # complete updates in the sum
        self._magic = 0  # dense folds among them: each element carries _magic × _MAGIC_BITS extra
        self.sites = max(1, sites)
        self._bound = 0.0
        self._poisoned = ""

    def check_fits(self, weight: int, max_abs: float, *, reserved: float = 0.0) -> None:
        """Refuse an update that could overflow the exact range, or take more than its site's part of it;
        call before fold(). `reserved`: what this update already holds of the range (weight × its peak)."""
        if not 0 < weight <= MAX_WEIGHT:   # fractional weights (staleness-scaled) fold exactly as well
            raise IntegrityError(f"an update's weight must be in (0, {MAX_WEIGHT}]; got {weight}",
                                 reason=Reason.NUM_SAMPLES)
        if (self._bound - reserved + weight * max_abs) * _SCALE >= _LIMIT:
            raise IntegrityError(
                f"update too large to aggregate exactly: max |value| {max_abs:.3g} × num_samples {weight} "
                f"exceeds the fixed-point range (Σ n·|x| < {_LIMIT / _SCALE:.3g}); the site's training "
                "has probably diverged", reason=Reason.NORM)
        if weight * max_abs * _SCALE >= _LIMIT / self.sites:
            raise IntegrityError(
                f"update too large to aggregate exactly: max |value| {max_abs:.3g} × weight {weight} exceeds one "
                f"site's part of the fixed-point range (Σ n·|x| < {_LIMIT / _SCALE:.3g}, shared equally by the "
                f"round's {self.sites} site(s)); the site's training has probably diverged", reason=Reason.NORM)

    def begin(self, weight: int) -> Fold:
        """Start adding one update of this weight, piece by piece (Fold.add), as it arrives."""
        self.check_fits(weight, 0.0)
        self._require_clean()
        return Fold(self, weight)

    def begin_exact(self, weight: int, updates: int) -> ExactFold:
        """Start adding a relay's partial sum (`updates` updates of total weight `weight`), in exact_layout."""
        if not 0 < weight <= MAX_WEIGHT * max(1, updates) or updates < 1:
            raise IntegrityError(f"a partial sum's weight must be in (0, {MAX_WEIGHT} × its updates] with at least "
                                 f"one update; got weight {weight} over {updates} update(s)",
                                 reason=Reason.NUM_SAMPLES)
        self._require_clean()
        return ExactFold(self, weight, updates)

    def exact(self) -> np.ndarray:
        """The whole sum as exact fixed point, one I64 per element in layout order (what a relay sends up)."""
        return self.acc

    def fold(self, pieces: Iterable[bytes | memoryview], weight: int, max_abs: float, *, nbytes: int) -> None:
        """Add weight × (an update blob of nbytes, arriving as consecutive pieces) in one call.

        Everything that can be checked up front is, so a refused update leaves the sum untouched.
        The pieces cannot be read twice, so should they then disagree with nbytes (a source
        changing under us), the sum is poisoned and mean() refuses.
        """
        total = self.layout.total_bytes
        if nbytes != total:
            raise IntegrityError(f"update blob has {nbytes} bytes; the layout needs {total}; it was not folded",
                                 reason=Reason.SIZE)
        self.check_fits(weight, max_abs)
        fold = self.begin(weight)
        try:
            for piece in pieces:
                fold.add(piece, max_abs)
            fold.finish()
        except BaseException as exc:
            if not self._poisoned:
                self._poisoned = (f"an update declared {total} bytes but delivered {fold.received}"
                                  if isinstance(exc, IntegrityError) else
                                  f"folding an update failed part-way ({type(exc).__name__})")
            self._require_clean()
            raise

    @property
    def parts(self) -> tuple[np.ndarray | None, ...]:
        """The int64 sum of each tensor (the memory itself, not a copy); None where mean_blob released it."""
        return tuple(self._parts)

    @property
    def acc(self) -> np.ndarray:
        """The whole fixed-point sum as one array (a copy, for inspection)."""
        self._require_clean()
        parts = [part - _as_int64(self._magic * _MAGIC_BITS) for part in self._parts]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def sums(self) -> dict[str, np.ndarray]:
        """Σ w_k · x_k per tensor as float64 (the fixed-point sum, converted once): for a caller that divides by
        something other than the total weight, or subtracts another sum first (asynchronous deltas)."""
        self._require_clean()
        out = {}
        for t, part in zip(self.layout.tensors, self._parts):
            fixed = part - _as_int64(self._magic * _MAGIC_BITS)   # wraps back
            out[t.name] = (fixed.astype(np.float64) / _SCALE).reshape(t.shape)
        return out

    def _require_clean(self) -> None:
        if self._poisoned:
            raise IntegrityError(f"this round's sum is unusable: {self._poisoned}; the round must fail")

    def _fold_after(self, position: int, pending: bytearray, data: memoryview, weight: int, max_abs: float,
                    sign: int) -> int:
        """Fold data that follows `pending` (the bytes of an element split by the last piece edge); returns
        the bytes folded, leaving any new split element in `pending`. Call with the lock held."""
        if pending:   # an element straddled the last edge: fold through the small buffer
            pending += data
            used = self.fold_bytes(position, memoryview(pending), weight, max_abs, sign)
            del pending[:used]
        else:         # the common case: straight from the piece, no copy
            used = self.fold_bytes(position, data, weight, max_abs, sign)
            pending += data[used:]
        return used

    def fold_bytes(self, position: int, data: memoryview, weight: int, max_abs: float, sign: int) -> int:
        """Add (sign 1) or take back (sign -1) as many whole elements of data, starting at blob byte
        position, as there are; returns the bytes used. Call with the lock held.

        Every element adds _MAGIC_BITS + rint(fl(x·w)·2**32) (fl: float64 rounding, exact unless x·w
        needs more than 53 bits). Small values get there by one float addition; the rest multiply,
        round and convert. Both give the same integers, so the path never changes the sum.
        """
        fast = weight * max_abs < _FAST_LIMIT
        combine = np.add if sign > 0 else np.subtract
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
                scaled, target = self._f64[:m], into[elem + k:elem + k + m]
                np.copyto(scaled, values, casting="unsafe")    # exact for every float and int below 2**53
                if fast:
                    if weight != 1:
                        np.multiply(scaled, float(weight), out=scaled)
                    np.add(scaled, _MAGIC, out=scaled)
                    combine(target, self._bits[:m], out=target)
                else:
                    fixed = self._i64[:m]
                    np.multiply(scaled, weight * _SCALE, out=scaled)   # = fl(x·w)·2**32: a power of two is exact
                    np.rint(scaled, out=scaled)
                    np.copyto(fixed, scaled, casting="unsafe")        # integral values below 2**62: exact
                    np.add(fixed, _MAGIC_INT64, out=fixed)
                    combine(target, fixed, out=target)
            used += n * dtype.itemsize
        return used

    def fold_piece(self, piece, weight: int, sign: int) -> None:
        """Add (sign 1) or take back (sign -1) w·v of one decoded piece (plexus.compression's DensePiece at
        [start, start + len) or SparsePiece at its indices) as the integers rint(fl(v·w)·2**32), with no
        _MAGIC_BITS: elements a piece does not name add nothing. Call with the lock held."""
        part = self._parts[piece.tensor]
        values = np.asarray(piece.values, dtype=np.float64)
        indices = getattr(piece, "indices", None)
        for k in range(0, values.size, FOLD_ELEMENTS):
            scaled = values[k:k + FOLD_ELEMENTS] * float(weight)   # fl(v·w)
            scaled *= _SCALE                                        # a power of two: exact
            fixed = np.rint(scaled).astype(np.int64)
            if indices is None:
                start = piece.start + k
                target = part[start:start + fixed.size]
                (np.add if sign > 0 else np.subtract)(target, fixed, out=target)
            else:   # indices within a piece are distinct (strictly increasing): fancy-index add is exact
                where = indices[k:k + FOLD_ELEMENTS]
                part[where] = (part[where] + fixed) if sign > 0 else (part[where] - fixed)

    def mean_blob(self, *, release: bool = False) -> np.ndarray:
        """The weighted mean as a wire blob, written block by block.

        With release=True each tensor's part of the sum is freed once written, so the peak is
        the sum plus one tensor rather than the sum plus the whole new model; the sum is spent
        until reset().
        """
        self._require_mean()
        # calloc'd: pages become resident only as tensors are written, while released parts shrink.
        blob = np.zeros(self.layout.total_bytes, dtype=np.uint8)
        for i, t in enumerate(self.layout.tensors):
            out = np.frombuffer(blob, dtype=DTYPES[t.dtype], count=t.numel, offset=t.offset)
            for k in range(0, t.numel, FOLD_ELEMENTS):
                self._mean_into(i, k, out[k:k + FOLD_ELEMENTS])
            if release:
                self._parts[i] = None
        if release:
            self._poisoned = "its mean was taken and its memory released"
        return blob

    def mean_blocks(self, *, kept: int = 1, elements: int = FOLD_ELEMENTS) -> Blocks:
        """The mean's wire blob as consecutive blocks of at most `elements` elements, computed as they are
        taken: written straight into a file, the mean never exists whole in memory. Each block is valid until
        `kept` more are taken (they are written into `kept` buffers in turn); the sum is kept (reset() empties
        it)."""
        self._require_mean()
        return Blocks(self._mean_blocks(kept, elements), kept)

    def _mean_blocks(self, kept: int, elements: int) -> Iterator[memoryview]:
        scratch, turn = {}, itertools.count()
        for i, t in enumerate(self.layout.tensors):
            dtype = DTYPES[t.dtype]
            if dtype not in scratch:
                scratch[dtype] = [np.empty(elements, dtype) for _ in range(kept)]
            for k in range(0, t.numel, elements):
                out = scratch[dtype][next(turn) % kept][:min(elements, t.numel - k)]
                for j in range(0, len(out), FOLD_ELEMENTS):
                    self._mean_into(i, k + j, out[j:j + FOLD_ELEMENTS])
                yield memoryview(out).cast("B")

    def _require_mean(self) -> None:
        self._require_clean()
        if self.total_weight == 0:
            raise IntegrityError("no update was aggregated; there is no mean to take")

    def _mean_into(self, i: int, k: int, out: np.ndarray) -> None:
        """Elements k.. of tensor i's mean, len(out) of them, cast to its dtype into out."""
        m = len(out)
        fixed, values = self._i64[:m], self._f64[:m]
        np.subtract(self._parts[i][k:k + m], _as_int64(self._magic * _MAGIC_BITS), out=fixed)   # wraps back
        np.copyto(values, fixed, casting="unsafe")
        values /= _SCALE * self.total_weight
        if out.dtype.kind != "f":
            np.rint(values, out=values)
        np.copyto(out, values, casting="unsafe")

    def mean(self) -> dict[str, np.ndarray]:
        """The weighted mean, cast back to each tensor's dtype (views over mean_blob())."""
        return decode(self.layout, self.mean_blob())


class _Entering:
    """What every update entering a WeightedSum shares: its state, and leaving the sum's books when undone."""

    total: WeightedSum
    weight: int
    state: str
    _peak: float

    @property
    def peak(self) -> float:
        """The largest |value| folded so far (what the update holds of its sum's range, per unit weight)."""
        return self._peak

    def _leave(self, *, dense: bool) -> None:
        """Give back its part of the range and, if it had finished, its count and weight. Lock held."""
        total = self.total
        total._bound -= self.weight * self._peak
        if self.state == "done":
            total.count -= 1
            total._magic -= int(dense)
            total.total_weight -= self.weight
        self.state = "undone"

    def _require_open(self) -> None:
        if self.state != "open":
            raise RoundClosed("this update was taken out of the round's sum: the round closed while it was "
                              "arriving, or it was refused")


class Fold(_Entering):
    """One update entering a WeightedSum piece by piece (WeightedSum.begin).

    add() folds each piece as it arrives; finish() counts the update once it is complete; undo()
    takes out what was added, reading the same bytes again from the caller's journal (the engine's
    spool file), whether the update is part-way or complete. After undo() the update is out for
    good and add()/finish() refuse.
    """

    def __init__(self, total: WeightedSum, weight: int):
        self.total, self.weight = total, weight
        self.position = 0        # bytes folded so far: always whole elements
        self.received = 0        # bytes handed to add()
        self._pending = bytearray()   # only an element split across two pieces is ever copied here
        self._peak = 0.0         # max |value| seen, reserved in the sum's range
        self.state = "open"      # open | done | undone

    def add(self, piece: bytes | memoryview, max_abs: float) -> None:
        """Fold the next piece; max_abs bounds |value| over the update so far (the Receiver's running max)."""
        total = self.total
        with total._lock:
            self._require_open()
            if max_abs > self._peak:   # reserve the range before anything is added
                total.check_fits(self.weight, max_abs, reserved=self.weight * self._peak)
                total._bound += self.weight * (max_abs - self._peak)
                self._peak = max_abs
            data = memoryview(piece).cast("B")
            self.received += len(data)
            if self.received > total.layout.total_bytes:
                raise IntegrityError(f"update has more than the {total.layout.total_bytes} bytes its layout needs",
                                     reason=Reason.SIZE)
            self.position += total._fold_after(self.position, self._pending, data, self.weight, self._peak, 1)

    def finish(self) -> None:
        """The update is complete: it now counts in the mean."""
        total = self.total
        with total._lock:
            self._require_open()
            if self._pending or self.position != total.layout.total_bytes:
                raise IntegrityError(f"update ended after {self.received} of {total.layout.total_bytes} bytes",
                                     reason=Reason.SIZE)
            self.state = "done"
            total.count += 1
            total._magic += 1
            total.total_weight += self.weight

    def undo(self, journal) -> None:
        """Take this update back out of the sum. `journal()` returns the bytes passed to add(), from the
        first, as an iterable of pieces (split anywhere); only the folded prefix is read. Safe to call
        from any thread, any number of times."""
        total = self.total
        with total._lock:
            if self.state == "undone":
                return
            position = _replay(journal, self.position,
                               lambda at, pending, data: total._fold_after(at, pending, data, self.weight, self._peak,
                                                                           -1))
            if position != self.position:
                total._poisoned = (f"an update could not be taken out again: its journal held {position} of the "
                                   f"{self.position} bytes folded")
            self._leave(dense=True)


class CodedFold(_Entering):
    """One compressed update (plexus.compression) entering a WeightedSum as it streams: each wire chunk goes
    through the codec's Decoder, and every decoded piece is folded exactly, dense pieces over their element
    range and sparse pieces scatter-added at their indices. Each element adds rint(fl(v·w)·2**32), the same
    integer a dense fold of the decoded update adds there, so the streamed fold equals the dense fold of the
    decoded update bit for bit; nothing dense is ever built. undo() decodes the journal again and subtracts.
    """

    def __init__(self, total: WeightedSum, weight: int, decoder):
        total.check_fits(weight, 0.0)
        total._require_clean()
        self.total, self.weight = total, weight
        self.decoder = decoder()          # a fresh Decoder for the stream
        self._new_decoder = decoder
        self.received = 0                 # wire bytes fed to the decoder and folded
        self._peak = 0.0
        self.state = "open"               # open | done | undone

    @property
    def norm(self) -> float:
        """The L2 norm of the decoded update so far (DP's clip check)."""
        return float(np.sqrt(self.decoder.sum_sq))

    def add(self, piece: bytes | memoryview, max_abs: float = 0.0) -> None:
        """Decode the next wire chunk and fold what it completes (max_abs is the wire's; the decoded peak counts)."""
        total = self.total
        with total._lock:
            self._require_open()
            pieces = list(self.decoder.feed(piece))
            peak = self.decoder.max_abs
            if peak > self._peak:   # reserve the range before anything is added
                total.check_fits(self.weight, peak, reserved=self.weight * self._peak)
                total._bound += self.weight * (peak - self._peak)
                self._peak = peak
            for p in pieces:
                total.fold_piece(p, self.weight, 1)
            self.received += len(memoryview(piece).cast("B"))

    def finish(self) -> None:
        total = self.total
        with total._lock:
            self._require_open()
            self.decoder.finish()
            self.state = "done"
            total.count += 1
            total.total_weight += self.weight

    def undo(self, journal) -> None:
        """Take this update back out: the first `received` journal bytes decoded again, every piece subtracted."""
        total = self.total
        with total._lock:
            if self.state == "undone":
                return
            decoder, left = self._new_decoder(), self.received
            try:
                for block in journal():
                    data = memoryview(block).cast("B")[:left]
                    left -= len(data)
                    for p in decoder.feed(data):
                        total.fold_piece(p, self.weight, -1)
                    if left <= 0:
                        break
            except IntegrityError as exc:   # the journal no longer decodes as it did
                total._poisoned = f"a compressed update could not be taken out again: {exc}"
            if left > 0:
                total._poisoned = (f"a compressed update could not be taken out again: its journal held "
                                   f"{self.received - left} of the {self.received} bytes folded")
            self._leave(dense=False)


def exact_layout(layout: Layout) -> Layout:
    """The layout of a partial sum of updates of `layout`: each tensor as I64 fixed point (value · 2**32)."""
    return Layout.build([(t.name, "I64", t.shape) for t in layout.tensors])


class ExactFold(_Entering):
    """A relay's partial sum entering a WeightedSum (WeightedSum.begin_exact): its I64 elements are already
    Σ rint(fl(x·w)·2**32) over the relay's children, the very integers their updates would have added here, so
    they are added as they are and the mean is the one a flat federation of the same sites gets, bit for bit.
    It counts `updates` updates and the weight `weight` (the children's total)."""

    def __init__(self, total: WeightedSum, weight: int, updates: int):
        self.total, self.weight, self.updates = total, weight, updates
        self.position = 0        # bytes folded so far: whole elements
        self.received = 0
        self._pending = bytearray()
        self._peak = 0.0         # max |value| of the sum (in model units), reserved in the range
        self.state = "open"

    def add(self, piece: bytes | memoryview, max_abs: float) -> None:
        """Fold the next piece; max_abs: the largest |I64| element so far (the Receiver's running max)."""
        total = self.total
        with total._lock:
            self._require_open()
            value = max_abs / _SCALE
            if value > self._peak:   # the sum holds Σ w·|x| ≤ its largest element, as one entry of the range
                if value * _SCALE >= _LIMIT / total.sites:   # as a site of the relay's whole weight would be
                    raise IntegrityError(f"a relay's partial sum (largest |element| {value:.3g}) takes more than one "
                                         f"participant's part of the fixed-point range (Σ n·|x| < "
                                         f"{_LIMIT / _SCALE:.3g}, shared equally by the round's {total.sites} "
                                         "site(s) and relay(s)); its children's training has probably diverged",
                                         reason=Reason.NORM)
                if (total._bound - self._peak + value) * _SCALE >= _LIMIT:
                    raise IntegrityError(f"a relay's partial sum (largest |element| {value:.3g}) overflows the "
                                         f"fixed-point range (Σ n·|x| < {_LIMIT / _SCALE:.3g}) with the round's "
                                         "other updates; its children's training has probably diverged",
                                         reason=Reason.NORM)
                total._bound += value - self._peak
                self._peak = value
            data = memoryview(piece).cast("B")
            self.received += len(data)
            if self.received > total.layout.total_elements * 8:
                raise IntegrityError(f"partial sum has more than the {total.layout.total_elements * 8} bytes its "
                                     "layout needs", reason=Reason.SIZE)
            self.position += self._fold_after(self.position, self._pending, data, 1)

    def _fold_after(self, position: int, pending: bytearray, data: memoryview, sign: int) -> int:
        if pending:
            pending += data
            data = memoryview(bytes(pending))
            pending.clear()
        whole = min(len(data) // 8, self.total.layout.total_elements - position // 8)
        combine = np.add if sign > 0 else np.subtract
        element, used, lo = position // 8, 0, 0
        for t, into in zip(self.total.layout.tensors, self.total._parts):
            hi = lo + t.numel
            if lo <= element + used < hi and used < whole:
                n = min(hi - (element + used), whole - used)
                values = np.frombuffer(data, dtype="<i8", count=n, offset=used * 8)
                target = into[element + used - lo:element + used - lo + n]
                combine(target, values, out=target)   # mod 2**64: exact while the range checks hold
                used += n
            lo = hi
        pending += data[used * 8:]
        return used * 8

    def finish(self) -> None:
        total = self.total
        with total._lock:
            self._require_open()
            if self._pending or self.position != total.layout.total_elements * 8:
                raise IntegrityError(f"partial sum ended after {self.received} of {total.layout.total_elements * 8} "
                                     "bytes", reason=Reason.SIZE)
            self.state = "done"
            total.count += self.updates
            total.total_weight += self.weight

    def undo(self, journal) -> None:
        total = self.total
        with total._lock:
            if self.state == "undone":
                return
            position = _replay(journal, self.position,
                               lambda at, pending, data: self._fold_after(at, pending, data, -1))
            if position != self.position:
                total._poisoned = (f"a partial sum could not be taken out again: its journal held {position} of "
                                   f"the {self.position} bytes folded")
            total._bound -= self._peak
            if self.state == "done":
                total.count -= self.updates
                total.total_weight -= self.weight
            self.state = "undone"


def _replay(journal, folded: int, fold) -> int:
    """Fold the first `folded` bytes of `journal()` (pieces split anywhere) again with `fold(at, pending, data)`,
    which folds whole elements from byte `at` on and keeps a split one in `pending`; the bytes it folded. How every
    update that fails is taken back out of its sum."""
    if folded <= 0:
        return 0   # nothing to read back: its journal may never have been written (a full disk)
    pending, position = bytearray(), 0
    for piece in journal():
        if position + len(pending) >= folded:
            break
        position += fold(position, pending, memoryview(piece).cast("B")[:folded - position - len(pending)])
    return position


def _as_int64(value: int) -> np.int64:
    """An integer mod 2**64, as the int64 with the same bits."""
    value %= 2 ** 64
    return np.int64(value - 2 ** 64 if value >= 2 ** 63 else value)


_MASKED_DTYPES = ("U8", "U16", "U32")


class MaskedSum:
    """Σ y_u mod 2**m over secure aggregation's masked inputs (blobs of U8, U16 or U32: the round's field, m = 8,
    16 or 32 bits), folded piece by piece.

    Wrap-around is the point: masks are uniform mod 2**m and cancel only in the
    modular sum. Nothing here can tell a masked vector from noise, by design.
    """

    def __init__(self, layout: Layout):
        widths = {t.dtype for t in layout.tensors}
        if len(widths) > 1 or not widths <= set(_MASKED_DTYPES):
            raise TypeError(f"a masked layout holds tensors of one of {', '.join(_MASKED_DTYPES)}, all alike; "
                            f"got {', '.join(sorted(widths))}")
        self.layout = layout
        self.dtype = DTYPES[widths.pop() if widths else "U32"]   # little-endian unsigned, the field's width
        self.acc = np.zeros(layout.total_elements, dtype=self.dtype.newbyteorder("="))
        self.count = 0
        self._poisoned = ""
        self._lock = threading.Lock()

    def begin(self) -> MaskedFold:
        """Start adding one masked input piece by piece (MaskedFold.add), as it arrives."""
        self._require_clean()
        return MaskedFold(self)

    def fold(self, pieces: Iterable[bytes | memoryview], *, nbytes: int) -> None:
        """Add one masked blob; its declared length is checked before anything is added."""
        if nbytes != self.layout.total_bytes:
            raise IntegrityError(f"masked input has {nbytes} bytes; the layout needs {self.layout.total_bytes}",
                                 reason=Reason.SIZE)
        fold = self.begin()
        try:
            for piece in pieces:
                fold.add(piece)
            fold.finish()
        except BaseException as exc:
            if not self._poisoned:
                self._poisoned = ("a masked input broke its declared length" if isinstance(exc, IntegrityError)
                                  else f"folding a masked input failed part-way ({type(exc).__name__})")
            self._require_clean()
            raise

    def _require_clean(self) -> None:
        if self._poisoned:
            raise IntegrityError(f"this round's masked sum is unusable: {self._poisoned}")

    def _fold_after(self, element: int, pending: bytearray, data: memoryview, sign: int) -> int:
        """Add (sign 1) or take back (sign -1) the whole elements of pending + data from `element` on; returns
        the elements used, leaving a split element in `pending`. Call with the lock held."""
        if pending:
            pending += data
            data = memoryview(bytes(pending))
            pending.clear()
        size = self.dtype.itemsize
        whole = min(len(data) // size, self.acc.size - element)
        values = np.frombuffer(data, dtype=self.dtype, count=whole)
        target = self.acc[element:element + whole]
        (np.add if sign > 0 else np.subtract)(target, values, out=target)   # mod 2**m, as the masks need
        pending += data[whole * size:]
        return whole


class MaskedFold:
    """One masked input entering a MaskedSum piece by piece (MaskedSum.begin); like Fold, undo() takes
    what was added out again from the caller's journal, and it then counts for nothing."""

    def __init__(self, total: MaskedSum):
        self.total = total
        self.position = 0        # elements folded so far
        self.received = 0        # bytes handed to add()
        self._pending = bytearray()
        self.state = "open"      # open | done | undone

    def add(self, piece: bytes | memoryview, max_abs: float = 0.0) -> None:
        """Fold the next piece (max_abs is unused: masked values are uniform mod 2**m)."""
        total = self.total
        with total._lock:
            self._require_open()
            data = memoryview(piece).cast("B")
            self.received += len(data)
            if self.received > total.layout.total_bytes:
                raise IntegrityError(f"masked input has more than the {total.layout.total_bytes} bytes its layout "
                                     "needs", reason=Reason.SIZE)
            self.position += total._fold_after(self.position, self._pending, data, 1)

    def finish(self) -> None:
        """The masked input is complete: it now counts in the sum."""
        total = self.total
        with total._lock:
            self._require_open()
            if self._pending or self.position != total.acc.size:
                raise IntegrityError(f"masked input ended after {self.received} of {total.layout.total_bytes} "
                                     "bytes", reason=Reason.SIZE)
            self.state = "done"
            total.count += 1

    def undo(self, journal) -> None:
        """Take this masked input back out of the sum, reading the bytes passed to add() again from
        `journal()` (an iterable of pieces); safe to call any number of times."""
        total = self.total
        with total._lock:
            if self.state == "undone":
                return
            size = total.dtype.itemsize   # MaskedSum counts elements; the journal holds bytes
            position = _replay(journal, self.position * size,
                               lambda at, pending, data: size * total._fold_after(at // size, pending, data, -1))
            position //= size
            if position != self.position:
                total._poisoned = (f"a masked input could not be taken out again: its journal held {position} of "
                                   f"the {self.position} elements folded")
            if self.state == "done":
                total.count -= 1
            self.state = "undone"

    def _require_open(self) -> None:
        if self.state != "open":
            raise RoundClosed("this masked input was taken out of the round's sum: the round closed while it was "
                              "arriving, or it was refused")
