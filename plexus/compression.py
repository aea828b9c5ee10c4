"""Update compression: uplink codecs for a site's Δ = trained − served, downlink codecs for the served model,
and the streaming Decoder the coordinator folds compressed updates from.

An uplink codec turns each float tensor `n` of Δ into wire entries `n/<codec>.<part>` (plain wire tensors, so
an update is still one `plexus.wire` layout and blob); a non-float tensor travels as `n/dense.values`, exact.
Names sort so that an entry's scales or gaps arrive before the values they govern. The coordinator never
rebuilds a dense update from a sparse one: the Decoder checks the codec's semantics as the bytes stream in and
hands out pieces (dense runs or sparse index/value sets) whose values are exactly what `decode` computes.

numpy only: the coordinator imports this module and never imports torch.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from plexus.errors import IntegrityError, Reason
from plexus.wire import DTYPES, FLOAT_DTYPES, Layout, TensorMeta

F32 = np.dtype("<f4")
MIN_BLOCK, MAX_BLOCK = 16, 65536
# The wire dtypes a sparse codec's gaps may take (the site picks per tensor) and the largest step between two
# sent indices each holds: a longer one is bridged by fillers.
MAX_GAP = {"U8": 255, "U16": 65535}
_DENSE = "dense.values"


class Gaps(NamedTuple):
    """How one tensor's sparse entries travel: m entries (fillers included), gaps of wire dtype `dtype`."""

    m: int
    dtype: str   # a key of MAX_GAP


@dataclass(frozen=True)
class DensePiece:
    """Decoded values of model tensor number `tensor` at flat positions [start, start + len(values))."""

    tensor: int
    start: int
    values: np.ndarray   # float64, each value exactly the float32 (or integer) decode() yields


@dataclass(frozen=True)
class SparsePiece:
    """Decoded values of model tensor number `tensor` at `indices`; every other position decodes to 0."""

    tensor: int
    indices: np.ndarray   # int64, strictly increasing
    values: np.ndarray    # float64, each value exactly the float32 decode() yields


Piece = DensePiece | SparsePiece


def k_of(numel: int, *, fraction: float | None = None, k: int | None = None) -> int:
    """How many entries topk/randk send for a tensor of numel elements: min(N, k) or max(1, ceil(fraction·N)),
    never more than N."""
    if k is not None:
        return min(numel, int(k))
    if fraction is None:
        raise ValueError("k_of needs exactly one of fraction and k")
    # round() first: 0.3 × 10 is 3.0000000000000004 in floating point and must not become 4.
    return min(numel, max(1, math.ceil(round(fraction * numel, 9))))


@functools.lru_cache(maxsize=32)
def randk_indices(seed: int, round_: int, name: str, numel: int, k: int) -> np.ndarray:
    """The k coordinates randk sends for tensor `name` in round `round_`, sorted (int64), drawn without
    replacement from PCG64 seeded by SHA-256 of "plexus/v1/randk/<seed>/<round>/<name>", so every site and the
    coordinator draw the same set without sending it.

    Only PCG64's raw 64-bit output is used (numpy keeps bit generators' streams stable across versions, but not
    Generator methods such as choice), mapped to [0, numel) by a 128-bit multiply-shift: sites and a coordinator
    on different numpy releases still agree."""
    if not 0 <= k <= numel:
        raise ValueError(f"randk: cannot draw {k} of {numel} coordinates")
    if k == numel:
        every = np.arange(numel, dtype=np.int64)
        every.flags.writeable = False
        return every
    digest = hashlib.sha256("/".join(["plexus/v1", "randk", str(seed), str(round_), name]).encode()).digest()
    bits = np.random.PCG64(int.from_bytes(digest, "big"))
    n = np.uint64(numel)
    picked = np.empty(0, np.int64)
    while picked.size < k:   # the first k distinct draws of the stream, in stream order
        want = k - picked.size
        raw = bits.random_raw(want + want // 8 + 16).astype(np.uint64)
        hi, lo = raw >> np.uint64(32), raw & np.uint64(0xFFFFFFFF)
        draw = ((hi * n + ((lo * n) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)   # floor(raw·numel/2**64)
        _, first = np.unique(draw, return_index=True)
        fresh = draw[np.sort(first)]
        fresh = fresh[~np.isin(fresh, picked)]
        picked = np.concatenate([picked, fresh[:want]])
    picked.sort()
    picked.flags.writeable = False   # cached: every decoder of the round shares this one array
    return picked


# What a codec uses where the config leaves its key out (plexus.config keeps None for "not given").
DEFAULT_BLOCK, DEFAULT_BIN_CONV, DEFAULT_BIN_DENSE = 256, 50, 500


def _default(value, default):
    return default if value is None else value


def _wire_layout(model: Layout, parts) -> Layout:
    """Each float tensor n of `model` as its codec's entries n/<part> (`parts(t)`: (part, dtype, shape) triples),
    any other tensor as n/dense.values in its own dtype."""
    specs = []
    for t in model.tensors:
        _check_name(t.name)
        if t.dtype not in FLOAT_DTYPES:
            specs.append((f"{t.name}/{_DENSE}", t.dtype, (t.numel,)))
        else:
            specs += [(f"{t.name}/{part}", dtype, shape) for part, dtype, shape in parts(t)]
    return Layout.build(specs)


def _check_name(name: str) -> None:
    if "/" in name:
        raise ValueError(f"tensor name {name!r} contains '/'; compressed updates name their entries "
                         "'<tensor>/<codec>.<part>', so model tensor names must not")


def _require_finite(name: str, values: np.ndarray, what: str = "Δ") -> None:
    if values.size and not np.isfinite(values).all():
        at = int(np.flatnonzero(~np.isfinite(values))[0])
        raise IntegrityError(f"{what} of tensor {name!r} is {values[at]} at element {at}; refusing to encode "
                             "a non-finite update", reason=Reason.NON_FINITE)


def _block_peaks(x: np.ndarray, block: int) -> np.ndarray:
    """max |x| over each run of `block` elements (the last run may be shorter)."""
    if not x.size:
        return np.zeros(0, x.dtype)
    return np.maximum.reduceat(np.abs(x), np.arange(0, x.size, block))


def _dequant(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q · scale in float32: the one place int8 values become numbers, on both ends (an overflow to ±Inf is
    refused by the caller)."""
    with np.errstate(over="ignore"):
        return q.astype(F32) * scales.astype(F32, copy=False)


def _block_scales(scales: np.ndarray, start: int, count: int, block: int) -> np.ndarray:
    return scales[np.arange(start, start + count) // block]


# Uplink -----------------------------------------------------------------------------------------

class UplinkCodec:
    """How a site's update travels up: the base of the codecs in UPLINK.

    The codecs other than 'none' compress each float tensor of Δ. `feedback`: the site keeps a residual R,
    encodes G = Δ + R and keeps G − sent (exactly) for the next round. `shared_indices`: every site's entries
    are the same coordinates, so a masked sum (secure aggregation) of the entries means something.
    """

    name: ClassVar[str] = "none"
    shared_indices: ClassVar[bool] = True

    def __init__(self, spec, *, seed: int):
        self.spec = spec
        self.seed = int(seed)
        self.feedback = False

    def wire_layout(self, model: Layout, *, round_: int, counts: Mapping[str, Gaps] | None = None) -> Layout:
        """The layout an update for `model` must have (counts: topk's and adacomp's data-dependent m and gaps
        dtype per tensor, as the site chose them)."""
        return _wire_layout(model, lambda t: self._parts(t, counts))

    def _parts(self, t: TensorMeta, counts: Mapping[str, Gaps] | None) -> list[tuple[str, str, tuple[int, ...]]]:
        raise NotImplementedError

    def _counts(self, model: Layout, wire: Layout) -> dict[str, Gaps] | None:
        return None

    def check_layout(self, model: Layout, wire: Layout, *, round_: int) -> None:
        """IntegrityError(reason=LAYOUT) naming the first way `wire` differs from what this codec sends."""
        expected = self.wire_layout(model, round_=round_, counts=self._counts(model, wire))
        if expected == wire:
            return
        mine = {t.name: t for t in expected.tensors}
        theirs = {t.name: t for t in wire.tensors}
        if missing := sorted(mine.keys() - theirs.keys()):
            raise IntegrityError(f"{self.name} update lacks entr(ies) {missing[:5]}", reason=Reason.LAYOUT)
        if extra := sorted(theirs.keys() - mine.keys()):
            raise IntegrityError(f"{self.name} update has entr(ies) {extra[:5]} that a {self.name} update of the "
                                 "job's model does not have", reason=Reason.LAYOUT)
        for name, t in mine.items():
            o = theirs[name]
            if (t.dtype, t.shape) != (o.dtype, o.shape):
                raise IntegrityError(f"{self.name} update entry {name!r} is {o.dtype}{list(o.shape)}; expected "
                                     f"{t.dtype}{list(t.shape)}{self._why_shape(model, name)}",
                                     reason=Reason.LAYOUT)

    def _why_shape(self, model: Layout, entry: str) -> str:
        return ""

    def encode(self, delta: Mapping[str, np.ndarray], *, round_: int, residual: Mapping[str, np.ndarray] | None,
               rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(wire tensors, new residual) for Δ; the residual is {} without feedback. With feedback the codec
        encodes G = Δ + R (float32) and the new residual is G − sent, exact: sent + new R == G."""
        residual = residual or {}
        if self.feedback and (stray := sorted(residual.keys() - delta.keys())):
            raise ValueError(f"the residual has tensor(s) {stray[:5]} that the update lacks")
        wire: dict[str, np.ndarray] = {}
        kept: dict[str, np.ndarray] = {}
        for name in sorted(delta):
            _check_name(name)
            d = np.asarray(delta[name])
            if d.dtype.kind != "f":
                wire[f"{name}/{_DENSE}"] = np.ascontiguousarray(d).reshape(-1)
                continue
            d32 = np.ascontiguousarray(d, dtype=F32).reshape(-1)
            _require_finite(name, d32)
            g = d32
            if self.feedback and name in residual:
                r = np.asarray(residual[name], dtype=F32)
                if r.shape != d.shape:
                    raise ValueError(f"residual of tensor {name!r} has shape {list(r.shape)}; the update has "
                                     f"{list(d.shape)}")
                g = d32 + r.reshape(-1)
                _require_finite(name, g, "Δ + residual")
            parts, rest = self._encode_tensor(name, d32, g, d.ndim, round_, rng)
            wire.update({f"{name}/{part}": values for part, values in parts.items()})
            if self.feedback:
                kept[name] = rest.reshape(d.shape)
        return wire, kept

    def _encode_tensor(self, name: str, delta: np.ndarray, g: np.ndarray, ndim: int, round_: int,
                       rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """(entries by part, new residual or None) for one float tensor; delta and g are flat float32."""
        raise NotImplementedError

    def decoder(self, model: Layout, wire: Layout, *, round_: int) -> Decoder:
        """A streaming Decoder for an update of this layout (checked here first)."""
        self.check_layout(model, wire, round_=round_)
        return Decoder(self, model, wire, round_=round_)

    def decode(self, model: Layout, wire: Mapping[str, np.ndarray], *, round_: int) -> dict[str, np.ndarray]:
        """The whole dense Δ (float32 for float tensors; 'none': the model as sent), with every check the
        Decoder makes: it runs the Decoder over the entries, so the arithmetic is the same."""
        layout = Layout.of(wire)
        dec = self.decoder(model, layout, round_=round_)
        out: dict[str, np.ndarray] = {}
        for t in model.tensors:
            if self.name != "none" and t.dtype in FLOAT_DTYPES:
                out[t.name] = np.zeros(t.shape, F32)
        for meta in layout.tensors:
            values = np.ascontiguousarray(wire[meta.name], dtype=DTYPES[meta.dtype]).reshape(-1)
            entry = dec._entry_of(meta.name)
            if entry.part == _DENSE:   # exact in its own dtype (float64 pieces would round int64)
                out[model.tensors[entry.tensor].name] = values.reshape(model.tensors[entry.tensor].shape).copy()
            for piece in dec.feed(values.view(np.uint8)):
                if entry.part == _DENSE:
                    continue
                flat = out[model.tensors[piece.tensor].name].reshape(-1)
                if isinstance(piece, DensePiece):
                    flat[piece.start:piece.start + len(piece.values)] = piece.values
                else:
                    flat[piece.indices] = piece.values
        dec.finish()
        return out


class NoneUplink(UplinkCodec):
    """No compression: the trained model itself travels, exactly as without a compression block."""

    def wire_layout(self, model: Layout, *, round_: int, counts: Mapping[str, Gaps] | None = None) -> Layout:
        return model

    def check_layout(self, model: Layout, wire: Layout, *, round_: int) -> None:
        model.require_same(wire)

    def encode(self, delta, *, round_, residual, rng):
        return {name: np.asarray(values) for name, values in delta.items()}, {}


class Fp16Uplink(UplinkCodec):
    """Δ rounded to float16 (round to nearest even); |Δ| beyond 65504 is refused."""

    name = "fp16"

    def _parts(self, t, counts):
        return [("fp16.values", "F16", (t.numel,))]

    def _encode_tensor(self, name, delta, g, ndim, round_, rng):
        peak = float(np.abs(g).max()) if g.size else 0.0
        if peak > float(np.finfo(np.float16).max):
            raise IntegrityError(f"Δ of tensor {name!r} reaches {peak:.6g}, beyond float16's range (65504); use "
                                 "codec int8, or none", reason=Reason.NORM)
        return {"fp16.values": g.astype("<f2")}, None


def _block_of(spec, codec: str) -> int:
    block = int(_default(spec.block, DEFAULT_BLOCK))
    if not MIN_BLOCK <= block <= MAX_BLOCK:
        raise ValueError(f"{codec} block must be {MIN_BLOCK}..{MAX_BLOCK} elements; got {spec.block}")
    return block


class Int8Uplink(UplinkCodec):
    """Δ as int8 with one float32 scale per `block` elements (max|x|/127), stochastically rounded: unbiased,
    |error| < scale per element."""

    name = "int8"

    def __init__(self, spec, *, seed: int):
        super().__init__(spec, seed=seed)
        self.block = _block_of(spec, self.name)

    def _parts(self, t, counts):
        return [("int8.scales", "F32", (-(-t.numel // self.block),)), ("int8.values", "I8", (t.numel,))]

    def _encode_tensor(self, name, delta, g, ndim, round_, rng):
        scales = (_block_peaks(g, self.block) / np.float32(127)).astype(F32)
        return {"int8.scales": scales,
                "int8.values": _stochastic_round(g, _block_scales(scales, 0, g.size, self.block), rng)}, None


class Int4Uplink(UplinkCodec):
    """Δ as 4-bit integers −7..7, two a byte (pack_int4), with one float32 scale per `block` elements
    (max|x|/7), stochastically rounded like int8: unbiased, |error| < scale per element. No error feedback
    (int8 keeps none either): the rounding error is zero in expectation, not carried."""

    name = "int4"

    def __init__(self, spec, *, seed: int):
        super().__init__(spec, seed=seed)
        self.block = _block_of(spec, self.name)

    def _parts(self, t, counts):
        return [("int4.scales", "F32", (-(-t.numel // self.block),)), ("int4.values", "U8", (-(-t.numel // 2),))]

    def _why_shape(self, model, entry):
        return " (two 4-bit values a byte: ceil(N / 2) bytes)" if entry.endswith(".values") else ""

    def _encode_tensor(self, name, delta, g, ndim, round_, rng):
        scales = (_block_peaks(g, self.block) / np.float32(7)).astype(F32)
        q = _stochastic_round(g, _block_scales(scales, 0, g.size, self.block), rng, levels=7)
        return {"int4.scales": scales, "int4.values": pack_int4(q)}, None


def _stochastic_round(x: np.ndarray, scale: np.ndarray | np.float32, rng: np.random.Generator, *,
                      levels: int = 127) -> np.ndarray:
    """q = floor(x/s + u), u ~ U[0, 1), clipped to ±levels (x/s can exceed it by a rounding error): E[q·s] = x.
    Where s is 0 (an all-zero block, or a scale that underflowed), q is 0. int8 either way."""
    s = np.broadcast_to(np.asarray(scale, np.float64), x.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s > 0, x.astype(np.float64) / s, 0.0)
    return np.clip(np.floor(y + rng.random(x.size)), -levels, levels).astype(np.int8)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Integers −7..7 as bytes, two a byte: element 2j in the low nibble of byte j, element 2j + 1 in the high
    one, each in two's complement (−1 is 0xF; 0x8, −8, is never written). An odd count leaves the last high
    nibble 0. ceil(N / 2) bytes, U8."""
    q = np.asarray(q, np.int8).reshape(-1)
    if (bad := np.flatnonzero((q < -7) | (q > 7))).size:
        raise ValueError(f"int4 packs -7..7; element {int(bad[0])} is {int(q[bad[0]])}")
    nibbles = q.view(np.uint8) & np.uint8(0x0F)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return nibbles[0::2] | (nibbles[1::2] << np.uint8(4))


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """The 4-bit fields of bytes, in element order (low nibble first), as uint8 0..15."""
    packed = np.asarray(packed, np.uint8).reshape(-1)
    out = np.empty(2 * packed.size, np.uint8)
    out[0::2] = packed & np.uint8(0x0F)
    out[1::2] = packed >> np.uint8(4)
    return out


def _signed(nibbles: np.ndarray) -> np.ndarray:
    """Two's complement nibbles 0..15 as int8 −8..7."""
    return (nibbles.astype(np.int8) ^ np.int8(8)) - np.int8(8)


def int4_problem(packed: np.ndarray, count: int, first: int = 0) -> str | None:
    """Why bytes of packed int4 values holding elements [first, first + count) are malformed (None: they are
    not): a nibble 0x8 (−8, which no encoder writes), or, where the bytes end past the last element (an odd
    count), a high nibble other than 0."""
    nibbles = _nibbles(packed)
    if (bad := np.flatnonzero(nibbles[:count] == 8)).size:
        e = first + int(bad[0])
        return (f"value -8 at element {e} (byte {e // 2}, {'high' if e % 2 else 'low'} nibble); int4 values are "
                "-7..7")
    if nibbles.size > count and nibbles[count]:
        return (f"the unused high nibble of byte {(first + count) // 2} is {int(nibbles[count])}; with an odd "
                "number of elements the last byte's high nibble must be 0")
    return None


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    """The `count` integers (int8) that pack_int4 packed into `packed`; ValueError naming the first malformed
    nibble (int4_problem)."""
    packed = np.asarray(packed, np.uint8).reshape(-1)
    if packed.size != -(-count // 2):
        raise ValueError(f"{count} int4 values take {-(-count // 2)} bytes; got {packed.size}")
    if (why := int4_problem(packed, count)) is not None:
        raise ValueError(why)
    return _signed(_nibbles(packed)[:count])


class _SparseUplink(UplinkCodec):
    """Shared by topk and randk: k_of(N) values per tensor, optional error feedback."""

    def __init__(self, spec, *, seed: int):
        super().__init__(spec, seed=seed)
        self.fraction, self.k = spec.fraction, spec.k
        if (self.fraction is None) == (self.k is None):
            raise ValueError(f"{self.name} takes exactly one of fraction and k")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"{self.name} fraction must be in (0, 1]; got {self.fraction}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"{self.name} k must be at least 1; got {self.k}")
        self.feedback = bool(_default(spec.error_feedback, True))

    def k_of(self, numel: int) -> int:
        return k_of(numel, fraction=self.fraction, k=self.k)

    def _why_shape(self, model, entry):
        name = entry.rpartition("/")[0]
        for t in model.tensors:
            if t.name == name:
                return f" ({self.name} sends k_of({t.numel}) = {self.k_of(t.numel)} entries of it)"
        return ""


class TopkUplink(_SparseUplink):
    """The k entries of largest |G| (ties: the lower index) as gaps and int8 values (_sparse_entries), every
    chosen entry kept even where q is 0. With error feedback the residual keeps the quantisation error as well
    as the entries not sent; without it that error is simply lost.

    m = k + fillers, and how many fillers depends on where the k entries lie and on the gaps' dtype: the
    decoder cannot know it before it reads the gaps, so check_layout only bounds m (k <= m <= k + (N − k) //
    MAX_GAP[dtype]) and the Decoder checks the gaps themselves as they stream, and that at most k values are
    non-zero (a filler's is 0)."""

    name = "topk"
    shared_indices = False

    def _parts(self, t, counts):
        # Without counts: no fillers, so 1-byte gaps (the site's choice then).
        sent = Gaps(self.k_of(t.numel), "U8") if counts is None else counts[t.name]
        return _gap_parts(self.name, sent)

    def _counts(self, model, wire):
        return _gap_counts(self, model, wire)

    def _m_range(self, numel: int, dtype: str) -> tuple[int, int, str]:
        k = self.k_of(numel)
        return k, k + (numel - k) // MAX_GAP[dtype], (f"k_of({numel}) = {k} entries and a filler for each "
                                                      f"{MAX_GAP[dtype]} positions between them ({dtype} gaps)")

    def _why_shape(self, model, entry):
        return " (one per gap)" if entry.endswith(".values") else ""

    def _encode_tensor(self, name, delta, g, ndim, round_, rng):
        idx = top_indices(g, self.k_of(g.size))
        scale, q, rest_chosen = _int8_exact(g[idx], rng)
        rest = None
        if self.feedback:
            rest = g.copy()
            rest[idx] = rest_chosen
        return _sparse_entries(self.name, idx, scale, q), rest


def top_indices(g: np.ndarray, k: int) -> np.ndarray:
    """The sorted indices of the k largest |g|; among equal |g|, lower indices first. O(N), no sort of g."""
    n = g.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k <= 0:
        return np.zeros(0, np.int64)
    a = np.abs(g)
    threshold = np.partition(a, n - k)[n - k]
    above = np.flatnonzero(a > threshold)
    tied = np.flatnonzero(a == threshold)[:k - above.size]
    return np.sort(np.concatenate([above, tied])).astype(np.int64)


class RandkUplink(_SparseUplink):
    """k coordinates drawn by a PRG every site and the coordinator share (randk_indices), so only the values
    travel. Without feedback they are scaled by N/k (an unbiased estimate); with it, unscaled, and the
    residual keeps the rest."""

    name = "randk"

    def _parts(self, t, counts):
        return [("randk.values", "F32", (self.k_of(t.numel),))]

    def _encode_tensor(self, name, delta, g, ndim, round_, rng):
        n = g.size
        idx = randk_indices(self.seed, round_, name, n, self.k_of(n))
        if self.feedback:
            rest = g.copy()
            rest[idx] = 0
            return {"randk.values": g[idx]}, rest
        values = (g[idx].astype(np.float64) * (n / idx.size)).astype(F32) if idx.size else g[idx]
        _require_finite(name, values, "Δ·N/k")
        return {"randk.values": values}, None


class AdacompUplink(UplinkCodec):
    """AdaComp (Chen et al., AAAI 2018): per tensor G = R + Δ, H = G + Δ; in bins of bin_conv (ndim >= 3) or
    bin_dense elements, send the entries with |H| >= max|G| of their bin, as gaps and int8 values with one
    scale per tensor (_int8_exact, _sparse_entries; entries whose q is 0 are dropped, fillers aside); the rest,
    and the quantisation error, stay in the residue."""

    name = "adacomp"
    shared_indices = False

    def __init__(self, spec, *, seed: int):
        super().__init__(spec, seed=seed)
        self.bin_conv = int(_default(spec.bin_conv, DEFAULT_BIN_CONV))
        self.bin_dense = int(_default(spec.bin_dense, DEFAULT_BIN_DENSE))
        if self.bin_conv < 1 or self.bin_dense < 1:
            raise ValueError(f"adacomp bins must hold at least 1 element; got bin_conv {spec.bin_conv}, "
                             f"bin_dense {spec.bin_dense}")
        self.feedback = True

    def _parts(self, t, counts):
        if counts is None or t.name not in counts:
            raise ValueError(f"adacomp's layout depends on how many entries of {t.name!r} were sent and their gaps' "
                             "dtype; pass counts")
        return _gap_parts(self.name, counts[t.name])

    def _counts(self, model, wire):
        return _gap_counts(self, model, wire)

    def _m_range(self, numel: int, dtype: str) -> tuple[int, int, str]:
        # Fillers sit at distinct positions of the tensor like the entries they bridge, so m <= N, either dtype.
        return 0, numel, f"at most the tensor's {numel} elements"

    def _why_shape(self, model, entry):
        return " (one per gap)" if entry.endswith(".values") else ""

    def _encode_tensor(self, name, delta, g, ndim, round_, rng):
        n = g.size
        size = self.bin_conv if ndim >= 3 else self.bin_dense
        bin_peaks = np.repeat(_block_peaks(g, size), size)[:n]
        chosen = np.flatnonzero(np.abs(g + delta) >= bin_peaks)
        scale, q, rest_chosen = _int8_exact(g[chosen], rng)
        rest = g.copy()
        rest[chosen] = rest_chosen
        keep = q != 0
        return _sparse_entries(self.name, chosen[keep], scale, q[keep]), rest


def _int8_exact(picked: np.ndarray, rng: np.random.Generator) -> tuple[np.float32, np.ndarray, np.ndarray]:
    """(scale, q, rest) for the values a sparse codec sends: one float32 scale max|picked|/127, q by
    _stochastic_round, and rest = picked − q·scale, exact: q·scale + rest == picked bit for bit in float32.

    picked − q·scale is exact in float32 except when a small |x| < scale/2 rounded up to ±scale and the
    difference needs more bits than float32 has: those q become 0 instead (rest keeps x whole). TwoSum (Knuth)
    gives the rounding error of picked − q·scale exactly."""
    peak = np.abs(picked).max() if picked.size else np.float32(0)
    scale = np.float32(peak) / np.float32(127)
    q = _stochastic_round(picked, scale, rng)
    sent = _dequant(q, scale)
    rest = picked - sent
    back = rest - picked
    inexact = (picked - (rest - back)) + (-sent - back) != 0
    q[inexact] = 0
    rest[inexact] = picked[inexact]
    return scale, q, rest


def _gap_parts(codec: str, sent: Gaps) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f"{codec}.gaps", sent.dtype, (sent.m,)), (f"{codec}.scale", "F32", (1,)),
            (f"{codec}.values", "I8", (sent.m,))]


def gap_width(gaps: np.ndarray) -> Gaps:
    """The gaps dtype that sends steps `gaps` (each >= 1) in fewer bytes, fillers and the I8 value of each entry
    counted, and the m it then takes: U16 only where it is strictly smaller than U8."""
    by_bytes = []
    for dtype, most in MAX_GAP.items():
        m = gaps.size + int(((gaps - 1) // most).sum())
        by_bytes.append((m * (DTYPES[dtype].itemsize + 1), dtype != "U8", Gaps(m, dtype)))
    return min(by_bytes)[2]


def _sparse_entries(codec: str, idx: np.ndarray, scale: np.float32, q: np.ndarray) -> dict[str, np.ndarray]:
    """Strictly increasing indices idx with int8 values q as <codec>.gaps (idx_j − idx_{j−1}, idx_{−1} = −1),
    .scale and .values, the gaps U8 or U16, whichever makes fewer bytes (gap_width). A gap above the dtype's
    MAX_GAP cannot be written: a filler entry (value 0) every MAX_GAP positions bridges it, (gap − 1) // MAX_GAP
    of them, so there are at most (N − len(idx)) // MAX_GAP fillers."""
    gaps = np.diff(idx.astype(np.int64), prepend=-1)
    sent = gap_width(gaps)
    most = MAX_GAP[sent.dtype]
    fill = (gaps - 1) // most
    at = np.arange(idx.size) + np.cumsum(fill)   # where each entry lands among entries and fillers
    out_gaps = np.full(sent.m, most, np.int64)
    out_gaps[at] = gaps - fill * most
    values = np.zeros(sent.m, np.int8)
    values[at] = q
    return {f"{codec}.gaps": out_gaps.astype(DTYPES[sent.dtype]), f"{codec}.scale": np.array([scale], F32),
            f"{codec}.values": values}


def _gap_counts(codec: UplinkCodec, model: Layout, wire: Layout) -> dict[str, Gaps]:
    """Each tensor's m and gaps dtype as its <codec>.gaps entry gives them, refused unless the dtype is one of
    MAX_GAP's and m within codec._m_range(N, dtype)."""
    sent = {t.name: t for t in wire.tensors}
    counts = {}
    for t in model.tensors:
        meta = sent.get(f"{t.name}/{codec.name}.gaps")
        if meta is None or t.dtype not in FLOAT_DTYPES:
            counts[t.name] = Gaps(0, "U8")   # the comparison then names the missing entry
            continue
        if meta.dtype not in MAX_GAP:
            raise IntegrityError(f"{codec.name} update entry {meta.name!r} is {meta.dtype}{list(meta.shape)}; "
                                 f"gaps must be {' or '.join(MAX_GAP)}", reason=Reason.LAYOUT)
        low, high, what = codec._m_range(t.numel, meta.dtype)
        if len(meta.shape) != 1 or not low <= meta.shape[0] <= high:
            raise IntegrityError(f"{codec.name} update entry {meta.name!r} has shape {list(meta.shape)}; it must "
                                 f"be [m] with {low} <= m <= {high}: {what}", reason=Reason.LAYOUT)
        counts[t.name] = Gaps(meta.shape[0], meta.dtype)
    return counts


UPLINK: dict[str, type[UplinkCodec]] = {
    "none": NoneUplink,
    "fp16": Fp16Uplink,
    "int8": Int8Uplink,
    "int4": Int4Uplink,
    "topk": TopkUplink,
    "adacomp": AdacompUplink,
    "randk": RandkUplink,
}


def job_uplink(job) -> UplinkCodec | None:
    """A round config's uplink codec, or None when its updates travel as whole models: no compression block,
    codec none, or secure aggregation (whose masked input its codec shapes instead: plexus.secagg.plan). The one
    place both the site and the coordinator decide it."""
    spec = job.compression.uplink if job.compression is not None else None
    if spec is None or spec.codec == "none" or job.privacy.secure_aggregation:
        return None
    return uplink_codec(spec, seed=job.seed)


def uplink_codec(spec, *, seed: int) -> UplinkCodec:
    """The uplink codec an UplinkSpec names; `seed` is the job's seed (randk's shared draws)."""
    cls = UPLINK.get(spec.codec)
    if cls is None:
        raise ValueError(f"unknown uplink codec {spec.codec!r}; choose one of {sorted(UPLINK)}")
    return cls(spec, seed=seed)


# The streaming decoder --------------------------------------------------------------------------

_SCALES = ("int8.scales", "int4.scales")   # a scale per block, held while the block's values stream


@dataclass(frozen=True)
class _Entry:
    meta: TensorMeta   # the wire entry
    tensor: int        # its model tensor's index
    numel: int         # the model tensor's element count
    part: str          # "int8.values", "topk.gaps", ...; "dense.values" for dense ones (all of 'none')


class Decoder:
    """Fed an update's wire blob in order, split anywhere (mid-element, mid-entry); yields decoded pieces.

    The bytes have passed plexus.wire.Receiver (order, size, finite floats); the Decoder checks what the codec
    means by them, as they stream, and refuses with IntegrityError: a gap (U8 or U16, as the layout says) of 0
    (a repeated index) or one that takes the index to N or beyond (the running index carries across chunk
    edges), more than k non-zero topk values, int8 value −128, an int4 nibble 0x8 (−8) or a nonzero unused high
    nibble, scales negative or not finite, values that decode to ±Inf.
    A refused stream is dead. Holds one tensor's indices (O(m); int8, int4: its scales, O(N/block)), and one
    chunk's piece at a time: never a dense copy of a sparse update. Iterate each feed() to its end before the
    next one, and do not change the fed buffer until then.
    """

    def __init__(self, codec: UplinkCodec, model: Layout, wire: Layout, *, round_: int):
        self.sum_sq = 0.0   # Σ decoded value² so far
        self.max_abs = 0.0  # max |decoded value| so far
        self._codec, self._round = codec, round_
        index = {t.name: i for i, t in enumerate(model.tensors)}
        self._entries = []
        for meta in wire.tensors:
            name, part = (meta.name, _DENSE) if codec.name == "none" else meta.name.rpartition("/")[::2]
            tensor = index[name]
            self._entries.append(_Entry(meta, tensor, model.tensors[tensor].numel, part))
        self._by_name = {e.meta.name: e for e in self._entries}
        self._total = wire.total_bytes
        self._received = 0
        self._at = -1        # the current entry
        self._pos = 0        # bytes of it received
        self._elem = 0       # whole elements of it decoded
        self._partial = bytearray()
        self._pending = False
        self._failed: IntegrityError | None = None
        self._indices: np.ndarray | None = None
        self._last = -1
        self._scales: np.ndarray | None = None
        self._scale = np.float32(0)
        self._nonzero = 0    # non-zero topk values of the current tensor so far
        self._next_entry()

    def _entry_of(self, name: str) -> _Entry:
        return self._by_name[name]

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[Piece]:
        """The pieces decoded from the next bytes of the blob (lazily: iterate to the end)."""
        self._require_usable()
        view = memoryview(data).cast("B")
        if self._received + len(view) > self._total:
            self._failed = IntegrityError(f"update has more than the {self._total} bytes its layout needs",
                                          reason=Reason.SIZE)
            raise self._failed
        self._received += len(view)
        self._pending = True
        return self._pieces(view)

    def finish(self) -> None:
        """IntegrityError unless the whole blob has been decoded."""
        self._require_usable()
        if self._received != self._total:
            raise IntegrityError(f"update ended after {self._received} of {self._total} bytes; it is incomplete",
                                 reason=Reason.SIZE)

    def _require_usable(self) -> None:
        if self._failed is not None:
            raise IntegrityError(f"this update was refused: {self._failed}", reason=self._failed.reason)
        if self._pending:
            raise RuntimeError("the pieces of the last feed() were not all taken; iterate each feed() to its end")

    def _pieces(self, view: memoryview) -> Iterator[Piece]:
        try:
            at = 0
            while at < len(view):
                entry = self._entries[self._at]
                size = DTYPES[entry.meta.dtype].itemsize
                seg = view[at:at + entry.meta.nbytes - self._pos]
                at += len(seg)
                self._pos += len(seg)
                if self._partial:   # an element split by the last edge
                    need = size - len(self._partial)
                    self._partial += seg[:need]
                    seg = seg[need:]
                    if len(self._partial) == size:
                        element = np.frombuffer(bytes(self._partial), DTYPES[entry.meta.dtype])
                        self._partial.clear()
                        yield from self._decode(entry, element)
                whole = len(seg) // size * size
                if whole:
                    yield from self._decode(entry, np.frombuffer(seg[:whole], DTYPES[entry.meta.dtype]))
                self._partial += seg[whole:]
                if self._pos == entry.meta.nbytes:
                    self._next_entry()
        except IntegrityError as exc:
            self._failed = exc
            raise
        self._pending = False

    def _next_entry(self) -> None:
        """Move to the next entry with bytes, setting up the state its values need."""
        while True:
            self._at += 1
            self._pos = self._elem = 0
            if self._at >= len(self._entries):
                return
            entry = self._entries[self._at]
            if entry.part.endswith(".gaps"):
                self._indices = np.empty(entry.meta.numel, np.int64)
                self._last = -1
            elif entry.part in _SCALES:
                self._scales = np.empty(entry.meta.numel, F32)
            elif entry.part == "randk.values":
                self._indices = randk_indices(self._codec.seed, self._round, entry.meta.name.rpartition("/")[0],
                                              entry.numel, entry.meta.numel)
            elif entry.part.endswith(".scale"):
                self._scale = np.float32(0)
            if entry.part == "topk.values":
                self._nonzero = 0
            if entry.meta.nbytes:
                return

    def _decode(self, entry: _Entry, values: np.ndarray) -> Iterator[Piece]:
        start = self._elem
        self._elem += values.size
        part = entry.part
        if part == _DENSE or part == "fp16.values":
            yield DensePiece(entry.tensor, start, self._account(entry, start, values))
        elif part in _SCALES:
            self._scales[start:start + values.size] = self._check_scales(entry, start, values)
        elif part == "int8.values":
            self._refuse_min(entry, start, values)
            decoded = _dequant(values, _block_scales(self._scales, start, values.size, self._codec.block))
            yield DensePiece(entry.tensor, start, self._account(entry, start, decoded))
        elif part == "int4.values":   # bytes [start, …) hold elements [2·start, …): one chunk's worth at a time
            first = 2 * start
            count = min(2 * values.size, entry.numel - first)
            if (why := int4_problem(values, count, first)) is not None:
                raise IntegrityError(f"entry {entry.meta.name!r}: {why}", reason=Reason.LAYOUT)
            q = _signed(_nibbles(values)[:count])
            decoded = _dequant(q, _block_scales(self._scales, first, count, self._codec.block))
            yield DensePiece(entry.tensor, first, self._account(entry, first, decoded))
        elif part.endswith(".gaps"):
            self._indices[start:start + values.size] = self._check_gaps(entry, start, values)
        elif part.endswith(".scale"):
            self._scale = self._check_scales(entry, start, values)[0]
        elif part in ("topk.values", "adacomp.values"):
            self._refuse_min(entry, start, values)
            if part == "topk.values":
                self._refuse_beyond_k(entry, start, values)
            yield SparsePiece(entry.tensor, self._indices[start:start + values.size],
                              self._account(entry, start, _dequant(values, self._scale)))
        else:   # randk.values: float32 as sent
            yield SparsePiece(entry.tensor, self._indices[start:start + values.size],
                              self._account(entry, start, values))

    def _check_gaps(self, entry: _Entry, start: int, gaps: np.ndarray) -> np.ndarray:
        """The indices the gaps lead to from the last one (self._last); each gap must be >= 1, each index < N."""
        idx = self._last + np.cumsum(gaps, dtype=np.int64)
        bad = np.flatnonzero((gaps == 0) | (idx >= entry.numel))
        if bad.size:
            j = int(bad[0])
            if gaps[j] == 0:
                why = (f"gap 0 at position {start + j} repeats index {int(idx[j])}; indices must strictly increase "
                       "(every gap at least 1)")
            else:
                why = (f"index {int(idx[j])} at position {start + j} is out of range: the tensor has {entry.numel} "
                       "elements")
            raise IntegrityError(f"entry {entry.meta.name!r}: {why}", reason=Reason.LAYOUT)
        self._last = int(idx[-1])
        return idx

    def _refuse_beyond_k(self, entry: _Entry, start: int, values: np.ndarray) -> None:
        """topk sends k_of(N) entries: its other m − k are fillers, value 0, so at most k values are non-zero
        (self._nonzero counts them across chunk edges). Where the gaps leave room for many fillers (N ≫ MAX_GAP
        of their dtype), this is what still holds a site to k."""
        nonzero = np.flatnonzero(values)
        k = self._codec.k_of(entry.numel)
        if self._nonzero + nonzero.size > k:
            j = int(nonzero[k - self._nonzero])
            raise IntegrityError(f"entry {entry.meta.name!r}: value {int(values[j])} at position {start + j} is "
                                 f"non-zero value number {k + 1}; topk sends k_of({entry.numel}) = {k} entries and "
                                 "its other entries are fillers of value 0", reason=Reason.LAYOUT)
        self._nonzero += nonzero.size

    def _check_scales(self, entry: _Entry, start: int, values: np.ndarray) -> np.ndarray:
        bad = np.flatnonzero(~(values >= 0) | ~np.isfinite(values))
        if bad.size:
            j = int(bad[0])
            raise IntegrityError(f"entry {entry.meta.name!r}: scale {values[j]} at position {start + j}; scales "
                                 "must be finite and >= 0",
                                 reason=Reason.NON_FINITE if not np.isfinite(values[j]) else Reason.LAYOUT)
        return values

    def _refuse_min(self, entry: _Entry, start: int, values: np.ndarray) -> None:
        bad = np.flatnonzero(values == -128)
        if bad.size:
            raise IntegrityError(f"entry {entry.meta.name!r}: value -128 at position {start + int(bad[0])}; int8 "
                                 "values are -127..127", reason=Reason.LAYOUT)

    def _account(self, entry: _Entry, start: int, values: np.ndarray) -> np.ndarray:
        """values as float64 (exact), added to sum_sq and max_abs; a non-finite one is refused."""
        out = values.astype(np.float64)
        if out.size:
            peak = float(np.max(np.abs(out)))
            if not math.isfinite(peak):
                j = int(np.flatnonzero(~np.isfinite(out))[0])
                raise IntegrityError(f"entry {entry.meta.name!r}: element {start + j} decodes to {out[j]}",
                                     reason=Reason.NON_FINITE)
            self.max_abs = max(self.max_abs, peak)
            self.sum_sq += float(np.dot(out, out))
        return out


# Downlink ---------------------------------------------------------------------------------------

class DownlinkCodec:
    """How the served model travels down; this base class is 'none': every tensor as it is."""

    name: ClassVar[str] = "none"

    def __init__(self, spec):
        self.spec = spec

    def wire_layout(self, model: Layout) -> Layout:
        """The layout of the served wire tensors for `model`."""
        return _wire_layout(model, self._parts)

    def _parts(self, t: TensorMeta) -> list[tuple[str, str, tuple[int, ...]]]:
        raise NotImplementedError

    def encode(self, model: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None
               ) -> dict[str, np.ndarray]:
        out = {}
        for name in sorted(model):
            _check_name(name)
            x = np.asarray(model[name])
            if x.dtype.kind != "f":
                out[f"{name}/{_DENSE}"] = np.ascontiguousarray(x).reshape(-1)
            else:
                out.update({f"{name}/{part}": v for part, v in self._encode_tensor(name, x, base).items()})
        return out

    def _encode_tensor(self, name: str, x: np.ndarray, base) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def decode(self, model: Layout, wire: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None
               ) -> dict[str, np.ndarray]:
        layout = Layout.of(wire)
        self.wire_layout(model).require_same(layout, what=f"{self.name} model")
        out = {}
        for t in model.tensors:
            if t.dtype not in FLOAT_DTYPES:
                values = np.asarray(wire[f"{t.name}/{_DENSE}"])
            else:
                values = self._decode_tensor(t, wire, base)
                _require_finite(t.name, values, "the decoded model")
            out[t.name] = values.astype(DTYPES[t.dtype]).reshape(t.shape)
        return out

    def _decode_tensor(self, t: TensorMeta, wire: Mapping[str, np.ndarray], base) -> np.ndarray:
        raise NotImplementedError


class NoneDownlink(DownlinkCodec):
    """The model as it is."""

    def wire_layout(self, model: Layout) -> Layout:
        return model

    def encode(self, model, base):
        return {name: np.asarray(values) for name, values in model.items()}

    def decode(self, model, wire, base):
        model.require_same(Layout.of(wire), what="served model")
        return {t.name: np.asarray(wire[t.name]).reshape(t.shape) for t in model.tensors}


class Fp16Downlink(DownlinkCodec):
    """Float tensors rounded to float16 (nearest even)."""

    name = "fp16"

    def _parts(self, t):
        return [("fp16.values", "F16", (t.numel,))]

    def _encode_tensor(self, name, x, base):
        peak = float(np.abs(x).max()) if x.size else 0.0
        if not peak <= float(np.finfo(np.float16).max):
            raise IntegrityError(f"model tensor {name!r} reaches {peak:.6g}, beyond float16's range (65504); use "
                                 "downlink codec delta8 or delta4, or none", reason=Reason.NORM)
        return {"fp16.values": x.reshape(-1).astype("<f2")}

    def _decode_tensor(self, t, wire, base):
        return np.asarray(wire[f"{t.name}/fp16.values"]).astype(F32)


class DeltaDownlink(DownlinkCodec):
    """Float tensors as integer steps from `base` (the model the site holds), one float32 scale per block
    (max|model − base| / levels), rounded to nearest: decoded = base + q·scale in float32, |error| <= scale/2.
    The codecs of a served chain (is_delta); subclasses say how q travels."""

    levels: ClassVar[int]

    def __init__(self, spec):
        super().__init__(spec)
        self.block = _block_of(spec, self.name)

    def _parts(self, t):
        return [(f"{self.name}.scales", "F32", (-(-t.numel // self.block),)),
                (f"{self.name}.values", *self._values(t.numel))]

    def _values(self, numel: int) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape) of the values entry of a tensor of numel elements."""
        raise NotImplementedError

    def _pack(self, q: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _unpack(self, t: TensorMeta, values: np.ndarray) -> np.ndarray:
        """q (int8) from the values entry; IntegrityError naming a malformed one."""
        raise NotImplementedError

    def _base(self, name: str, base, shape) -> np.ndarray:
        if base is None or name not in base:
            raise ValueError(f"{self.name} sends the model as steps from the one the site holds; no base for {name!r}")
        b = np.asarray(base[name])
        if b.shape != tuple(shape):
            raise ValueError(f"base tensor {name!r} has shape {list(b.shape)}; the model has {list(shape)}")
        return b.astype(F32).reshape(-1)

    def _encode_tensor(self, name, x, base):
        d = x.astype(np.float64).reshape(-1) - self._base(name, base, x.shape).astype(np.float64)
        _require_finite(name, d, "model − base")
        scales = (_block_peaks(d, self.block) / self.levels).astype(F32)
        s = _block_scales(scales, 0, d.size, self.block).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s > 0, np.rint(d / s), 0.0)
        q = np.clip(q, -self.levels, self.levels).astype(np.int8)
        return {f"{self.name}.scales": scales, f"{self.name}.values": self._pack(q)}

    def _decode_tensor(self, t, wire, base):
        scales = np.asarray(wire[f"{t.name}/{self.name}.scales"], F32)
        if (bad := np.flatnonzero(~(scales >= 0) | ~np.isfinite(scales))).size:
            raise IntegrityError(f"served {t.name!r}: {self.name} scale {scales[bad[0]]} at position "
                                 f"{int(bad[0])}; scales must be finite and >= 0", reason=Reason.LAYOUT)
        q = self._unpack(t, np.asarray(wire[f"{t.name}/{self.name}.values"]))
        b = self._base(t.name, base, t.shape)
        return b + _dequant(q, _block_scales(scales, 0, q.size, self.block))


class Delta8Downlink(DeltaDownlink):
    """Steps −127..127 as int8, one a byte."""

    name = "delta8"
    levels = 127

    def _values(self, numel):
        return "I8", (numel,)

    def _pack(self, q):
        return q

    def _unpack(self, t, values):
        if (bad := np.flatnonzero(values == -128)).size:
            raise IntegrityError(f"served {t.name!r}: delta8 value -128 at position {int(bad[0])}; int8 values "
                                 "are -127..127", reason=Reason.LAYOUT)
        return values


class Delta4Downlink(DeltaDownlink):
    """Steps −7..7, two a byte as int4 packs them (pack_int4: low nibble first, two's complement)."""

    name = "delta4"
    levels = 7

    def _values(self, numel):
        return "U8", (-(-numel // 2),)

    def _pack(self, q):
        return pack_int4(q)

    def _unpack(self, t, values):
        try:
            return unpack_int4(values, t.numel)
        except ValueError as exc:
            raise IntegrityError(f"served {t.name!r}: delta4 values: {exc}", reason=Reason.LAYOUT) from None


DOWNLINK: dict[str, type[DownlinkCodec]] = {"none": NoneDownlink, "fp16": Fp16Downlink, "delta8": Delta8Downlink,
                                             "delta4": Delta4Downlink}


def is_delta(codec: str) -> bool:
    """Whether downlink codec `codec` sends steps from the model a site holds (delta8, delta4): the coordinator
    keeps a served chain for it and the site keeps its chain model. The one place that is decided."""
    return issubclass(DOWNLINK.get(codec, DownlinkCodec), DeltaDownlink)


def downlink_codec(spec) -> DownlinkCodec:
    """The downlink codec a DownlinkSpec names."""
    cls = DOWNLINK.get(spec.codec)
    if cls is None:
        raise ValueError(f"unknown downlink codec {spec.codec!r}; choose one of {sorted(DOWNLINK)}")
    return cls(spec)


def downlink_encode(spec, model: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None = None
                    ) -> dict[str, np.ndarray]:
    """The wire tensors that serve `model` (a delta codec: against `base`, the model the site holds)."""
    return downlink_codec(spec).encode(model, base)


def downlink_decode(spec, model_layout: Layout, wire: Mapping[str, np.ndarray],
                    base: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The model a site trains from, decoded from served wire tensors (checked: IntegrityError)."""
    return downlink_codec(spec).decode(model_layout, wire, base)


def zero_base(model: Layout) -> dict[str, np.ndarray]:
    """All-zero float32 tensors shaped as `model`'s (read-only views: no memory): the base a delta codec's
    served chain starts from, so its first model, decode(encode(model, zeros), zeros), travels as that codec's
    own compact wire and both ends hold the same bits."""
    return {t.name: np.broadcast_to(np.float32(0), t.shape) for t in model.tensors}
