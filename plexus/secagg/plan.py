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

A rule's update extras (MeanRule.update_extras: SCAFFOLD's Δc, the exact strategies' gradient sums) are masked
with the model's Δ as their values (their base is zero), every element, in the 32-bit fields only: on an 8- or
16-bit grid a sum such as a gradient would keep a few significant bits. The masked tensors are the model's and
the extras' together in Layout order (sorted by name), as the update of the plain path is laid out; `values`
takes them by name, so neither side depends on an order of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from plexus.compression import k_of, randk_indices
from plexus.config import SECURE_FIELD_BITS, UplinkSpec
from plexus.secagg.fixed_point import WIRE_DTYPE, Field
from plexus.wire import Layout

PIECE = 1 << 18    # elements per masked chunk: bounds the site's scratch, whatever the model's size


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """The masked layout of one secure round, and the mapping between it and the update's tensors."""

    update: Layout                               # the model's tensors and the rule's update extras, in Layout order
    codec: str
    bits: int                                    # the field: masked values and their sum are mod 2**bits
    indices: tuple[np.ndarray | None, ...]       # per tensor of `update`: randk's shared indices; None: every element

    def layout(self) -> Layout:
        """The masked input's manifest: one tensor per update tensor, in the field's width."""
        return Layout.build([(t.name, WIRE_DTYPE[self.bits], t.shape if idx is None else (idx.size,))
                             for t, idx in zip(self.update.tensors, self.indices)])

    def field(self, *, clip: float, frac_bits: int, sites: int) -> Field:
        """The field for a sum over `sites` advertised sites (|U1|): fixed point, or the grid it allows."""
        if self.bits == 32:
            return Field.fixed(clip, frac_bits)
        return Field.grid(self.bits, clip, sites)

    def values(self, update: Mapping[str, np.ndarray]) -> Iterator[np.ndarray]:
        """The entries to mask, in masked-layout order, as consecutive chunks: for each tensor of `update` (by
        name: Δ for a model tensor, the value for an update extra), flattened."""
        names = [t.name for t in self.update.tensors]
        if set(update) != set(names):
            missing, extra = sorted(set(names) - set(update)), sorted(set(update) - set(names))
            raise ValueError(f"the update's tensors differ from the masked layout's (missing: {missing[:5]}, "
                             f"not in the layout: {extra[:5]}); mask exactly the model's Δ and the strategy's "
                             "update extras")
        for t, idx in zip(self.update.tensors, self.indices):
            d = np.asarray(update[t.name]).reshape(-1)
            if d.size != t.numel:
                raise ValueError(f"tensor {t.name!r} has {d.size} elements in the update; the layout has {t.numel}")
            if idx is not None:
                d = d[idx]
            for start in range(0, d.size, PIECE):
                yield d[start:start + PIECE]

    def dense(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The unmasked sum (float64, masked-layout order) as update-shaped tensors; zero off randk's indices."""
        out, start = {}, 0
        for t, idx in zip(self.update.tensors, self.indices):
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


NO_EXTRAS = Layout(())


def mask_plan(uplink: UplinkSpec | None, model: Layout, *, seed: int, round_: int,
              extras: Layout = NO_EXTRAS) -> MaskPlan:
    """The plan for the job's uplink codec (None: no compression block) in round `round_` of a job seeded `seed`,
    masking the model's Δ and the rule's update `extras` (names apart from the model's)."""
    codec = "none" if uplink is None else uplink.codec
    if codec not in SECURE_FIELD_BITS:
        raise ValueError(f"uplink codec {codec!r} cannot be masked: every site must send the same coordinates; "
                         f"secure aggregation takes {', '.join(sorted(SECURE_FIELD_BITS))}")
    if extras.tensors and SECURE_FIELD_BITS[codec] != 32:
        raise ValueError(f"uplink codec {codec!r} masks on a {SECURE_FIELD_BITS[codec]}-bit grid, too coarse for the "
                         f"strategy's update extras ({', '.join(t.name for t in extras.tensors[:3])}); remove "
                         "compression.uplink from the job")
    if clash := sorted({t.name for t in model.tensors} & {t.name for t in extras.tensors}):
        raise ValueError(f"update extras {clash[:3]} have the names of model tensors; an extra needs its own name")
    update = Layout.build([(t.name, t.dtype, t.shape) for t in model.tensors + extras.tensors])
    in_model = {t.name for t in model.tensors}
    if codec == "randk":   # the model's tensors at their shared indices; extras whole (the field is 32-bit)
        indices = tuple(randk_indices(seed, round_, t.name, t.numel,
                                      k_of(t.numel, fraction=uplink.fraction, k=uplink.k))
                        if t.name in in_model else None for t in update.tensors)
    else:
        indices = (None,) * len(update.tensors)
    return MaskPlan(update, codec, SECURE_FIELD_BITS[codec], indices)
