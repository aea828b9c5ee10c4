"""Byzantine-robust rules over every update at once: coordinate-wise median, trimmed mean, (Multi-)Krum.

Updates are unweighted (a site could inflate num_samples); tensors are stacked one at a
time in float64, so the peak is one tensor across all updates, not all models twice.
"""

from __future__ import annotations

import math

import numpy as np

from coordinator.strategies.base import Schedule, State, Update, UpdatesRule, cast, is_float
from plexus.config import RoundConfig
from plexus.errors import ConfigError

_CLEAR = "it inspects each site's update, not only their sum"
_NO_DP = ("DP-FedAvg calibrates its noise to a clipped weighted mean, and this rule takes no mean, so the "
          "privacy guarantee would not hold")


def _stack(updates: list[Update], name: str) -> np.ndarray:
    return np.stack([np.asarray(u.state[name], np.float64) for u in updates])


class Robust(UpdatesRule):
    """Shared plumbing: site-ordered updates, the output layout, integer tensors from the first update."""

    clear_reason = _CLEAR
    dp_reason = _NO_DP

    def combine(self, round_: int, current: State, updates: list[Update]) -> State:
        if len(updates) < max(1, self.min_contributors):
            raise ValueError(f"{self.name} needs at least {max(1, self.min_contributors)} updates, got "
                             f"{len(updates)}; the engine must not close a round below min_contributors")
        updates = sorted(updates, key=lambda u: u.site)
        template = current or updates[0].state
        return self.pick(updates, {name: np.asarray(a).dtype for name, a in template.items()})

    def pick(self, updates: list[Update], dtypes: dict[str, np.dtype]) -> State:
        """The next model's tensors (of these dtypes) from the site-ordered updates."""
        out = {}
        for name, dtype in dtypes.items():
            if is_float(dtype):
                out[name] = cast(self.coordinate(_stack(updates, name)), dtype)
            else:
                out[name] = cast(updates[0].state[name], dtype)
        return out

    def coordinate(self, stacked: np.ndarray) -> np.ndarray:
        """The rule along axis 0 of one tensor stacked across updates."""
        raise NotImplementedError


class Median(Robust):
    """Coordinate-wise median (Yin et al. 2018)."""

    name = "median"

    def coordinate(self, stacked):
        return np.median(stacked, axis=0)


class TrimmedMean(Robust):
    """Drop the floor(beta·n) largest and smallest values per coordinate, mean the rest (Yin et al. 2018)."""

    name = "trimmed_mean"

    def __init__(self, *, beta: float = 0.1) -> None:
        self.beta = beta

    def coordinate(self, stacked):
        n = stacked.shape[0]
        k = math.floor(round(self.beta * n, 9))
        return np.sort(stacked, axis=0)[k:n - k].mean(axis=0)


def krum_scores(updates: list[Update], names: list[str], f: int) -> np.ndarray:
    """Each update's sum of squared L2 distances (over all `names` together) to its n − f − 2 nearest others."""
    n = len(updates)
    dist = np.zeros((n, n))
    for name in names:
        x = _stack(updates, name).reshape(n, -1)
        for i in range(n):
            dist[i] += np.square(x - x[i]).sum(axis=1)
    nearest = n - f - 2
    return np.array([np.sort(np.delete(dist[i], i))[:nearest].sum() for i in range(n)])


class Krum(Robust):
    """Blanchard et al. 2017: the update closest to its n − f − 2 nearest neighbours; needs n ≥ 2f + 3."""

    name = "krum"

    def __init__(self, *, f: int = 1) -> None:
        self.f = f
        self.min_contributors = 2 * f + 3

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[Krum, Schedule]:
        f, need = args.f, 2 * args.f + 3
        fix = f"set sites.min: {need} (or more) or lower strategy.args.f"
        if cfg.sites.min < need:
            raise ConfigError(f"sites.min: {cls.name} with f={f} needs n > 2f+2, at least {need} updates per "
                              f"round, but sites.min is {cfg.sites.min}; {fix}")
        if cfg.sites.count is not None and cfg.sites.count < need:
            raise ConfigError(f"sites.count: {cls.name} with f={f} needs n > 2f+2, at least {need} updates per "
                              f"round, but sites.count samples only {cfg.sites.count}; raise sites.count to "
                              f"{need} or lower strategy.args.f")
        return super().from_config(args, cfg)

    def ranking(self, updates: list[Update], dtypes: dict[str, np.dtype]) -> list[int]:
        """Update indices from the lowest Krum score up; ties go to the lower site name."""
        scores = krum_scores(updates, [name for name, dt in dtypes.items() if is_float(dt)], self.f)
        return sorted(range(len(updates)), key=lambda i: (scores[i], updates[i].site))

    def pick(self, updates, dtypes):
        best = updates[self.ranking(updates, dtypes)[0]]
        return {name: cast(best.state[name], dtype) for name, dtype in dtypes.items()}


class MultiKrum(Krum):
    """The unweighted mean of the m updates with the lowest Krum scores (m defaults to n − f)."""

    name = "multi_krum"

    def __init__(self, *, f: int = 1, m: int | None = None) -> None:
        super().__init__(f=f)
        self.m = m

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[MultiKrum, Schedule]:
        built = super().from_config(args, cfg)
        most = cfg.sites.min - args.f
        if args.m is not None and args.m > most:
            raise ConfigError(f"strategy.args.m: {args.m} is out of range; with sites.min {cfg.sites.min} and "
                              f"f={args.f} a round may have only {cfg.sites.min} updates, so use m in 1..{most} "
                              "(or raise sites.min)")
        return built

    def pick(self, updates, dtypes):
        order = self.ranking(updates, dtypes)
        m = len(updates) - self.f if self.m is None else min(self.m, len(updates))
        chosen = [updates[i] for i in order[:m]]
        return {name: cast(_stack(chosen, name).mean(axis=0), dtype) if is_float(dtype)
                else cast(chosen[0].state[name], dtype) for name, dtype in dtypes.items()}
