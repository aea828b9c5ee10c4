"""A compressed downlink (compression.downlink): what the sites of a job fetch, and the model they then hold.

fp16: every float tensor travels as F16; the sites train from fp16(model).

A delta codec (delta8, delta4): the sites share one *served chain*. It begins at chain_0 = dequant(Q(model_0 - 0)),
the codec's delta from all-zero tensors (plexus.compression.zero_base), which every site that decodes it
(FetchModelRequest.zero_base) fetches as that compact wire, whatever it holds (an older agent gets chain_0 in
full), and goes on as chain_r = chain_{r-1} + dequant(Q(model_r - chain_{r-1})), all computed with
plexus.compression's own encode and decode, so the coordinator and every site hold the same float32 bits. Later, a
site that holds chain_{r-1} (it says so with the SHA-256 of its wire blob) gets the delta; any other site (a missed
round, a late joiner, a damaged copy) gets chain_r in full. Either way it then holds chain_r. The chain lives only
here, in memory: a coordinator that restarts begins it again, from zeros, at the model it takes up. Checkpoints
always hold the exact model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from coordinator.served import Held, ServedModel
from plexus.compression import downlink_decode, downlink_encode, is_delta, zero_base
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
    from_zeros: ServedModel | None = None


class Downlink:
    """The served side of one job's compressed downlink; `advance` with each new model."""

    def __init__(self, spec: DownlinkSpec):
        if spec.codec != "fp16" and not is_delta(spec.codec):
            raise ValueError(f"downlink codec {spec.codec!r} is served as it is, without a Downlink")
        self.spec = spec
        self.round: int | None = None
        self.base: dict[str, np.ndarray] | None = None   # what the sites decode: fp16(model), or chain_r
        self.full: ServedModel | None = None             # for every site (delta8: any the delta is not for)
        self.delta: ServedModel | None = None            # delta8: for the sites that hold chain_{r-1}
        self._delta_base: Held | None = None             # delta8: chain_{r-1} as such a site names it
        self._held: Held | None = None                   # delta8: chain_r as a site that holds it names it
        self.from_zeros: ServedModel | None = None       # at the chain's start: chain_0 from zeros

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
        layout = Layout.of(state)
        if self.base is not None and layout != Layout.of(self.base):
            raise ValueError("the served model changed its layout; a delta cannot span that")
        start = self.base is None   # the chain begins (again): from zeros, a delta every site can apply
        base = zero_base(layout) if start else self.base
        wire = downlink_encode(self.spec, state, base)
        chain_layout, chain_blob = encode(downlink_decode(self.spec, layout, wire, base))
        digest = sha256(chain_blob)
        delta = ServedModel.in_memory(*encode(wire), encoding=self.spec.codec, zero_base=start,
                                      base_round=0 if start else self._held.round, sha256=digest)
        full = ServedModel.in_memory(chain_layout, chain_blob, sha256=digest)
        chain, held = decode(chain_layout, chain_blob), Held(round_, digest)
        if start:   # the compact wire is all of chain_0; in full only for agents that cannot read it
            return Step(round_, full, chain, held=held, from_zeros=delta)
        return Step(round_, full, chain, delta=delta, delta_base=self._held, held=held)

    def take(self, step: Step) -> None:
        """Serve a prepared step: from now on sites fetch it (and chain_{r-1} is gone)."""
        self.round, self.full, self.base = step.round, step.full, step.base
        self.delta, self._delta_base, self._held = step.delta, step.delta_base, step.held
        self.from_zeros = step.from_zeros

    def served(self, held: Held | None, *, zero_base: bool = False) -> ServedModel:
        """The delta for a site that holds chain_{r-1} exactly; at the chain's start, its wire from zeros for a site
        that decodes that (`zero_base`), whatever it holds; the model in full for any other."""
        if self.delta is not None and held == self._delta_base:
            return self.delta
        if self.from_zeros is not None and zero_base:
            return self.from_zeros
        return self.full

    def release(self) -> None:
        """Drop what is served (rebuilt by the next `advance`); the chain itself, `base`, stays."""
        self.full = self.delta = self.from_zeros = None
