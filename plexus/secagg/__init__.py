"""Secure aggregation (Bonawitz et al. 2017): the protocol's math and each party's state, with no I/O.

A site's masked input is y_u = q_u + PRG(b_u) + sum over peers v of sign(u, v) * PRG(s_uv)
mod 2**m, where q_u is its clipped, weighted, quantised update: m = 32 (fixed point), or 16 and 8 for the
fp16 and int8 uplink codecs (a public grid, plan.py). Pairwise masks cancel in the sum; survivors'
self masks and dropped sites' pairwise masks are removed from Shamir shares revealed after the
masked inputs are in.

Why the threshold must be a majority: an honest site reveals, for each peer, a share of
either its self-mask seed or its mask key, never both. With t > |U1| / 2 a coordinator
lying about who survived cannot collect t shares of both secrets of one site, because
that needs 2t > |U1| distinct honest responders. (This is the semi-honest-coordinator
version: there is no signed consistency round, so sites colluding with the coordinator
lower that margin; see the paper's active variant.)

Modules: shamir (secret sharing), fixed_point (quantisation, the field), plan (the masked layout per
uplink codec), messages (adverts, encodings, their protobuf form), site (SiteSession) and server
(ServerSession).
"""

from __future__ import annotations

from plexus.secagg.fixed_point import Field, dequantize, frac_bits, quantize
from plexus.secagg.messages import Advert, advert_from_proto, advert_message, advert_to_proto, b_commitment
from plexus.secagg.plan import NO_EXTRAS, MaskPlan, mask_plan
from plexus.secagg.server import MAX_DECODE_TRIES, ServerSession
from plexus.secagg.shamir import PRIME, default_threshold, shamir_combine, shamir_split
from plexus.secagg.site import MAX_WEIGHT, SiteSession

__all__ = ["MAX_DECODE_TRIES", "MAX_WEIGHT", "NO_EXTRAS", "PRIME", "Advert", "Field", "MaskPlan", "ServerSession",
           "SiteSession", "advert_from_proto", "advert_message", "advert_to_proto", "b_commitment",
           "default_threshold", "dequantize", "frac_bits", "mask_plan", "quantize", "shamir_combine", "shamir_split"]
