"""A compressed downlink (compression.downlink): what the sites of a job fetch, and the model they then hold.

fp16: every float tensor travels as F16; the sites train from fp16(model).

delta8: the sites share one *served chain*, chain_r = chain_{r-1} + dequant(Q8(model_r - chain_{r-1})), computed
with plexus.compression's own encode and decode, so the coordinator and every site hold the same float32 bits.
A site that holds chain_{r-1} (it says so with the SHA-256 of its wire blob) gets the 8-bit delta; any other
site (a first fetch, a missed round, a damaged copy) gets chain_r in full. Either way it then holds chain_r.
The chain lives only here, in memory: a coordinator that restarts begins it again from the exact model, and
every site fetches that once in full. Checkpoints always hold the exact model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from coordinator.served import Held, ServedModel
from plexus.compression import downlink_decode, downlink_encode, is_delta
from plexus.config import DownlinkSpec
from plexus.wire import Layout, decode, encode


def sha256(blob) -> bytes:
    return hashlib.sha256(blob).digest()


@dataclass(frozen=True)
class Step:
    """What a Downlink serves for one model, prepared before it is taken."""

    round: int
    full: ServedModel
    base: dict[str, np.ndarray]
    delta: ServedModel | None = None
    delta_base: Held | None = None
    held: Held | None = None


class Downlink:
    """The served side of one job's compressed downlink; `advance` with each new model."""

    def __init__(self, spec: DownlinkSpec):
        if spec.codec != "fp16" and not is_delta(spec.codec):
            raise ValueError(f"downlink codec {spec.codec!r} is served as it is, without a Downlink")
        self.spec = spec
        self.round: int | None = None
        self.base: dict[str, np.ndarray] | None = None   # what the sites decode: fp16(model), or chain_r
        self.full: ServedModel | None = None             # for every site (delta8: any that lacks chain_{r-1})
        self.delta: ServedModel | None = None            # delta8: for the sites that hold chain_{r-1}
        self._delta_base: Held | None = None             # delta8: chain_{r-1} as such a site names it
        self._held: Held | None = None                   # delta8: chain_r as a site that holds it names it

    def advance(self, round_: int, state: dict[str, np.ndarray]) -> None:
        """The model of round `round_` (the model plus what the strategy serves with it), exact."""
        self.take(self.prepare(round_, state))

    def prepare(self, round_: int, state: dict[str, np.ndarray]) -> Step:
        """What `advance` would serve, computed and changing nothing: IntegrityError if the model cannot travel
        this way (fp16: a value beyond float16's range), so a round can fail before anything of it is stored."""
        if self.spec.codec == "fp16":
            wire = downlink_encode(self.spec, state, None)
            return Step(round_, ServedModel.in_memory(*encode(wire), encoding="fp16"),
                        downlink_decode(self.spec, Layout.of(state), wire, None))
        if self.base is None:   # the chain begins (again) at the exact model
            return self._chain_step(round_, *encode(state))
        layout = Layout.of(state)
        if layout != Layout.of(self.base):
            raise ValueError("the served model changed its layout; a delta cannot span that")
        wire = downlink_encode(self.spec, state, self.base)
        chain_layout, chain_blob = encode(downlink_decode(self.spec, layout, wire, self.base))
        delta = ServedModel.in_memory(*encode(wire), encoding=self.spec.codec, base_round=self._held.round,
                                      sha256=sha256(chain_blob))
        return self._chain_step(round_, chain_layout, chain_blob, delta=delta)

    def _chain_step(self, round_: int, layout: Layout, blob, *, delta: ServedModel | None = None) -> Step:
        """chain_r served in full (and as `delta` from chain_{r-1}, the one base a delta is kept for)."""
        digest = sha256(blob)
        return Step(round_, ServedModel.in_memory(layout, blob, sha256=digest), decode(layout, blob), delta=delta,
                    delta_base=self._held if delta is not None else None, held=Held(round_, digest))

    def take(self, step: Step) -> None:
        """Serve a prepared step: from now on sites fetch it (and chain_{r-1} is gone)."""
        self.round, self.full, self.base = step.round, step.full, step.base
        self.delta, self._delta_base, self._held = step.delta, step.delta_base, step.held

    def served(self, held: Held | None) -> ServedModel:
        """The delta for a site that holds chain_{r-1} exactly; the model in full for any other."""
        if self.delta is not None and held == self._delta_base:
            return self.delta
        return self.full

    def release(self) -> None:
        """Drop what is served (rebuilt by the next `advance`); the chain itself, `base`, stays."""
        self.full = self.delta = None
