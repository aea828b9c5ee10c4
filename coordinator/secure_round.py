"""The coordinator's side of one secure-aggregation round (Bonawitz et al. 2017).

Four phases, each a task per site: advertise (train, then signed keys), share
(encrypted t-of-n shares, relayed), mask (the masked update, summed mod 2**m in the field of the job's
uplink codec: plexus.secagg.plan),
unmask (reveals that remove exactly the survivors' masks). The coordinator only
ever holds masked vectors and their sum; PlexusError subclasses raised here say
why a phase cannot go on, and the engine fails the round with that message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.aggregate import MaskedSum
from plexus import crypto
from plexus.config import SecAggSpec, UplinkSpec, max_secure_sites
from plexus.errors import FailedPrecondition, IntegrityError, Reason
from plexus.secagg import (
    MAX_WEIGHT,
    NO_EXTRAS,
    PRIME,
    Advert,
    ServerSession,
    advert_message,
    default_threshold,
    frac_bits,
    mask_plan,
)
from plexus.vocab import SecaggPhase, TaskKind
from plexus.wire import Layout

TASK_KIND = {SecaggPhase.ADVERTISE: TaskKind.SECAGG_ADVERTISE, SecaggPhase.SHARE: TaskKind.SECAGG_SHARE,
             SecaggPhase.MASK: TaskKind.SECAGG_MASK, SecaggPhase.UNMASK: TaskKind.SECAGG_UNMASK}
NEXT = {SecaggPhase.ADVERTISE: SecaggPhase.SHARE, SecaggPhase.SHARE: SecaggPhase.MASK,
        SecaggPhase.MASK: SecaggPhase.UNMASK, SecaggPhase.UNMASK: SecaggPhase.DONE}
MAX_CIPHERTEXT = 4096
_PROBE_KEY = bytes(range(1, 33))   # an X25519 private key whose exchange with a small-order public key is all zeros


class SecureRoundFailed(FailedPrecondition):
    """Too few sites answered a phase, or the unmasking could not be completed."""


@dataclass
class SecureRound:
    job_id: str
    round: int
    layout: Layout                 # the model's layout (float tensors)
    spec: SecAggSpec
    min_sites: int
    max_weight: int = MAX_WEIGHT   # an advert's largest num_samples (a cohort's: staleness quanta; 1: uniform)
    uplink: UplinkSpec | None = None   # the job's uplink codec: the field and entries sites mask (None: as always)
    seed: int = 0                  # the job's seed (randk's shared indices)
    extras: Layout = NO_EXTRAS     # the rule's update extras (MeanRule.update_extras), masked as values
    phase: SecaggPhase = SecaggPhase.ADVERTISE
    adverts: dict[str, Advert] = field(default_factory=dict)
    inbox: dict[str, dict[str, bytes]] = field(default_factory=dict)   # recipient -> sender -> ciphertext
    reveals: dict[str, dict[str, tuple[str, int, int]]] = field(default_factory=dict)
    u1: list[str] = field(default_factory=list)
    u2: list[str] = field(default_factory=list)
    u3: list[str] = field(default_factory=list)
    threshold: int = 0
    total_weight: int = 0
    rejected: dict[str, str] = field(default_factory=dict)   # unmask responders whose shares were altered

    def __post_init__(self):
        self.bits = frac_bits(self.spec.clip)
        self.plan = mask_plan(self.uplink, self.layout, seed=self.seed, round_=self.round, extras=self.extras)
        self.masked_layout = self.plan.layout()
        self.masked = MaskedSum(self.masked_layout)

    @property
    def task_kind(self) -> TaskKind:
        return TASK_KIND[self.phase]

    # answers ------------------------------------------------------------------------------
    def on_advert(self, site: str, advert: Advert) -> None:
        if advert.site != site:
            raise IntegrityError(f"advert names site {advert.site!r}, but the caller's certificate is {site!r}")
        if not 1 <= advert.num_samples <= self.max_weight:
            why = " (this job weighs every site's update 1, whatever its rows)" if self.max_weight == 1 else ""
            raise IntegrityError(f"num_samples must be between 1 and {self.max_weight}; got {advert.num_samples}"
                                 f"{why}", reason=Reason.NUM_SAMPLES)
        if len(advert.c_pk) != 32 or len(advert.s_pk) != 32 or len(advert.b_commitment) != 32:
            raise IntegrityError("an advert carries two 32-byte X25519 public keys and a 32-byte commitment")
        # What every other site checks of it before it shares (SiteSession.share): one advert that fails there
        # would fail the whole round for all, so it is refused here, as this site's alone.
        try:
            crypto.verify(advert.cert_pem, advert_message(self.job_id, self.round, site, advert.c_pk, advert.s_pk,
                                                          advert.num_samples, advert.b_commitment), advert.signature)
            for key in (advert.c_pk, advert.s_pk):
                crypto.x25519_shared(_PROBE_KEY, key)   # a small-order key: IntegrityError
        except (IntegrityError, ValueError, TypeError) as exc:
            raise IntegrityError(f"the advert fails verification: {exc}") from None
        taken = {k for other, a in self.adverts.items() if other != site for k in (a.c_pk, a.s_pk)}
        if advert.c_pk == advert.s_pk or {advert.c_pk, advert.s_pk} & taken:
            raise IntegrityError("the advert reuses a public key (its own two, or another site's); every key of a "
                                 "round is fresh")
        self.adverts[site] = advert

    def on_shares(self, site: str, ciphertexts: dict[str, bytes]) -> None:
        expected = set(self.u1) - {site}
        if set(ciphertexts) != expected:
            raise IntegrityError(f"shares must be addressed to exactly the other sites of U1 {sorted(expected)}")
        if any(len(c) > MAX_CIPHERTEXT for c in ciphertexts.values()):
            raise IntegrityError(f"a share ciphertext exceeds {MAX_CIPHERTEXT} bytes")
        for recipient, ciphertext in ciphertexts.items():
            self.inbox.setdefault(recipient, {})[site] = ciphertext

    def on_reveal(self, site: str, reveals: dict[str, tuple[str, int, int]]) -> None:
        survivors, dropped = set(self.u3), set(self.u2) - set(self.u3)
        x = self.u1.index(site) + 1   # shares sit at each site's place in sorted U1
        for peer, (kind, at, y) in reveals.items():
            wanted = "b" if peer in survivors else "s" if peer in dropped else None
            if kind != wanted:
                raise IntegrityError(f"reveal for {peer!r} must be {wanted or 'absent'!r}, not {kind!r}; "
                                     "a site never reveals both secrets of one peer")
            if at != x or not 0 <= y < PRIME:   # refused here, so one malformed reveal cannot stop the unmasking
                raise IntegrityError(f"the share for {peer!r} must sit at x = {x} with y below the field prime")
        if set(reveals) != set(self.u2):
            raise IntegrityError(f"a reveal covers exactly U2 {sorted(self.u2)}")
        self.reveals[site] = reveals

    # transitions --------------------------------------------------------------------------
    def advance(self, answered: list[str], participants: list[str]) -> list[str]:
        """Close the current phase with the sites that answered; returns the next phase's sites."""
        answered = sorted(answered)
        if self.phase == SecaggPhase.ADVERTISE:
            self.threshold = max(self.spec.threshold or 0, default_threshold(max(1, len(answered))))
        # sites.min counts contributors (U3); the unmask phase only needs t responders.
        need = self.threshold if self.phase == SecaggPhase.UNMASK else max(self.threshold, self.min_sites)
        if len(answered) < need:
            missing = sorted(set(participants) - set(answered))
            raise SecureRoundFailed(
                f"secure aggregation, {self.phase} phase: {len(answered)} of {len(participants)} sites answered "
                f"(missing: {', '.join(missing) or 'none'}); at least {need} are needed "
                f"(threshold t={self.threshold}, sites.min={self.min_sites})")
        if self.phase == SecaggPhase.ADVERTISE:
            limit = max_secure_sites(self.plan.codec)
            if limit is not None and len(answered) > limit:   # the driver opens no round this large; defence in depth
                raise SecureRoundFailed(
                    f"secure aggregation: {len(answered)} sites advertised, but uplink codec {self.plan.codec!r} "
                    f"sums at most {limit} in its {self.plan.bits}-bit field; set sites.count to {limit} or fewer")
            self.u1 = answered
            self.adverts = {s: self.adverts[s] for s in answered}
            self.total_weight = sum(a.num_samples for a in self.adverts.values())
        elif self.phase == SecaggPhase.SHARE:
            self.u2 = answered
        elif self.phase == SecaggPhase.MASK:
            self.u3 = answered
        self.phase = NEXT[self.phase]
        return {SecaggPhase.SHARE: self.u1, SecaggPhase.MASK: self.u2, SecaggPhase.UNMASK: self.u3,
                SecaggPhase.DONE: []}[self.phase]

    def payload(self, site: str) -> dict:
        """What a site's task for the current phase carries."""
        base = {"threshold": self.threshold, "total_weight": self.total_weight, "clip": self.spec.clip,
                "frac_bits": self.bits}
        if self.phase == SecaggPhase.SHARE:
            return base | {"adverts": [self.adverts[s] for s in self.u1]}
        if self.phase == SecaggPhase.MASK:
            inbox = self.inbox.get(site, {})
            return base | {"shares_for_you": {s: inbox[s] for s in self.u2 if s in inbox}, "u2": self.u2}
        if self.phase == SecaggPhase.UNMASK:
            return base | {"u2": self.u2, "u3": self.u3}
        return base

    def weight_of(self, site: str) -> int:
        return self.adverts[site].num_samples

    def result(self) -> tuple[dict[str, np.ndarray], int]:
        """The survivors' weighted mean update Σ n_u Δ_u / Σ n_u (float64 per tensor, the update extras' mean
        value among them; randk: zero off its shared indices) and Σ n_u over U3.

        Altered shares are left out while t honest ones remain; their senders end up in `rejected`.
        """
        session = ServerSession(self.job_id, self.round, [self.adverts[s] for s in self.u1], self.threshold)
        total = session.unmask(self.masked.acc, self.u2, self.u3, self.reveals)
        self.rejected = session.rejected
        survivors_weight = sum(self.weight_of(s) for s in self.u3)
        field = self.plan.field(clip=self.spec.clip, frac_bits=self.bits, sites=len(self.u1))
        flat = field.dequantize(total) * (self.total_weight / survivors_weight)
        return self.plan.dense(flat), survivors_weight
