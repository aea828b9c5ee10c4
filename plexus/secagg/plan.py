"""What a site masks in a secure round for the job's uplink codec: which entries of its update, in which field.

    codec   field      masked entries of model tensor n (numel N)    values
    none    mod 2**32  n: U32[shape of n]                            fixed point, frac_bits(clip) (as always)
    randk   mod 2**32  n: U32[k], k = k_of(N), the shared indices    the same fixed point, at those indices only
    fp16    mod 2**16  n: U16[shape of n]                            grid clip/L, L = 2**15 - 1 - |U1|
    int8    mod 2**8   n: U8[shape of n]                             grid clip/L, L = 2**7 - 1 - |U1|

A float format cannot be masked (masks are uniform integers), so "fp16" under secure aggregation is
16-bit fixed point on a public grid, not IEEE half precision. randk's indices for tensor n in round r
are plexus.compression.randk_indices(seed, r, n, N, k): every site and the coordinator draw the same ones, so the masked
sums line up, and the coordinator scatters the unmasked sum into a dense Δ, zero elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from plexus.compression import k_of, randk_indices
from plexus.config import SECURE_FIELD_BITS, UplinkSpec
from plexus.secagg.fixed_point import WIRE_DTYPE, Field
from plexus.wire import Layout

PIECE = 1 << 18    # elements per masked chunk: bounds the site's scratch, whatever the model's size


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """The masked layout of one secure round, and the mapping between it and the model's tensors."""

    model: Layout
    codec: str
    bits: int                                    # the field: masked values and their sum are mod 2**bits
    indices: tuple[np.ndarray | None, ...]       # per model tensor: randk's shared indices; None: every element

    def layout(self) -> Layout:
        """The masked input's manifest: one tensor per model tensor, in the field's width."""
        return Layout.build([(t.name, WIRE_DTYPE[self.bits], t.shape if idx is None else (idx.size,))
                             for t, idx in zip(self.model.tensors, self.indices)])

    def field(self, *, clip: float, frac_bits: int, sites: int) -> Field:
        """The field for a sum over `sites` advertised sites (|U1|): fixed point, or the grid it allows."""
        if self.bits == 32:
            return Field.fixed(clip, frac_bits)
        return Field.grid(self.bits, clip, sites)

    def values(self, delta: Sequence[np.ndarray]) -> Iterator[np.ndarray]:
        """The entries to mask, in masked-layout order, as consecutive chunks (Δ per model tensor, flat)."""
        if len(delta) != len(self.model.tensors):
            raise ValueError(f"the update has {len(delta)} tensors; the model has {len(self.model.tensors)}")
        for t, idx, d in zip(self.model.tensors, self.indices, delta):
            d = np.asarray(d).reshape(-1)
            if d.size != t.numel:
                raise ValueError(f"tensor {t.name!r} has {d.size} elements in the update; the model has {t.numel}")
            if idx is not None:
                d = d[idx]
            for start in range(0, d.size, PIECE):
                yield d[start:start + PIECE]

    def dense(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The unmasked sum (float64, masked-layout order) as model-shaped tensors; zero off randk's indices."""
        out, start = {}, 0
        for t, idx in zip(self.model.tensors, self.indices):
            if idx is None:
                out[t.name] = flat[start:start + t.numel].reshape(t.shape)
                start += t.numel
            else:
                full = np.zeros(t.numel, np.float64)
                full[idx] = flat[start:start + idx.size]
                out[t.name] = full.reshape(t.shape)
                start += idx.size
        if start != flat.size:
            raise ValueError(f"the sum has {flat.size} elements; the masked layout has {start}")
        return out


def mask_plan(uplink: UplinkSpec | None, model: Layout, *, seed: int, round_: int) -> MaskPlan:
    """The plan for the job's uplink codec (None: no compression block) in round `round_` of a job seeded `seed`."""
    codec = "none" if uplink is None else uplink.codec
    if codec not in SECURE_FIELD_BITS:
        raise ValueError(f"uplink codec {codec!r} cannot be masked: every site must send the same coordinates; "
                         f"secure aggregation takes {', '.join(sorted(SECURE_FIELD_BITS))}")
    if codec == "randk":
        counts = [k_of(t.numel, fraction=uplink.fraction, k=uplink.k) for t in model.tensors]
        indices = tuple(randk_indices(seed, round_, t.name, t.numel, k) for t, k in zip(model.tensors, counts))
    else:
        indices = (None,) * len(model.tensors)
    return MaskPlan(model, codec, SECURE_FIELD_BITS[codec], indices)

