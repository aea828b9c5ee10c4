"""A site's compressed update (`compression.uplink`): Δ from the served model, coded, with error feedback.

With an uplink codec other than none, a TRAIN task's upload is Δ = trained − served (served: the model
the site fetched and trained from), coded by plexus.compression. The order at the site is fixed:

1. train (the strategy's site half);
2. under privacy.dp: clip Δ to dp.clip_norm and, in distributed mode, add this site's noise share
   (SiteAgent._clip_and_noise; distributed mode needs secure aggregation, whose masked updates are coded
   elsewhere, so here it is central DP and the coordinator adds the noise);
3. G = Δ + R, R the residual kept with the last accepted update (zero for a new job; codecs with error
   feedback only);
4. encode G (stochastic rounding drawn from the task's seed: a reproducible run sends the same bits);
5. under privacy.dp: if the decoded sent vector is longer than dp.clip_norm, scale it down to dp.clip_norm;
   the residual keeps the rest (new R = G − sent, rounded to float32; without the rescale the codec keeps
   sent + new R == G exactly);
6. stream the wire tensors; the new R is kept (JobState.keep_residual) only once the coordinator accepted
   the update, so a refused update leaves the residual as it was.

With codec none nothing here runs: the full model travels as before.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from plexus.compression import UplinkCodec
from plexus.wire import FLOAT_DTYPES, Layout


@dataclass(frozen=True)
class Coded:
    """A coded update: the wire tensors to stream, and the residual to keep once they are accepted."""

    wire: dict[str, np.ndarray]
    residual: dict[str, np.ndarray] | None   # None: the codec keeps no residual (nothing to write)


def rounding_rng(seed: int) -> np.random.Generator:
    """The stochastic-rounding draws of one task (its per-site, per-round seed), apart from its training draws."""
    digest = hashlib.sha256(f"plexus/v1/uplink-rounding/{seed}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest, "big"))


def model_delta(trained: Mapping[str, np.ndarray], served: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Δ = trained − served per model tensor: float32 for float tensors (one float32 subtraction each), exact
    in its own dtype for the others (integer buffers, which travel dense)."""
    out = {}
    for name, value in trained.items():
        dtype = np.float32 if value.dtype.kind == "f" else value.dtype
        out[name] = np.subtract(value, np.asarray(served[name]).reshape(value.shape), dtype=dtype)
    return out


def residual_layout(model: Layout) -> Layout:
    """The residual's layout: one float32 tensor per float model tensor, in the model's (wire) shape."""
    return Layout.build([(t.name, "F32", t.shape) for t in model.tensors if t.dtype in FLOAT_DTYPES])


def encode_update(codec: UplinkCodec, model: Layout, delta: Mapping[str, np.ndarray],
                  residual: Mapping[str, np.ndarray] | None, *, round_: int, rng: np.random.Generator,
                  clip_norm: float | None = None) -> Coded:
    """Steps 3-5 of the module docstring: G = Δ + residual, encode, and (clip_norm given, under privacy.dp)
    bound the decoded sent vector's L2 norm by clip_norm, the residual keeping what is scaled off."""
    residual = residual if codec.feedback else None
    wire, kept = codec.encode(delta, round_=round_, residual=residual, rng=rng)
    if clip_norm is not None:
        sent = codec.decode(model, wire, round_=round_)
        norm = _norm(sent)
        if norm > clip_norm:
            wire, sent = _shrink(codec, model, wire, clip_norm / norm, clip_norm, round_)
            if codec.feedback:
                kept = _rest(delta, residual, sent)
    if not codec.feedback:
        return Coded(wire, None)
    shapes = {t.name: t.shape for t in residual_layout(model).tensors}
    return Coded(wire, {n: np.asarray(kept[n], dtype=np.float32).reshape(shape) for n, shape in shapes.items()})


def _shrink(codec: UplinkCodec, model: Layout, wire: Mapping[str, np.ndarray], scale: float, clip_norm: float,
            round_: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The wire tensors scaled so that they decode to a vector no longer than clip_norm, and that vector.

    Every codec's decoded value is linear in exactly one floating-point wire tensor of its model tensor
    (fp16/randk values, int8 and int4 scales, topk's and AdaComp's scale; integer values and gaps stay), so scaling
    every float wire tensor by c scales the decoded vector by c, up to rounding to the wire dtype; like
    plexus.dp.clip_update, shrink a hair more until the bound holds after that rounding (fp16's rounding is
    coarse: each pass shrinks by the overshoot it measured).
    """
    while True:
        scaled = {n: (a.astype(np.float64) * scale).astype(a.dtype) if a.dtype.kind == "f" else a
                  for n, a in wire.items()}
        sent = codec.decode(model, scaled, round_=round_)
        norm = _norm(sent)
        if norm <= clip_norm:
            return scaled, sent
        scale *= clip_norm / norm * (1.0 - 1e-6)


def _rest(delta: Mapping[str, np.ndarray], residual: Mapping[str, np.ndarray] | None,
          sent: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """New residual G − sent, G = Δ + residual, in float32 as the codecs compute it."""
    out = {}
    for name, d in delta.items():
        if d.dtype.kind != "f":
            continue
        g = d.astype(np.float32) if residual is None else d.astype(np.float32) + residual[name].reshape(d.shape)
        out[name] = g - np.asarray(sent[name], dtype=np.float32).reshape(d.shape)
    return out


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm over every float tensor, summed in float64."""
    return math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in tensors.values()
                         if a.dtype.kind == "f"))
