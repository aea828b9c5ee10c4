"""Secure aggregation (Bonawitz et al. 2017): the protocol's math and each party's state, with no I/O.

A site's masked input is y_u = q_u + PRG(b_u) + sum over peers v of sign(u, v) * PRG(s_uv)
mod 2**32, where q_u is its clipped, weighted, fixed-point update. Pairwise masks cancel
in the sum; survivors' self masks and dropped sites' pairwise masks are removed from
Shamir shares revealed after the masked inputs are in.

Why the threshold must be a majority: an honest site reveals, for each peer, a share of
either its self-mask seed or its mask key, never both. With t > |U1| / 2 a coordinator
lying about who survived cannot collect t shares of both secrets of one site, because
that needs 2t > |U1| distinct honest responders. (This is the semi-honest-coordinator
version: there is no signed consistency round, so sites colluding with the coordinator
lower that margin; see the paper's active variant.)
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import math
import secrets
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from plexus import crypto, errors, identity
from plexus.config import MIN_SECURE_COHORT

PRIME = 2**521 - 1  # a Mersenne prime above every 32-byte secret
_SHARE_BYTES = (PRIME.bit_length() + 7) // 8
_SECRET_LIMIT = 1 << (8 * crypto.KEY_BYTES)
_ADVERT_LABEL = b"plexus/v1/secagg-advert"
_COMMIT_LABEL = b"plexus/v1/secagg-b-commitment"
_SHARE_LABEL = b"plexus/v1/secagg-share"
_SHARE_AAD_LABEL = b"plexus/v1/secagg-share-aad"
_ROUND_LABEL = b"plexus/v1/secagg-round"
# Fixed-point headroom: the sum of all sites' q stays within 2**30 + (sites / 2), inside int32.
_HEADROOM_BITS = 30
# Subsets of one secret's shares tried when some were altered: every way to leave out one or two liars
# among dozens of responders, while a round full of liars fails in bounded time.
MAX_DECODE_TRIES = 4096


# ---------------------------------------------------------------------------
# Shamir secret sharing over GF(PRIME)


def shamir_split(secret: int, n: int, t: int) -> list[tuple[int, int]]:
    """Split `secret` into shares (x, y) at x = 1..n; any t of them rebuild it, t - 1 reveal nothing."""
    _check_int(n, "n")
    _check_int(t, "t")
    _check_int(secret, "secret")
    if not 1 <= t <= n:
        raise ValueError(f"threshold t={t} must satisfy 1 <= t <= n={n}")
    if not 0 <= secret < PRIME:
        raise ValueError("secret must lie in [0, PRIME)")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    shares = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def shamir_combine(shares: list[tuple[int, int]], t: int) -> int:
    """The secret behind `shares` (Lagrange at 0); IntegrityError if fewer than t distinct x.

    Shares beyond the first t are checked against the polynomial the first t define,
    so altered shares raise instead of silently changing the result.
    """
    _check_int(t, "t")
    if t < 1:
        raise ValueError(f"threshold t must be >= 1, got {t}")
    points: dict[int, int] = {}
    for share in shares:
        if not isinstance(share, tuple) or len(share) != 2:
            raise TypeError(f"a share is an (x, y) tuple of ints, not {share!r}")
        x, y = share
        if _not_int(x) or _not_int(y) or not 0 < x < PRIME or not 0 <= y < PRIME:
            raise errors.IntegrityError("a share has x outside [1, PRIME) or y outside [0, PRIME)")
        if points.setdefault(x, y) != y:
            raise errors.IntegrityError(f"two different shares claim x = {x}")
    if len(points) < t:
        raise errors.IntegrityError(
            f"{len(points)} distinct shares cannot rebuild a secret shared {t}-of-n; {t} are needed"
        )
    xs = sorted(points)
    base = xs[:t]
    ys = [points[x] for x in base]
    weights = _barycentric_weights(base)
    for x in xs[t:]:
        if _interpolate(base, ys, weights, x) != points[x]:
            raise errors.IntegrityError(f"the share at x = {x} disagrees with the others: a share was altered")
    return _interpolate(base, ys, weights, 0)


def _barycentric_weights(xs: list[int]) -> list[int]:
    weights = []
    for xi in xs:
        denominator = 1
        for xj in xs:
            if xj != xi:
                denominator = denominator * (xi - xj) % PRIME
        weights.append(pow(denominator, -1, PRIME))
    return weights


def _interpolate(xs: list[int], ys: list[int], weights: list[int], at: int) -> int:
    k = len(xs)
    diffs = [(at - x) % PRIME for x in xs]
    suffix = [1] * (k + 1)
    for i in range(k - 1, -1, -1):
        suffix[i] = suffix[i + 1] * diffs[i] % PRIME
    total, prefix = 0, 1
    for i in range(k):
        total += ys[i] * weights[i] % PRIME * (prefix * suffix[i + 1] % PRIME)
        prefix = prefix * diffs[i] % PRIME
    return total % PRIME


def default_threshold(n: int) -> int:
    """The smallest majority of n participants, n // 2 + 1 (see the module docstring for why)."""
    _check_int(n, "n")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return n // 2 + 1


# ---------------------------------------------------------------------------
# Fixed point


def frac_bits(clip: float) -> int:
    """Fraction bits for updates clipped to ±clip: 30 - ceil(log2(clip)), so clip * 2**bits <= 2**30.

    Guarantee: for any weights w_u >= 0 with sum <= 1 and any |delta_u| <= clip, the exact
    sum of the per-site quantised values satisfies |sum_u q_u| <= 2**30 + S/2 (S sites, each
    rounding by at most 1/2), which is < 2**31 - 1 for every S < 2**31 - 2; so the sum mod
    2**32 read as int32 is exact. Resolution: 2**-bits, between clip * 2**-31 and clip * 2**-30.
    """
    if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating, np.integer)):
        raise TypeError(f"clip must be a number, not {type(clip).__name__}")
    clip = float(clip)
    if not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"clip must be a finite number > 0, got {clip}")
    mantissa, exponent = math.frexp(clip)  # clip = mantissa * 2**exponent, 0.5 <= mantissa < 1
    ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
    return _HEADROOM_BITS - ceil_log2


def quantize(delta: np.ndarray, weight: float, clip: float, bits: int) -> np.ndarray:
    """round(clip(delta, ±clip) * weight * 2**bits) as uint32 (two's complement mod 2**32), same shape."""
    delta = np.asarray(delta)
    if not (np.issubdtype(delta.dtype, np.floating) or np.issubdtype(delta.dtype, np.integer)):
        raise TypeError(f"delta must hold real numbers, not {delta.dtype}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)):
        raise TypeError(f"weight must be a number, not {type(weight).__name__}")
    if not 0 < weight <= 1:
        raise ValueError(f"weight must be in (0, 1] (num_samples / total_weight), got {weight}")
    _check_int(bits, "bits")
    limit = frac_bits(clip)
    if bits > limit:
        raise ValueError(f"bits={bits} exceeds frac_bits(clip={clip}) = {limit}; the sum could wrap around 2**32")
    # A sum is finite iff no element is NaN/inf (barring overflow of huge values, then check exactly).
    if not np.isfinite(np.sum(delta, dtype=np.float64)) and not np.isfinite(delta).all():
        raise errors.IntegrityError("the update holds NaN or infinity; refusing to quantise it")
    x = np.clip(delta, -clip, clip, dtype=np.float64)
    x *= math.ldexp(float(weight), bits)   # weight·2**bits: a power-of-two scaling of the same product
    np.rint(x, out=x)
    # |x| <= 2**30 + 1/2 (frac_bits' bound), so int32 holds it exactly; its bits are the value mod 2**32.
    return x.astype(np.int32).view(np.uint32)


def dequantize(total: np.ndarray, bits: int) -> np.ndarray:
    """Read a uint32 sum as signed int32 and scale it back: float64 value / 2**bits."""
    total = np.asarray(total)
    if total.dtype != np.uint32:
        raise TypeError(f"dequantize expects the uint32 sum, not {total.dtype}")
    _check_int(bits, "bits")
    return np.ldexp(total.view(np.int32).astype(np.float64), -bits)


# ---------------------------------------------------------------------------
# Adverts and wire encodings


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
    _check_str(job_id, "job_id")
    _check_int(round_, "round_")
    _check_str(site, "site")
    _check_int(num_samples, "num_samples")
    return _ADVERT_LABEL + _encode(job_id, round_, site, _key(c_pk, "c_pk"), _key(s_pk, "s_pk"), num_samples,
                                   _key(b_commitment, "b_commitment"))


def b_commitment(b: bytes, job_id: str, round_: int, site: str) -> bytes:
    """SHA-256 commitment to a self-mask seed, bound to its round and site.

    Bonawitz's protocol has no way to check revealed self-mask shares; with this
    signed commitment an altered share is found and left out instead of corrupting the sum.
    """
    return hashlib.sha256(_COMMIT_LABEL + _encode(job_id, round_, site, b)).digest()


def _encode(*fields: str | int | bytes) -> bytes:
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


def _decode(data: bytes, count: int) -> list[bytes]:
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


def _round_salt(job_id: str, round_: int) -> bytes:
    return _encode(_ROUND_LABEL, job_id, round_)


def _sign(u: str, v: str) -> int:
    """+1 if u adds the pairwise mask it shares with v, -1 if it subtracts it."""
    return 1 if u < v else -1


# ---------------------------------------------------------------------------
# A site's side


class SiteSession:
    """One site's secrets and state for one secure round.

    Calls go advertise -> share -> receive_shares -> mask -> unmask, each once
    (unmask may be repeated with the same survivors); anything else raises
    errors.FailedPrecondition. The site shares, masks and reveals only among at
    least `min_cohort` sites (U1, U2 and U3 alike): the coordinator learns a sum,
    and the sum of one site is that site's update. With n >= min_cohort >= 2
    sites, the majority threshold it insists on is at least 2.
    """

    def __init__(self, job_id: str, round_: int, site: str, *, min_cohort: int = MIN_SECURE_COHORT):
        _check_str(job_id, "job_id")
        _check_int(round_, "round_")
        _check_str(site, "site")
        _check_int(min_cohort, "min_cohort")
        if min_cohort < 2:
            raise ValueError(f"min_cohort must be >= 2 (a sum over one site is that site's update), got {min_cohort}")
        self.job_id, self.round, self.site, self.min_cohort = job_id, round_, site, min_cohort
        self._salt = _round_salt(job_id, round_)
        self._c_sk, self._c_pk = crypto.x25519_keypair()
        self._s_sk, self._s_pk = crypto.x25519_keypair()
        self._b = secrets.token_bytes(crypto.KEY_BYTES)
        self._advert: Advert | None = None
        self._peers: dict[str, Advert] | None = None  # U1 by site
        self._x: dict[str, int] = {}  # 1-based share coordinate of each site in sorted U1
        self._threshold = 0
        self._weight = 0.0
        self._share_keys: dict[str, bytes] = {}
        self._pair_seeds: dict[str, bytes] = {}
        self._own_shares: tuple[int, int] = (0, 0)
        self._received: dict[str, tuple[int, int]] | None = None  # U2: sender -> (share of b, share of s_sk)
        self._masked = False
        self._revealed: tuple[frozenset[str], dict[str, tuple[str, int, int]]] | None = None

    def advertise(self, num_samples: int, private_key_pem: bytes, cert_pem: bytes) -> Advert:
        """Sign this site's public keys and sample count with its certificate's key."""
        if self._advert is not None:
            raise errors.FailedPrecondition(f"site {self.site!r} has already advertised for this round")
        _check_int(num_samples, "num_samples")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        commitment = b_commitment(self._b, self.job_id, self.round, self.site)
        message = advert_message(self.job_id, self.round, self.site, self._c_pk, self._s_pk, num_samples, commitment)
        signature = crypto.sign(private_key_pem, message)
        crypto.verify(cert_pem, message, signature)  # a key that does not match the cert fails here, not at peers
        self._advert = Advert(self.site, self._c_pk, self._s_pk, num_samples, signature, bytes(cert_pem), commitment)
        return self._advert

    def share(
        self,
        adverts: list[Advert],
        *,
        threshold: int,
        total_weight: int,
        ca_pem: bytes,
        now: dt.datetime | None = None,
    ) -> dict[str, bytes]:
        """Check every advert, then return {peer: ciphertext of this site's shares for that peer}."""
        if self._advert is None:
            raise errors.FailedPrecondition("call advertise() before share()")
        if self._peers is not None:
            raise errors.FailedPrecondition("share() runs once per round; fresh shares would mix two polynomials")
        peers: dict[str, Advert] = {}
        for advert in adverts:
            if not isinstance(advert, Advert):
                raise TypeError(f"adverts must be Advert objects, not {type(advert).__name__}")
            if advert.site in peers:
                raise errors.IntegrityError(f"site {advert.site!r} appears twice in the relayed adverts")
            peers[advert.site] = advert
        if peers.get(self.site) != self._advert:
            raise errors.IntegrityError(f"the relayed adverts do not hold site {self.site!r}'s own advert unaltered")
        n = len(peers)
        self._check_cohort(n, "advertised in this round", "share its secrets")
        _check_int(threshold, "threshold")
        _check_int(total_weight, "total_weight")
        if threshold > n:
            raise errors.IntegrityError(f"threshold {threshold} exceeds the {n} participants; the round cannot finish")
        if threshold < default_threshold(n):
            raise errors.IntegrityError(
                f"threshold {threshold} is below a majority of the {n} participants "
                f"({default_threshold(n)}); a lower threshold would let the coordinator unmask a site"
            )
        for site in sorted(peers):
            self._check_advert(peers[site], ca_pem, now)
        if total_weight != sum(a.num_samples for a in peers.values()):
            raise errors.IntegrityError(
                f"total_weight {total_weight} is not the sum of the advertised sample counts "
                f"({sum(a.num_samples for a in peers.values())})"
            )
        keys = [a.c_pk for a in peers.values()] + [a.s_pk for a in peers.values()]
        if len(set(keys)) != len(keys):
            raise errors.IntegrityError("two adverts (or both keys of one advert) carry the same public key")

        order = sorted(peers)
        x = {site: i + 1 for i, site in enumerate(order)}
        share_keys, pair_seeds = {}, {}
        for v in order:
            if v != self.site:  # a small-order key is refused now, in phase 1, not mid-round
                share_keys[v] = self._derive(self._c_sk, peers[v].c_pk, crypto.SECAGG_SHARE_KEY, v)
                pair_seeds[v] = self._derive(self._s_sk, peers[v].s_pk, crypto.SECAGG_MASK, v)
        b_shares = shamir_split(int.from_bytes(self._b, "big"), n, threshold)
        s_shares = shamir_split(int.from_bytes(self._s_sk, "big"), n, threshold)
        out = {}
        for v in order:
            b_y, s_y = b_shares[x[v] - 1][1], s_shares[x[v] - 1][1]
            if v == self.site:
                self._own_shares = (b_y, s_y)
                continue
            plaintext = _encode(
                _SHARE_LABEL, self.site, v, x[v], b_y.to_bytes(_SHARE_BYTES, "big"), s_y.to_bytes(_SHARE_BYTES, "big")
            )
            out[v] = crypto.aead_encrypt(share_keys[v], plaintext, self._share_aad(self.site, v))
        self._peers, self._x, self._threshold = peers, x, threshold
        self._weight = self._advert.num_samples / total_weight
        self._share_keys, self._pair_seeds = share_keys, pair_seeds
        return out

    def receive_shares(self, ciphertexts: Mapping[str, bytes]) -> None:
        """Decrypt and check the shares peers sent this site; their senders plus this site form U2."""
        if self._peers is None:
            raise errors.FailedPrecondition("call share() before receive_shares()")
        if self._received is not None:
            raise errors.FailedPrecondition("receive_shares() runs once per round")
        if not isinstance(ciphertexts, Mapping):
            raise TypeError(f"ciphertexts must map sender -> bytes, not {type(ciphertexts).__name__}")
        received = {self.site: self._own_shares}
        for sender in sorted(ciphertexts):
            if sender == self.site or sender not in self._peers:
                raise errors.IntegrityError(f"shares relayed from {sender!r}, which is not another participant")
            try:
                plaintext = crypto.aead_decrypt(
                    self._share_keys[sender], ciphertexts[sender], self._share_aad(sender, self.site)
                )
                fields = _decode(plaintext, 6)
            except errors.IntegrityError:
                raise errors.IntegrityError(
                    f"the shares from site {sender!r} fail authentication: altered in transit or not for this round"
                ) from None
            label, frm, to, x, b_y, s_y = fields
            if (
                label != _SHARE_LABEL
                or frm != sender.encode("utf-8")
                or to != self.site.encode("utf-8")
                or x != self._x[self.site].to_bytes(8, "big")
                or len(b_y) != _SHARE_BYTES
                or len(s_y) != _SHARE_BYTES
            ):
                raise errors.IntegrityError(f"the shares from site {sender!r} are addressed or encoded wrongly")
            b_int, s_int = int.from_bytes(b_y, "big"), int.from_bytes(s_y, "big")
            if b_int >= PRIME or s_int >= PRIME:
                raise errors.IntegrityError(f"the shares from site {sender!r} lie outside the field")
            received[sender] = (b_int, s_int)
        if len(received) < self._threshold:
            raise errors.IntegrityError(
                f"only {len(received)} sites (this one included) shared their secrets; threshold {self._threshold} "
                "cannot be met, so the round must be abandoned"
            )
        self._check_cohort(len(received), "shared their secrets (this one included)", "mask its update")
        self._received = received

    def mask(self, delta_chunks: Iterable[np.ndarray], *, clip: float, bits: int) -> Iterator[np.ndarray]:
        """Yield the masked uint32 input chunk by chunk for consecutive chunks of the flattened update.

        Runs once: two different inputs under the same masks would reveal their difference.
        """
        if self._received is None:
            raise errors.FailedPrecondition("call receive_shares() before mask()")
        if self._masked:
            raise errors.FailedPrecondition("mask() runs once per round; a second masked input would leak")
        _check_int(bits, "bits")
        if bits > frac_bits(clip):
            raise ValueError(f"bits={bits} exceeds frac_bits(clip={clip}) = {frac_bits(clip)}; the sum could wrap")
        self_seed = crypto.hkdf(self._b, info=crypto.SECAGG_SELF_MASK, salt=self._salt)
        pairs = [(self._pair_seeds[v], _sign(self.site, v)) for v in sorted(self._received) if v != self.site]
        self._masked = True
        return _masked_chunks(delta_chunks, self._weight, clip, bits, self_seed, pairs)

    def unmask(self, survivors: list[str]) -> dict[str, tuple[str, int, int]]:
        """Reveal this site's share of b for each survivor (U3) and of s_sk for each site in U2 but not U3."""
        if not self._masked:
            raise errors.FailedPrecondition("call mask() before unmask(); survivors are sites whose input arrived")
        u3 = _site_set(survivors, "survivors")
        if self._revealed is not None:
            if u3 != self._revealed[0]:
                raise errors.IntegrityError(
                    f"unmask() was already answered for survivors {sorted(self._revealed[0])}; answering for "
                    f"{sorted(u3)} could reveal both secrets of one site"
                )
            return dict(self._revealed[1])
        if self.site not in u3:
            raise errors.IntegrityError(f"site {self.site!r} is not among the survivors, so it must not reveal shares")
        unknown = u3 - set(self._received)
        if unknown:
            raise errors.IntegrityError(f"survivors {sorted(unknown)} never sent this site shares (they are not in U2)")
        if len(u3) < self._threshold:
            raise errors.IntegrityError(f"{len(u3)} survivors are fewer than the threshold {self._threshold}")
        self._check_cohort(len(u3), "survived to be unmasked", "reveal shares")
        x = self._x[self.site]
        reveal = {v: ("b", x, b) if v in u3 else ("s", x, s) for v, (b, s) in sorted(self._received.items())}
        self._revealed = (u3, reveal)
        return dict(reveal)

    def _check_cohort(self, size: int, who: str, refused: str) -> None:
        if size < self.min_cohort:
            raise errors.IntegrityError(
                f"only {size} sites {who}, fewer than this site's minimum secure cohort of {self.min_cohort} "
                f"(policy.min_secure_cohort): it will not {refused}, since the sum would expose too few sites")

    def _check_advert(self, advert: Advert, ca_pem: bytes, now: dt.datetime | None) -> None:
        if _not_int(advert.num_samples) or advert.num_samples < 1:
            raise errors.IntegrityError(f"the advert of site {advert.site!r} has an invalid sample count")
        try:
            identity.verify_issued(advert.cert_pem, ca_pem, name=advert.site, kind="site", now=now)
            crypto.verify(
                advert.cert_pem,
                advert_message(self.job_id, self.round, advert.site, advert.c_pk, advert.s_pk, advert.num_samples,
                               advert.b_commitment),
                advert.signature,
            )
        except (errors.IntegrityError, ValueError, TypeError) as exc:
            raise errors.IntegrityError(f"the advert of site {advert.site!r} fails verification: {exc}") from None

    def _derive(self, private: bytes, peer_public: bytes, label: bytes, peer: str) -> bytes:
        try:
            return crypto.hkdf(crypto.x25519_shared(private, peer_public), info=label, salt=self._salt)
        except errors.IntegrityError as exc:
            raise errors.IntegrityError(f"the advert of site {peer!r}: {exc}") from None

    def _share_aad(self, frm: str, to: str) -> bytes:
        return _encode(_SHARE_AAD_LABEL, self.job_id, self.round, frm, to)


def _masked_chunks(
    delta_chunks: Iterable[np.ndarray],
    weight: float,
    clip: float,
    bits: int,
    self_seed: bytes,
    pairs: list[tuple[bytes, int]],
) -> Iterator[np.ndarray]:
    position = 0
    for chunk in delta_chunks:
        y = quantize(np.asarray(chunk).reshape(-1), weight, clip, bits)
        count = y.size
        y += crypto.prg_uint32(self_seed, count, start=position)  # uint32 arithmetic wraps mod 2**32
        for seed, sign in pairs:
            if sign > 0:
                y += crypto.prg_uint32(seed, count, start=position)
            else:
                y -= crypto.prg_uint32(seed, count, start=position)
        position += count
        yield y


# ---------------------------------------------------------------------------
# The coordinator's side


class ServerSession:
    """The coordinator's view: it never holds a secret of a site that stays in the round.

    After unmask(), `rejected` maps each responder that revealed an altered share to why.
    """

    def __init__(self, job_id: str, round_: int, adverts: list[Advert], threshold: int):
        _check_str(job_id, "job_id")
        _check_int(round_, "round_")
        _check_int(threshold, "threshold")
        self.job_id, self.round = job_id, round_
        self._salt = _round_salt(job_id, round_)
        self._adverts: dict[str, Advert] = {}
        for advert in adverts:
            if not isinstance(advert, Advert):
                raise TypeError(f"adverts must be Advert objects, not {type(advert).__name__}")
            if advert.site in self._adverts:
                raise errors.IntegrityError(f"site {advert.site!r} advertised twice")
            self._adverts[advert.site] = advert
        if not 1 <= threshold <= len(self._adverts):
            raise ValueError(f"threshold {threshold} must lie between 1 and the {len(self._adverts)} adverts")
        self.threshold = threshold
        self._x = {site: i + 1 for i, site in enumerate(sorted(self._adverts))}
        self.rejected: dict[str, str] = {}

    def unmask(
        self,
        masked_sum: np.ndarray,
        u2: list[str],
        u3: list[str],
        reveals: Mapping[str, Mapping[str, tuple[str, int, int]]],
        *,
        chunk: int = 1 << 20,
    ) -> np.ndarray:
        """Remove all masks from masked_sum (uint32 sum of U3's inputs), in place; return it as the sum of q.

        Every share is checked before masked_sum is touched, so on error it is unchanged.
        """
        if not isinstance(masked_sum, np.ndarray) or masked_sum.dtype != np.uint32 or masked_sum.ndim != 1:
            raise TypeError("masked_sum must be a 1-D uint32 numpy array (the sum of the masked inputs mod 2**32)")
        if not masked_sum.flags.writeable:
            raise ValueError("masked_sum is read-only; pass a writable copy (it is unmasked in place)")
        _check_int(chunk, "chunk")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        u2_set, u3_set = _site_set(u2, "U2"), _site_set(u3, "U3")
        unknown = (u2_set | u3_set) - set(self._adverts)
        if unknown:
            raise errors.IntegrityError(f"sites {sorted(unknown)} did not advertise in this round")
        if not u3_set <= u2_set:
            raise errors.IntegrityError(
                f"sites {sorted(u3_set - u2_set)} sent masked inputs without sharing (not in U2)"
            )
        if len(u3_set) < self.threshold:
            raise errors.IntegrityError(
                f"only {len(u3_set)} masked inputs arrived; threshold {self.threshold} cannot be met"
            )
        if not isinstance(reveals, Mapping):
            raise TypeError(f"reveals must map responder -> its unmask() output, not {type(reveals).__name__}")
        outsiders = set(reveals) - u3_set
        if outsiders:
            raise errors.IntegrityError(f"responders {sorted(outsiders)} are not survivors (U3) and must not answer")
        if len(reveals) < self.threshold:
            raise errors.IntegrityError(
                f"only {len(reveals)} survivors answered unmask; {self.threshold} are needed to remove the masks"
            )

        points: dict[str, dict[str, tuple[int, int]]] = {v: {} for v in u2_set}
        for responder in sorted(reveals):
            reveal = reveals[responder]
            if not isinstance(reveal, Mapping) or set(reveal) != u2_set:
                raise errors.IntegrityError(f"responder {responder!r} did not reveal exactly one share per site in U2")
            for v, item in reveal.items():
                want = "b" if v in u3_set else "s"
                if not isinstance(item, tuple) or len(item) != 3:
                    raise errors.IntegrityError(f"responder {responder!r} sent a malformed share for {v!r}")
                kind, x, y = item
                if kind != want:
                    raise errors.IntegrityError(
                        f"responder {responder!r} revealed a {kind!r} share for {v!r}, which needs a {want!r} share: "
                        "a site must never reveal the mask key of a survivor nor the self mask of a dropped site"
                    )
                if x != self._x[responder] or _not_int(y) or not 0 <= y < PRIME:
                    raise errors.IntegrityError(
                        f"responder {responder!r} sent a share for {v!r} at the wrong x or out of range"
                    )
                points[v][responder] = (x, y)

        # Each secret is rebuilt from shares that agree and match what its owner signed (the self-mask
        # seed's commitment, the mask key's public key); responders whose shares do not are rejected.
        self.rejected = {}
        self_seeds = []
        for v in sorted(u3_set):
            commitment = self._adverts[v].b_commitment
            b = self._recover(v, "self-mask seed", points[v], lambda secret, v=v, c=commitment: b_commitment(
                secret.to_bytes(crypto.KEY_BYTES, "big"), self.job_id, self.round, v) == c)
            if b is None:
                raise errors.IntegrityError(
                    f"the rebuilt self-mask seed of {v!r} does not match its signed commitment: fewer than "
                    f"t = {self.threshold} of the shares revealed by {sorted(points[v])} are honest; the round "
                    "cannot be unmasked")
            self_seeds.append(crypto.hkdf(b.to_bytes(crypto.KEY_BYTES, "big"), info=crypto.SECAGG_SELF_MASK,
                                          salt=self._salt))
        pair_terms = []
        for v in sorted(u2_set - u3_set):
            s_pk = self._adverts[v].s_pk
            secret = self._recover(v, "mask key", points[v], lambda secret, pk=s_pk: crypto.x25519_public(
                secret.to_bytes(crypto.KEY_BYTES, "big")) == pk)
            if secret is None:
                raise errors.IntegrityError(
                    f"the rebuilt mask key of dropped site {v!r} is wrong: fewer than t = {self.threshold} of the "
                    f"shares revealed by {sorted(points[v])} rebuild its advertised key (either responders "
                    f"altered them or {v!r} dealt shares that do not match it)")
            s_sk = secret.to_bytes(crypto.KEY_BYTES, "big")
            for u in sorted(u3_set):
                shared = crypto.x25519_shared(s_sk, self._adverts[u].s_pk)
                seed = crypto.hkdf(shared, info=crypto.SECAGG_MASK, salt=self._salt)
                pair_terms.append((seed, _sign(u, v)))

        for start in range(0, masked_sum.size, chunk):
            view = masked_sum[start : start + chunk]
            for seed in self_seeds:
                view -= crypto.prg_uint32(seed, view.size, start=start)
            for seed, sign in pair_terms:  # u added sign * PRG(s_uv) for v, which has no input to cancel it
                if sign > 0:
                    view -= crypto.prg_uint32(seed, view.size, start=start)
                else:
                    view += crypto.prg_uint32(seed, view.size, start=start)
        return masked_sum

    def _recover(self, v: str, what: str, by_responder: dict[str, tuple[int, int]], verify) -> int | None:
        """v's secret from the largest set of shares that agree and pass `verify`; None if no t of them do.

        Responders left out are recorded in `rejected`. Leaving out k of r shares is tried
        for k = 0, 1, ... in turn, so honest shares are never blamed while an agreeing set
        that verifies exists among more of them.
        """
        found = _agreeing_secret(by_responder, self.threshold, verify)
        if found is None:
            return None
        secret, liars = found
        for r in liars:
            self.rejected.setdefault(r, (
                f"revealed an altered share of the {what} of {v!r}: the {len(by_responder) - len(liars)} other "
                f"shares agree and rebuild the {what} {v!r} signed for; this one was left out"))
        return secret


def _agreeing_secret(by_responder: dict[str, tuple[int, int]], t: int, verify) -> tuple[int, tuple[str, ...]] | None:
    """(secret, responders left out) for the fewest left out such that the rest agree and verify."""
    responders = sorted(by_responder)
    tries = 0
    for k in range(len(responders) - t + 1):
        for left_out in itertools.combinations(responders, k):
            kept = [by_responder[r] for r in responders if r not in left_out]
            try:
                secret = shamir_combine(kept, t)
            except errors.IntegrityError:   # the kept shares disagree among themselves
                secret = None
            if secret is not None and secret < _SECRET_LIMIT and verify(secret):
                return secret, left_out
            tries += 1
            if tries >= MAX_DECODE_TRIES:
                return None
    return None


# ---------------------------------------------------------------------------
# Argument checks


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _check_int(value: object, name: str) -> None:
    if _not_int(value):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")


def _check_str(value: object, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")


def _key(value: object, name: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != crypto.KEY_BYTES:
        raise ValueError(f"{name} must be {crypto.KEY_BYTES} raw bytes")
    return bytes(value)


def _site_set(sites: object, what: str) -> frozenset[str]:
    if isinstance(sites, (str, bytes)) or not isinstance(sites, Iterable):
        raise TypeError(f"{what} must be a list of site names")
    sites = list(sites)
    if not all(isinstance(s, str) for s in sites):
        raise TypeError(f"{what} must be a list of site names")
    if len(set(sites)) != len(sites):
        raise errors.IntegrityError(f"{what} names a site twice: {sorted(sites)}")
    return frozenset(sites)
