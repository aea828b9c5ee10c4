"""Secure aggregation's adverts between their protobuf and in-memory forms (used by both sides)."""

from __future__ import annotations

from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg import Advert


def advert_from_proto(a: fpb.SecAggAdvert) -> Advert:
    return Advert(site=a.site, c_pk=a.c_pk, s_pk=a.s_pk, num_samples=a.num_samples, b_commitment=a.b_commitment,
                  signature=a.signature, cert_pem=a.cert_pem)


def advert_to_proto(a: Advert) -> fpb.SecAggAdvert:
    return fpb.SecAggAdvert(site=a.site, c_pk=a.c_pk, s_pk=a.s_pk, num_samples=a.num_samples,
                            b_commitment=a.b_commitment, signature=a.signature, cert_pem=a.cert_pem)
