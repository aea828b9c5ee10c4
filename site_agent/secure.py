"""A party's side of a synchronous secure round after its advert (share, mask, unmask): what a site agent and a
relay masking its tier's mean both run. Free of torch, so a relay that imports it stays small."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from plexus.config import SECAGG_MAX_CLIP, RoundConfig
from plexus.dp import add_noise, distributed_std, noise_key
from plexus.errors import IntegrityError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg import NO_EXTRAS, SiteSession, advert_from_proto, mask_plan
from plexus.wire import DTYPES, Layout

log = logging.getLogger("plexus.site")


@dataclass
class Pending:
    """A site's secure round between phases: its secrets and the update it has not revealed."""

    session: SiteSession
    layout: Layout                  # the model's
    delta: dict[str, np.ndarray]    # what it masks, by name: Δ per model tensor, the value of each update extra
    extras: Layout = NO_EXTRAS      # the strategy's update extras (their base is zero)
    noise: bool = False    # an asynchronous cohort under distributed DP: this site adds its noise at masking
    floor: int = 0         # the fewest survivors that noise was drawn for: fewer are never unmasked


def secagg_phase(stub, task, job: RoundConfig, pending: Pending, *, ca_pem: bytes, submit_masked) -> bool:
    """One later phase of a synchronous secure round (share, mask, unmask) for the party holding `pending` (a
    site, or a relay masking its tier's mean); True once it revealed its shares (the round is over for it).
    `submit_masked(layout, masked)` streams a masked input."""
    payload = task.secagg
    header = dict(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce)
    if task.kind == fpb.TASK_SECAGG_SHARE:
        ciphertexts = pending.session.share([advert_from_proto(a) for a in payload.adverts],
                                            threshold=payload.threshold, total_weight=payload.total_weight,
                                            ca_pem=ca_pem)
        stub.SecAgg(fpb.SecAggMessage(**header, shares=fpb.SharesMessage(ciphertexts=ciphertexts)), timeout=30)
    elif task.kind == fpb.TASK_SECAGG_MASKED_INPUT:
        pending.session.receive_shares(dict(payload.shares_for_you))
        delta = pending.delta
        if pending.noise:   # an asynchronous cohort's share of distributed DP noise, for its own size
            pending.floor = max(pending.session.threshold, job.sites.min)   # t as checked at share()
            delta = cohort_noise(delta, job, task, pending.floor)
        # The job's uplink codec picks the field and entries (randk: its shared indices); |U1| as this site
        # checked it at share() sizes an 8- or 16-bit field's grid.
        plan = mask_plan(job.compression.uplink if job.compression else None, pending.layout, seed=job.seed,
                         round_=task.round, extras=pending.extras)
        field = plan.field(clip=payload.clip, frac_bits=payload.frac_bits, sites=pending.session.advertised)
        masked = pending.session.mask(plan.values(delta), field=field)
        submit_masked(plan.layout(), masked)
    else:
        if len(payload.u3) < pending.floor:
            raise IntegrityError(f"only {len(payload.u3)} sites survived to be unmasked, fewer than the "
                                 f"{pending.floor} this site's share of the distributed DP noise was drawn for; it "
                                 "will not reveal shares, since the sum would carry too little noise")
        reveals = pending.session.unmask(list(payload.u3))
        stub.SecAgg(fpb.SecAggMessage(**header, reveal=fpb.RevealMessage(reveals=[
            fpb.ShareReveal(peer=peer, kind=kind, x=x, y=y.to_bytes(66, "big"))
            for peer, (kind, x, y) in sorted(reveals.items())])), timeout=30)
        log.info("job %s round %d: revealed the shares for %d survivors", task.job_id, task.round,
                 len(payload.u3))
    return task.kind == fpb.TASK_SECAGG_UNMASK


def check_sums_fit(delta: list[np.ndarray], clip: float) -> None:
    """ValueError unless every value of a summing strategy's update lies within ±privacy.secagg.clip: secure
    aggregation clips each coordinate to it, which would make a sum (a count) wrong without anyone noticing."""
    largest = max((float(np.max(np.abs(d))) for d in delta if d.size), default=0.0)
    if largest <= clip:
        return
    need = 2.0 ** math.ceil(math.log2(largest))   # the order of magnitude only: the coordinator sees this reason
    fix = (f"set privacy.secagg.clip to at least {need:.10g}" if need <= SECAGG_MAX_CLIP else
           f"they exceed the largest clip, {SECAGG_MAX_CLIP}, so secure aggregation cannot sum them: send smaller "
           "sums (a statistics job's stay within the site's rows while its values lie inside their columns' "
           "`range`: widen a range its values exceed), or set privacy.secure_aggregation: false")
    raise ValueError(f"this site's sums reach up to {need:.10g} in magnitude, beyond privacy.secagg.clip = "
                     f"{clip:.10g}, and secure aggregation clips every value to ±clip, which would leave the pooled "
                     f"sums wrong; {fix}")


def cohort_noise(delta: dict[str, np.ndarray], job: RoundConfig, task, floor: int) -> dict[str, np.ndarray]:
    """This site's share of distributed DP noise, N(0, (zS)²/m): the m = `floor` fewest survivors the cohort can
    be unmasked over (the threshold of its real size, and sites.min) carry at least N(0, (zS)²) between them."""
    dp = job.privacy.dp
    std = distributed_std(dp.noise_multiplier, dp.clip_norm, floor)
    return add_noise(delta, std, noise_key(None, task.job_id, task.round, "site"))


def masked_input_messages(task: fpb.Task, layout: Layout, masked, chunk: int, digest=None):
    """The SubmitUpdate stream of a masked input (pieces of `masked`, in `layout`'s one unsigned width), chunk by
    chunk; `digest` (a hashlib object), if given, takes every byte sent."""
    yield fpb.UpdateMessage(header=fpb.UpdateHeader(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                                    nonce=task.nonce, manifest=layout.to_proto()))
    wire = DTYPES[layout.tensors[0].dtype] if layout.tensors else DTYPES["U32"]
    offset = 0
    for piece in masked:
        data = piece.astype(wire, copy=False).tobytes()
        if digest is not None:
            digest.update(data)
        for start in range(0, len(data), chunk):
            part = data[start:start + chunk]
            yield fpb.UpdateMessage(chunk={"offset": offset, "data": part})
            offset += len(part)
