"""A compressed downlink at the site (compression.downlink): the model as the coordinator encoded it, checked
and decoded into the model this site trains from and measures its update against (coordinator.downlink).

The header says how the model travels (ModelHeader.encoding): a site never guesses. delta8 applies to the
model the site kept from its last fetch (state.ServedChain), or, where the header says zero_base (the served
chain's first model), to all-zero tensors; a delta it cannot apply, or one whose result is not the model the
coordinator named by its SHA-256, is an IntegrityError, and the site fetches again in full.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from plexus.compression import DOWNLINK, downlink_codec, downlink_decode, is_delta, zero_base
from plexus.config import DownlinkSpec, RoundConfig
from plexus.errors import IntegrityError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import Layout, assemble, decode, encode
from site_agent.state import HeldModel, ServedChain

log = logging.getLogger("plexus.site")

ENCODINGS = {fpb.MODEL_DENSE: "dense", fpb.MODEL_FP16: "fp16", fpb.MODEL_DELTA8: "delta8", fpb.MODEL_DELTA4: "delta4"}
# The encodings each downlink codec may serve: a delta codec sends the chain in full to a site without its base.
SERVED_AS = {"none": ("dense",), "fp16": ("fp16",), **{c: ("dense", c) for c in DOWNLINK if is_delta(c)}}


def downlink_spec(job: RoundConfig) -> DownlinkSpec:
    return job.compression.downlink if job.compression is not None else DownlinkSpec()


def header_layout(spec: DownlinkSpec, header: fpb.ModelHeader, model: Layout) -> tuple[str, Layout]:
    """(encoding, manifest layout) of a model header, checked against the job's downlink and model before a
    byte of the model is read."""
    encoding = ENCODINGS.get(header.encoding)
    if encoding not in SERVED_AS[spec.codec]:
        raise IntegrityError(f"the coordinator sent the model as {encoding or header.encoding!r}, but this job's "
                             f"compression.downlink is {spec.codec!r} (served as {', '.join(SERVED_AS[spec.codec])})")
    if header.zero_base and (not is_delta(encoding) or header.base_round):
        what = f"as a delta against round {header.base_round}" if is_delta(encoding) else f"as {encoding}"
        raise IntegrityError(f"the coordinator sent round {header.round} {what} and from a zero base; only a delta "
                             "may start from zeros, and then it names no base round")
    layout = Layout.from_proto(header.manifest)
    expected = model if encoding == "dense" else downlink_codec(spec).wire_layout(model)
    expected.require_same(layout, what=f"the coordinator's model ({encoding})")
    return encoding, layout


def decode_model(spec: DownlinkSpec, header: fpb.ModelHeader, layout: Layout, blob, model: Layout,
                 held: HeldModel | None) -> dict[str, np.ndarray]:
    """The model (layout `model`) that a complete, validated blob of the header's `layout` (header_layout)
    encodes; under delta8, checked to be the one the coordinator named by its SHA-256."""
    encoding = ENCODINGS[header.encoding]
    if encoding == "fp16":
        return downlink_decode(spec, model, decode(layout, blob), None)
    if encoding == "dense":
        state = decode(model, blob)
    else:
        if header.zero_base:   # the chain's first model: needs nothing held
            base = zero_base(model)
        elif held is None or header.base_round != held.round:
            have = "no model" if held is None else f"the model of round {held.round}"
            raise IntegrityError(f"the coordinator sent round {header.round} as a delta against round "
                                 f"{header.base_round}, but this site holds {have}")
        else:
            base = held.state
        state = downlink_decode(spec, model, decode(layout, blob), base)
        blob = encode(state)[1]
    digest = hashlib.sha256(blob).digest()
    if digest != header.sha256:
        raise IntegrityError(f"the model of round {header.round} this site decoded has SHA-256 {digest.hex()[:16]}…, "
                             f"not the {header.sha256.hex()[:16] or 'none'}… the coordinator named")
    return state


def fetch_model(stub, task_id: str, expected: Layout, spec: DownlinkSpec, chain: ServedChain | None, *,
                timeout: float) -> dict[str, np.ndarray]:
    """Fetch a task's model (layout `expected`) over a compressed downlink and decode it. delta8 (`chain`): name
    the model kept from the last fetch, so the coordinator may send a delta against it; if that delta cannot be
    applied, fetch again in full; keep the result for the next fetch."""
    held = chain.load(expected) if chain is not None else None
    while True:
        have = {"have_round": held.round, "have_sha256": held.sha256} if held is not None else {}
        stream = stub.FetchModel(fpb.FetchModelRequest(task_id=task_id, zero_base=True, **have), timeout=timeout)
        header = model_header(stream)
        _, layout = header_layout(spec, header, expected)
        blob = assemble(layout, (message.chunk for message in stream))   # read whole: the call ends cleanly
        try:
            state = decode_model(spec, header, layout, blob, expected, held)
        except IntegrityError as exc:
            if held is None:
                raise
            log.warning("job %s: %s; fetching the model again in full", header.job_id, exc)
            held = None
            continue
        if chain is not None:
            chain.keep(header.round, state)
        return state


def model_header(stream) -> fpb.ModelHeader:
    """The header that opens a FetchModel stream."""
    first = next(stream, None)
    if first is None:
        raise ValueError("the model stream ended before its header")
    if first.WhichOneof("body") != "header":
        raise ValueError("the model stream did not start with a header")
    return first.header
