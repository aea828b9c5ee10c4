"""Fixed point: clipped, weighted float updates as field elements whose sum mod 2**bits is exact.

A 32-bit field holds fixed point with frac_bits(clip) fraction bits, rounded to nearest (quantize).
An 8- or 16-bit field (Field.grid) holds multiples of the public grid clip/L, rounded stochastically.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from plexus import errors
from plexus.config import MIN_GRID_LEVELS
from plexus.secagg.checks import check_int

_UNSIGNED = {8: np.dtype(np.uint8), 16: np.dtype(np.uint16), 32: np.dtype(np.uint32)}
_SIGNED = {8: np.dtype(np.int8), 16: np.dtype(np.int16), 32: np.dtype(np.int32)}
WIRE_DTYPE = {8: "U8", 16: "U16", 32: "U32"}

# Fixed-point headroom: the sum of all sites' q stays within 2**30 + (sites / 2), inside int32.
_HEADROOM_BITS = 30


def frac_bits(clip: float) -> int:
    """Fraction bits for updates clipped to ±clip: 30 - ceil(log2(clip)), so clip * 2**bits <= 2**30.

    Guarantee: for any weights w_u >= 0 with sum <= 1 and any |delta_u| <= clip, the exact
    sum of the per-site quantised values satisfies |sum_u q_u| <= 2**30 + S/2 (S sites, each
    rounding by at most 1/2), which is < 2**31 - 1 for every S < 2**31 - 2; so the sum mod
    2**32 read as int32 is exact. Resolution: 2**-bits = 2**ceil(log2(clip)) * 2**-30, from clip * 2**-30 (clip a
    power of two) up to, not including, clip * 2**-29.
    """
    if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating, np.integer)):
        raise TypeError(f"clip must be a number, not {type(clip).__name__}")
    clip = float(clip)
    if not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"clip must be a finite number > 0, got {clip}")
    mantissa, exponent = math.frexp(clip)  # clip = mantissa * 2**exponent, 0.5 <= mantissa < 1
    ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
    return _HEADROOM_BITS - ceil_log2


def _check_inputs(delta: np.ndarray, weight: float) -> None:
    """TypeError/ValueError unless delta holds real numbers and 0 < weight <= 1."""
    if not (np.issubdtype(delta.dtype, np.floating) or np.issubdtype(delta.dtype, np.integer)):
        raise TypeError(f"delta must hold real numbers, not {delta.dtype}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)):
        raise TypeError(f"weight must be a number, not {type(weight).__name__}")
    if not 0 < weight <= 1:
        raise ValueError(f"weight must be in (0, 1] (num_samples / total_weight), got {weight}")


def quantize(delta: np.ndarray, weight: float, clip: float, bits: int) -> np.ndarray:
    """round(clip(delta, ±clip) * weight * 2**bits) as uint32 (two's complement mod 2**32), same shape."""
    delta = np.asarray(delta)
    _check_inputs(delta, weight)
    check_int(bits, "bits")
    limit = frac_bits(clip)
    if bits > limit:
        raise ValueError(f"bits={bits} exceeds frac_bits(clip={clip}) = {limit}; the sum could wrap around 2**32")
    x = _clipped(delta, clip)
    x *= math.ldexp(float(weight), bits)   # weight·2**bits: a power-of-two scaling of the same product
    np.rint(x, out=x)
    # |x| <= 2**30 + 1/2 (frac_bits' bound), so int32 holds it exactly; its bits are the value mod 2**32.
    return x.astype(np.int32).view(np.uint32)


def dequantize(total: np.ndarray, bits: int) -> np.ndarray:
    """Read a uint32 sum as signed int32 and scale it back: float64 value / 2**bits."""
    total = np.asarray(total)
    if total.dtype != np.uint32:
        raise TypeError(f"dequantize expects the uint32 sum, not {total.dtype}")
    check_int(bits, "bits")
    return np.ldexp(total.view(np.int32).astype(np.float64), -bits)


def _clipped(delta: np.ndarray, clip: float) -> np.ndarray:
    """clip(delta, ±clip) as a new float64 array; IntegrityError on NaN or infinity."""
    # A sum is finite iff no element is NaN/inf (barring overflow of huge values, then check exactly).
    if not np.isfinite(np.sum(delta, dtype=np.float64)) and not np.isfinite(delta).all():
        raise errors.IntegrityError("the update holds NaN or infinity; refusing to quantise it")
    return np.clip(delta, -clip, clip, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class Field:
    """The integers a secure round masks and sums: mod 2**bits.

    bits 32: fixed point with `frac_bits` fraction bits, rounded to nearest (quantize/dequantize).
    bits 8 or 16: multiples of the public grid clip/levels. A site sends SR(w·clip(Δ, ±clip)·L/clip),
    SR unbiased stochastic rounding (floor(x + u), u ~ U[0, 1)): each |q_u| < w_u·L + 1, so over n
    sites with Σ w_u <= 1, |Σ q_u| <= L + n - 1 < 2**(bits-1) once L <= 2**(bits-1) - 1 - n
    (Field.grid), and the sum mod 2**bits read as a signed integer is exact.
    """

    bits: int
    clip: float
    frac_bits: int = 0    # 32-bit fields
    levels: int = 0       # 8- and 16-bit fields: L

    def __post_init__(self):
        check_int(self.bits, "bits")
        check_int(self.frac_bits, "frac_bits")
        check_int(self.levels, "levels")
        limit = frac_bits(self.clip)   # also checks clip
        if self.bits == 32:
            if self.levels or self.frac_bits > limit:
                raise ValueError(f"a 32-bit field takes frac_bits <= frac_bits(clip={self.clip}) = {limit} and no "
                                 f"levels; got frac_bits={self.frac_bits}, levels={self.levels}")
        elif self.bits in (8, 16):
            if self.frac_bits or not MIN_GRID_LEVELS <= self.levels <= 2 ** (self.bits - 1) - 2:
                raise ValueError(f"a {self.bits}-bit field takes levels in [{MIN_GRID_LEVELS}, "
                                 f"{2 ** (self.bits - 1) - 2}] and no frac_bits; got levels={self.levels}, "
                                 f"frac_bits={self.frac_bits}")
        else:
            raise ValueError(f"a field has 8, 16 or 32 bits, not {self.bits}")

    @classmethod
    def fixed(cls, clip: float, bits: int) -> Field:
        """The 32-bit field of fixed point with `bits` fraction bits (secure aggregation without compression)."""
        return cls(32, float(clip), frac_bits=bits)

    @classmethod
    def grid(cls, bits: int, clip: float, sites: int) -> Field:
        """The `bits`-bit field for a sum over `sites` sites: grid clip/L, L = 2**(bits-1) - 1 - sites.

        ValueError when L would fall below MIN_GRID_LEVELS (int8: more than 111 sites)."""
        check_int(bits, "bits")
        check_int(sites, "sites")
        if bits not in (8, 16):
            raise ValueError(f"a grid field has 8 or 16 bits, not {bits}")
        levels = 2 ** (bits - 1) - 1 - sites
        if sites < 1 or levels < MIN_GRID_LEVELS:
            raise ValueError(f"a {bits}-bit field sums at most {2 ** (bits - 1) - 1 - MIN_GRID_LEVELS} sites with a "
                             f"grid of at least clip/{MIN_GRID_LEVELS}; got {sites}")
        return cls(bits, float(clip), levels=levels)

    @property
    def dtype(self) -> np.dtype:
        """The unsigned numpy dtype of masked values and their sum."""
        return _UNSIGNED[self.bits]

    @property
    def wire_dtype(self) -> str:
        return WIRE_DTYPE[self.bits]

    def holds(self, sites: int) -> bool:
        """Whether the sum of `sites` sites' inputs cannot wrap around this field."""
        return self.bits == 32 or self.levels + sites <= 2 ** (self.bits - 1) - 1

    def quantize(self, delta: np.ndarray, weight: float, rng: np.random.Generator | None = None) -> np.ndarray:
        """One site's w·clip(Δ, ±clip) as field elements (two's complement mod 2**bits), flattened.

        Small fields round stochastically with `rng`; by default fresh OS randomness, so the
        coordinator (which knows every seed of the job) cannot tell a site's rounding.
        """
        if self.bits == 32:
            return quantize(np.asarray(delta).reshape(-1), weight, self.clip, self.frac_bits)
        delta = np.asarray(delta).reshape(-1)
        _check_inputs(delta, weight)
        if rng is None:
            rng = np.random.default_rng(secrets.randbits(128))
        x = _clipped(delta, self.clip)
        x *= float(weight) * self.levels / self.clip     # |x| <= w·L (to rounding)
        x += rng.random(x.size)
        np.floor(x, out=x)                               # E[floor(x + u)] = x: unbiased
        return x.astype(_SIGNED[self.bits]).view(self.dtype)

    def dequantize(self, total: np.ndarray) -> np.ndarray:
        """A sum of field elements read as signed integers, back in update units (float64)."""
        total = np.asarray(total)
        if total.dtype != self.dtype:
            raise TypeError(f"a {self.bits}-bit field's sum is {self.dtype}, not {total.dtype}")
        if self.bits == 32:
            return dequantize(total, self.frac_bits)
        return total.view(_SIGNED[self.bits]).astype(np.float64) * (self.clip / self.levels)
