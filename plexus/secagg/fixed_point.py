"""Fixed point: clipped, weighted float updates as uint32 values whose sum mod 2**32 is exact."""

from __future__ import annotations

import math

import numpy as np

from plexus import errors
from plexus.secagg.checks import check_int

# Fixed-point headroom: the sum of all sites' q stays within 2**30 + (sites / 2), inside int32.
_HEADROOM_BITS = 30


def frac_bits(clip: float) -> int:
    """Fraction bits for updates clipped to ±clip: 30 - ceil(log2(clip)), so clip * 2**bits <= 2**30.

    Guarantee: for any weights w_u >= 0 with sum <= 1 and any |delta_u| <= clip, the exact
    sum of the per-site quantised values satisfies |sum_u q_u| <= 2**30 + S/2 (S sites, each
    rounding by at most 1/2), which is < 2**31 - 1 for every S < 2**31 - 2; so the sum mod
    2**32 read as int32 is exact. Resolution: 2**-bits, between clip * 2**-31 and clip * 2**-30.
    """
    if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating, np.integer)):
        raise TypeError(f"clip must be a number, not {type(clip).__name__}")
    clip = float(clip)
    if not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"clip must be a finite number > 0, got {clip}")
    mantissa, exponent = math.frexp(clip)  # clip = mantissa * 2**exponent, 0.5 <= mantissa < 1
    ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
    return _HEADROOM_BITS - ceil_log2


def quantize(delta: np.ndarray, weight: float, clip: float, bits: int) -> np.ndarray:
    """round(clip(delta, ±clip) * weight * 2**bits) as uint32 (two's complement mod 2**32), same shape."""
    delta = np.asarray(delta)
    if not (np.issubdtype(delta.dtype, np.floating) or np.issubdtype(delta.dtype, np.integer)):
        raise TypeError(f"delta must hold real numbers, not {delta.dtype}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)):
        raise TypeError(f"weight must be a number, not {type(weight).__name__}")
    if not 0 < weight <= 1:
        raise ValueError(f"weight must be in (0, 1] (num_samples / total_weight), got {weight}")
    check_int(bits, "bits")
    limit = frac_bits(clip)
    if bits > limit:
        raise ValueError(f"bits={bits} exceeds frac_bits(clip={clip}) = {limit}; the sum could wrap around 2**32")
    # A sum is finite iff no element is NaN/inf (barring overflow of huge values, then check exactly).
    if not np.isfinite(np.sum(delta, dtype=np.float64)) and not np.isfinite(delta).all():
        raise errors.IntegrityError("the update holds NaN or infinity; refusing to quantise it")
    x = np.clip(delta, -clip, clip, dtype=np.float64)
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
