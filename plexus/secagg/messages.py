"""What secure aggregation's parties sign and send: adverts, commitments, length-prefixed fields, and the
adverts' protobuf form (used by both sides)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from plexus import errors
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg.checks import check_int, check_str, key_bytes

ADVERT_LABEL = b"plexus/v1/secagg-advert"
COMMIT_LABEL = b"plexus/v1/secagg-b-commitment"
SHARE_LABEL = b"plexus/v1/secagg-share"
SHARE_AAD_LABEL = b"plexus/v1/secagg-share-aad"
ROUND_LABEL = b"plexus/v1/secagg-round"


@dataclass(frozen=True)
class Advert:
    """A site's signed phase-0 message: its two X25519 public keys and its sample count."""

    site: str
    c_pk: bytes
    s_pk: bytes
    num_samples: int
    signature: bytes
    cert_pem: bytes
    b_commitment: bytes      # b_commitment(b): lets the server check a reconstructed self-mask seed


def advert_message(job_id: str, round_: int, site: str, c_pk: bytes, s_pk: bytes, num_samples: int,
                   b_commitment: bytes) -> bytes:
    """The canonical bytes an advert's signature covers: a label, then length-prefixed fields."""
    check_str(job_id, "job_id")
    check_int(round_, "round_")
    check_str(site, "site")
    check_int(num_samples, "num_samples")
    return ADVERT_LABEL + encode_fields(job_id, round_, site, key_bytes(c_pk, "c_pk"), key_bytes(s_pk, "s_pk"),
                                        num_samples, key_bytes(b_commitment, "b_commitment"))


def b_commitment(b: bytes, job_id: str, round_: int, site: str) -> bytes:
    """SHA-256 commitment to a self-mask seed, bound to its round and site.

    Bonawitz's protocol has no way to check revealed self-mask shares; with this
    signed commitment an altered share is found and left out instead of corrupting the sum.
    """
    return hashlib.sha256(COMMIT_LABEL + encode_fields(job_id, round_, site, b)).digest()


def encode_fields(*fields: str | int | bytes) -> bytes:
    """Length-prefixed fields (8-byte big-endian lengths); ints are 8-byte big-endian, str UTF-8."""
    out = bytearray()
    for field in fields:
        if isinstance(field, str):
            data = field.encode("utf-8")
        elif isinstance(field, int) and not isinstance(field, bool):
            if not 0 <= field < 1 << 64:
                raise ValueError(f"integer field {field} is outside [0, 2**64)")
            data = field.to_bytes(8, "big")
        else:
            data = bytes(field)
        out += len(data).to_bytes(8, "big") + data
    return bytes(out)


def decode_fields(data: bytes, count: int) -> list[bytes]:
    """The `count` fields encode_fields wrote; IntegrityError if `data` is truncated or longer."""
    fields, pos = [], 0
    for _ in range(count):
        if pos + 8 > len(data):
            raise errors.IntegrityError("malformed secure-aggregation message: truncated")
        length = int.from_bytes(data[pos : pos + 8], "big")
        pos += 8
        if pos + length > len(data):
            raise errors.IntegrityError("malformed secure-aggregation message: truncated")
        fields.append(data[pos : pos + length])
        pos += length
    if pos != len(data):
        raise errors.IntegrityError("malformed secure-aggregation message: trailing bytes")
    return fields


def round_salt(job_id: str, round_: int) -> bytes:
    """What binds every key a round derives to that job and round."""
    return encode_fields(ROUND_LABEL, job_id, round_)


def mask_sign(u: str, v: str) -> int:
    """+1 if u adds the pairwise mask it shares with v, -1 if it subtracts it."""
    return 1 if u < v else -1


def advert_from_proto(a: fpb.SecAggAdvert) -> Advert:
    """An advert as received over the wire."""
    return Advert(site=a.site, c_pk=a.c_pk, s_pk=a.s_pk, num_samples=a.num_samples, b_commitment=a.b_commitment,
                  signature=a.signature, cert_pem=a.cert_pem)


def advert_to_proto(a: Advert) -> fpb.SecAggAdvert:
    """An advert as sent over the wire."""
    return fpb.SecAggAdvert(site=a.site, c_pk=a.c_pk, s_pk=a.s_pk, num_samples=a.num_samples,
                            b_commitment=a.b_commitment, signature=a.signature, cert_pem=a.cert_pem)
