"""Statistics jobs (`kind: statistics`): the sites' sums over their raw tables pooled in one round, the job's
"model" (plexus.statistics), with optional DP noise per query.

In the clear the rule sees every site's sums (min and max combine as the min and max of the sites'); under
secure aggregation only their sum, as the uniform mean times the number of sites (min/max are refused there
at config). The site half is site_agent.local's `Statistics`.
"""

from __future__ import annotations

import numpy as np

from coordinator.strategies.base import MeanRule, Sampling, Schedule, State, Update, UpdatesRule
from plexus import statistics as stats
from plexus.config import RoundConfig, StatisticsSpec
from plexus.errors import ConfigError


class _Pooling:
    """What both rules share: the spec, DP noise on the pooled sums, and the ledger of what the noise spent."""

    def __init__(self, spec: StatisticsSpec, *, rng: np.random.Generator | None = None) -> None:
        self.spec = spec
        # Never seeded from the job: anyone who can read the config could then rebuild the noise and remove it.
        self.rng = rng if rng is not None else np.random.default_rng()
        self._ledger: dict[str, float] = {}

    def noised(self, pooled: State) -> State:
        """The pooled sums with statistics.dp's noise on every query (unchanged without dp)."""
        if self.spec.dp is None:
            return pooled
        pooled, ledger = stats.add_dp_noise(self.spec, pooled, self.rng)
        self._ledger = privacy_ledger(ledger)
        return pooled

    def ledger(self) -> dict[str, float]:
        return dict(self._ledger)


def privacy_ledger(ledger: stats.DPLedger) -> dict[str, float]:
    """What the job-level "privacy" metrics record of add_dp_noise's ledger: ε and δ in total (basic composition),
    the number of queries and each one's ε. The queries themselves follow from the spec (statistics.dp_ledger)."""
    return {"epsilon": ledger.epsilon, "delta": ledger.delta, "queries": float(len(ledger.queries)),
            "epsilon_per_query": max((q.epsilon for q in ledger.queries), default=0.0)}


def _spec(cfg: RoundConfig) -> StatisticsSpec:
    if cfg.statistics is None:
        raise ConfigError("strategy.name: statistics is the strategy of `kind: statistics` jobs, which derive it; "
                          "set kind: statistics with a statistics block (docs/statistics.md)")
    return cfg.statistics


class Statistics(_Pooling, MeanRule):
    """Under secure aggregation: every site weighs 1, so the round's mean times its number of sites is the sum."""

    name = "statistics"
    weighting = "uniform"
    dp_reason = "a statistics job noises each query's sums itself: set statistics.dp, not privacy.dp"
    local_training = "sums the site's raw table instead of training"

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[MeanRule | UpdatesRule, Schedule]:
        spec = _spec(cfg)
        rule = cls(spec) if cfg.privacy.secure_aggregation else ClearStatistics(spec)
        return rule, Sampling.of(cfg)

    def step(self, round_: int, current: State | None, mean: State, contributors: list[str], *,
             population: int) -> State:
        sites = len(contributors)
        return self.noised({name: np.asarray(value, dtype=np.float64) * sites for name, value in mean.items()})


class ClearStatistics(_Pooling, UpdatesRule):
    """In the clear: plexus.statistics.combine_clear over every site's sums (sums added, min/max of the sites')."""

    name = "statistics"
    dp_reason = Statistics.dp_reason
    local_training = Statistics.local_training

    def combine(self, round_: int, current: State, updates: list[Update]) -> State:
        per_site = [{name: np.asarray(value) for name, value in u.state.items()} for u in updates]
        pooled = stats.combine_clear(self.spec, per_site)
        return self.noised({name: np.asarray(value, dtype=np.float64) for name, value in pooled.items()})

