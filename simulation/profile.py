"""Heterogeneity: each virtual site's compute speed, link and dropout, and the virtual time a task takes.

    default: {speed: 1.0, sample_ms: 0.1, up_mbps: 100, down_mbps: 100, latency_ms: 20, dropout: 0.0}
    sites:
      site-003: {speed: 0.25, up_mbps: 2}
      va: {dropout: 0.1}

A task granted at virtual time t reaches the coordinator with its answer at
t + (latency + model bytes / down) + samples × sample_ms / speed + (latency + answer bytes / up), where
samples are the rows its local training passes over (epochs × training rows, or steps × batch size) and the
bytes are those the task really moved. Evaluation and secure-aggregation messages cost their transfers only.
`dropout` is the chance that a site never answers a task (it is back for the next one), drawn from the job's
seed, the site and the task's round and kind: the same profile and seed drop the same answers every run.
Every figure is a model of the federation to be studied, not a measurement of this machine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from plexus import typed_yaml
from plexus.errors import ConfigError
from plexus.typed_yaml import in_range

MAX_PROFILE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class SiteProfile:
    speed: float = field(default=1.0, metadata=in_range(0, lo_open=True))            # × the reference compute
    sample_ms: float = field(default=0.1, metadata=in_range(0))                       # per training row, speed 1
    up_mbps: float = field(default=100.0, metadata=in_range(0, lo_open=True))
    down_mbps: float = field(default=100.0, metadata=in_range(0, lo_open=True))
    latency_ms: float = field(default=20.0, metadata=in_range(0))
    dropout: float = field(default=0.0, metadata=in_range(0, 1, hi_open=True))


@dataclass(frozen=True, slots=True)
class _ProfileFile:
    default: dict[str, float] = field(default_factory=dict)
    sites: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """The profile of every site: `default`, with the entries of `sites` over it."""

    default: SiteProfile = SiteProfile()
    sites: dict[str, SiteProfile] = field(default_factory=dict)

    def of(self, site: str) -> SiteProfile:
        return self.sites.get(site, self.default)

    def drops(self, site: str, seed: int, round_: int, kind: str) -> bool:
        """Whether `site` leaves this task unanswered (its dropout chance, drawn reproducibly)."""
        chance = self.of(site).dropout
        if chance <= 0:
            return False
        digest = hashlib.sha256(f"plexus/v1/simulate/dropout/{seed}/{site}/{round_}/{kind}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2 ** 64 < chance

    def transfer_s(self, site: str, nbytes: int, *, up: bool) -> float:
        p = self.of(site)
        return p.latency_ms / 1e3 + nbytes * 8 / ((p.up_mbps if up else p.down_mbps) * 1e6)

    def compute_s(self, site: str, samples: int) -> float:
        p = self.of(site)
        return samples * p.sample_ms / 1e3 / p.speed


def load_profile(path: Path | None, sites: list[str]) -> Profile:
    """The profile at `path` (None: every site at the defaults), checked against the simulation's sites."""
    if path is None:
        return Profile()
    raw = typed_yaml.load(Path(path), _ProfileFile, max_bytes=MAX_PROFILE_BYTES)
    default = _site_profile(SiteProfile(), raw.default, f"{path}: default")
    unknown = sorted(set(raw.sites) - set(sites))
    if unknown:
        shown = ", ".join(sites[:8]) + (", …" if len(sites) > 8 else "")
        raise ConfigError(f"{path}: sites: {unknown[:5]} are not sites of this simulation ({shown}); name sites "
                          "as the simulation does")
    return Profile(default, {name: _site_profile(default, entry, f"{path}: sites.{name}")
                             for name, entry in raw.sites.items()})


def _site_profile(base: SiteProfile, entry: dict, where: str) -> SiteProfile:
    fields = set(SiteProfile.__dataclass_fields__)
    unknown = sorted(set(entry) - fields)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; a site's profile has {sorted(fields)}")
    checked = typed_yaml.parse_value(entry, SiteProfile, source=where, path="") if entry else SiteProfile()
    return replace(base, **{key: getattr(checked, key) for key in entry})
