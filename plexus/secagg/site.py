"""A site's side of a secure round: its secrets, its shares for the peers, its masked input, its reveals."""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from plexus import crypto, errors, identity
from plexus.config import MIN_SECURE_COHORT
from plexus.secagg.checks import check_int, check_str, not_int, site_set
from plexus.secagg.fixed_point import Field
from plexus.secagg.messages import (
    SHARE_AAD_LABEL,
    SHARE_LABEL,
    Advert,
    advert_message,
    b_commitment,
    decode_fields,
    encode_fields,
    mask_sign,
    round_salt,
)
from plexus.secagg.shamir import PRIME, SHARE_BYTES, default_threshold, shamir_split

MAX_WEIGHT = 2 ** 31   # a synchronous round's largest advertised sample count, as the coordinator's bound


class SiteSession:
    """One site's secrets and state for one secure round.

    Calls go advertise -> share -> receive_shares -> mask -> unmask, each once
    (unmask may be repeated with the same survivors); anything else raises
    errors.FailedPrecondition. The site shares, masks and reveals only among at
    least `min_cohort` sites (U1, U2 and U3 alike): the coordinator learns a sum,
    and the sum of one site is that site's update. With n >= min_cohort >= 2
    sites, the majority threshold it insists on is at least 2.
    """

    def __init__(self, job_id: str, round_: int, site: str, *, min_cohort: int = MIN_SECURE_COHORT,
                 max_weight: int = MAX_WEIGHT):
        """`max_weight`: the largest advertised weight (num_samples) this site sends or accepts from a peer:
        2**31 samples, or an asynchronous cohort's staleness-weighted count of 2**-16 quanta (2**47)."""
        check_str(job_id, "job_id")
        check_int(round_, "round_")
        check_str(site, "site")
        check_int(min_cohort, "min_cohort")
        check_int(max_weight, "max_weight")
        if min_cohort < 2:
            raise ValueError(f"min_cohort must be >= 2 (a sum over one site is that site's update), got {min_cohort}")
        if not 1 <= max_weight < 1 << 63:
            raise ValueError(f"max_weight must be in [1, 2**63), got {max_weight}")
        self.job_id, self.round, self.site, self.min_cohort = job_id, round_, site, min_cohort
        self.max_weight = max_weight
        self._salt = round_salt(job_id, round_)
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

    @property
    def threshold(self) -> int:
        """The threshold t this site checked (a majority of U1) and dealt its shares with; 0 before share()."""
        return self._threshold

    def advertise(self, num_samples: int, private_key_pem: bytes, cert_pem: bytes) -> Advert:
        """Sign this site's public keys and sample count with its certificate's key."""
        if self._advert is not None:
            raise errors.FailedPrecondition(f"site {self.site!r} has already advertised for this round")
        check_int(num_samples, "num_samples")
        if not 1 <= num_samples <= self.max_weight:
            raise ValueError(f"num_samples must be between 1 and {self.max_weight}, got {num_samples}")
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
        check_int(threshold, "threshold")
        check_int(total_weight, "total_weight")
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
            plaintext = encode_fields(
                SHARE_LABEL, self.site, v, x[v], b_y.to_bytes(SHARE_BYTES, "big"), s_y.to_bytes(SHARE_BYTES, "big")
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
                fields = decode_fields(plaintext, 6)
            except errors.IntegrityError:
                raise errors.IntegrityError(
                    f"the shares from site {sender!r} fail authentication: altered in transit or not for this round"
                ) from None
            label, frm, to, x, b_y, s_y = fields
            if (
                label != SHARE_LABEL
                or frm != sender.encode("utf-8")
                or to != self.site.encode("utf-8")
                or x != self._x[self.site].to_bytes(8, "big")
                or len(b_y) != SHARE_BYTES
                or len(s_y) != SHARE_BYTES
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

    def mask(self, delta_chunks: Iterable[np.ndarray], *, field: Field,
             rng: np.random.Generator | None = None) -> Iterator[np.ndarray]:
        """Yield the masked input chunk by chunk (unsigned `field.bits`-bit words) for consecutive chunks of the
        flattened update; `rng` rounds stochastically in 8- and 16-bit fields (default: OS randomness).

        Runs once: two different inputs under the same masks would reveal their difference.
        """
        if self._received is None:
            raise errors.FailedPrecondition("call receive_shares() before mask()")
        if self._masked:
            raise errors.FailedPrecondition("mask() runs once per round; a second masked input would leak")
        if not isinstance(field, Field):
            raise TypeError(f"field must be a Field, not {type(field).__name__}")
        if not field.holds(len(self._peers)):
            raise errors.IntegrityError(
                f"a {field.bits}-bit field with grid clip/{field.levels} cannot hold the sum of the "
                f"{len(self._peers)} advertised sites without wrapping around; refusing to mask")
        self_seed = crypto.hkdf(self._b, info=crypto.SECAGG_SELF_MASK, salt=self._salt)
        pairs = [(self._pair_seeds[v], mask_sign(self.site, v)) for v in sorted(self._received) if v != self.site]
        if rng is None and field.bits < 32:
            rng = np.random.default_rng(secrets.randbits(128))   # the site's own: the coordinator knows every seed
        self._masked = True
        return _masked_chunks(delta_chunks, self._weight, field, rng, self_seed, pairs)

    @property
    def advertised(self) -> int:
        """|U1|: how many sites' adverts this site checked at share() (0 before); a small field's grid is sized
        for their sum."""
        return len(self._peers or ())

    def unmask(self, survivors: list[str]) -> dict[str, tuple[str, int, int]]:
        """Reveal this site's share of b for each survivor (U3) and of s_sk for each site in U2 but not U3."""
        if not self._masked:
            raise errors.FailedPrecondition("call mask() before unmask(); survivors are sites whose input arrived")
        u3 = site_set(survivors, "survivors")
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
        if not_int(advert.num_samples) or not 1 <= advert.num_samples <= self.max_weight:
            raise errors.IntegrityError(f"the advert of site {advert.site!r} has an invalid sample count (not "
                                        f"between 1 and {self.max_weight})")
        try:
            # A party is a site, or a relay masking its tier's mean (kind relay): either way a leaf of the CA.
            kind = "relay" if _kind(advert.cert_pem) == "relay" else "site"
            identity.verify_issued(advert.cert_pem, ca_pem, name=advert.site, kind=kind, now=now)
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
        return encode_fields(SHARE_AAD_LABEL, self.job_id, self.round, frm, to)


def _masked_chunks(
    delta_chunks: Iterable[np.ndarray],
    weight: float,
    field: Field,
    rng: np.random.Generator | None,
    self_seed: bytes,
    pairs: list[tuple[bytes, int]],
) -> Iterator[np.ndarray]:
    position = 0
    for chunk in delta_chunks:
        y = field.quantize(chunk, weight, rng)
        count = y.size
        y += crypto.prg_words(self_seed, count, field.bits, start=position)  # unsigned arithmetic wraps mod 2**bits
        for seed, sign in pairs:
            if sign > 0:
                y += crypto.prg_words(seed, count, field.bits, start=position)
            else:
                y -= crypto.prg_words(seed, count, field.bits, start=position)
        position += count
        yield y


def _kind(cert_pem: bytes) -> str:
    try:
        return identity.identity_from_cert(cert_pem).kind
    except errors.PlexusError:
        return ""
