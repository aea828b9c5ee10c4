"""The coordinator's side of a secure round: it checks and relays, then removes the masks from the sum."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np

from plexus import crypto, errors
from plexus.secagg.checks import check_int, check_str, not_int, site_set
from plexus.secagg.messages import Advert, b_commitment, mask_sign, round_salt
from plexus.secagg.shamir import PRIME, shamir_combine

_SECRET_LIMIT = 1 << (8 * crypto.KEY_BYTES)
# Subsets of one secret's shares tried when some were altered: every way to leave out one or two liars
# among dozens of responders, while a round full of liars fails in bounded time.
MAX_DECODE_TRIES = 4096
_FIELDS = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16, np.dtype(np.uint32): 32}


class ServerSession:
    """The coordinator's view: it never holds a secret of a site that stays in the round.

    After unmask(), `rejected` maps each responder that revealed an altered share to why.
    """

    def __init__(self, job_id: str, round_: int, adverts: list[Advert], threshold: int):
        check_str(job_id, "job_id")
        check_int(round_, "round_")
        check_int(threshold, "threshold")
        self.job_id, self.round = job_id, round_
        self._salt = round_salt(job_id, round_)
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
        """Remove all masks from masked_sum (the sum of U3's inputs mod 2**bits: uint8, uint16 or uint32, the
        width of the round's field), in place; return it as the sum of q.

        Every share is checked before masked_sum is touched, so on error it is unchanged.
        """
        if not isinstance(masked_sum, np.ndarray) or masked_sum.dtype not in _FIELDS or masked_sum.ndim != 1:
            raise TypeError("masked_sum must be a 1-D uint8, uint16 or uint32 numpy array (the sum of the masked "
                            "inputs mod 2**bits)")
        bits = _FIELDS[masked_sum.dtype]
        if not masked_sum.flags.writeable:
            raise ValueError("masked_sum is read-only; pass a writable copy (it is unmasked in place)")
        check_int(chunk, "chunk")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        u2_set, u3_set = site_set(u2, "U2"), site_set(u3, "U3")
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
                if x != self._x[responder] or not_int(y) or not 0 <= y < PRIME:
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
                pair_terms.append((seed, mask_sign(u, v)))

        for start in range(0, masked_sum.size, chunk):
            view = masked_sum[start : start + chunk]
            for seed in self_seeds:
                view -= crypto.prg_words(seed, view.size, bits, start=start)
            for seed, sign in pair_terms:  # u added sign * PRG(s_uv) for v, which has no input to cancel it
                if sign > 0:
                    view -= crypto.prg_words(seed, view.size, bits, start=start)
                else:
                    view += crypto.prg_words(seed, view.size, bits, start=start)
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
