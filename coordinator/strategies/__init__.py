"""Strategies: a rule over plain arrays plus a schedule that picks each round's sites; no I/O.

A `MeanRule` turns the round's weighted mean into the next global model (`step`); an
`UpdatesRule` needs every update at once (`combine`), so it runs neither under secure
aggregation nor under DP-FedAvg. A `Schedule` says who trains (`configure`/`opened`/`done`/
`local_steps`). The round engine (coordinator.engine) is the only caller and dispatches on the
rule's type. The site's half of each strategy is site_agent.local's registry. The interface
is fixed in docs/strategies-internals.md.
"""

from __future__ import annotations

from coordinator.strategies.base import (
    FedAvg,
    FedProx,
    MeanRule,
    Rule,
    Sampling,
    Schedule,
    State,
    Strategy,
    Update,
    UpdatesRule,
    keeps_mean,
    sample_sites,
)
from coordinator.strategies.ensemble import Ensemble, Members
from coordinator.strategies.exact import LBFGS, Newton
from coordinator.strategies.fedopt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from coordinator.strategies.robust import Krum, Median, MultiKrum, TrimmedMean
from coordinator.strategies.scaffold import Scaffold
from coordinator.strategies.sequential import CWT, SWT, Cyclic, Single
from plexus.config import RoundConfig, strategy_args
from plexus.errors import ConfigError

__all__ = [
    "CWT", "SWT", "Cyclic", "Ensemble", "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM",
    "FedProx", "FedYogi", "Krum", "LBFGS", "MeanRule", "Median", "Members", "MultiKrum", "Newton", "REGISTRY", "Rule",
    "Sampling", "Scaffold", "Schedule", "Single", "State", "Strategy", "TrimmedMean", "Update", "UpdatesRule",
    "keeps_mean", "make_strategy", "refuses_dp", "refuses_secure_aggregation", "sample_sites",
]

REGISTRY: dict[str, type[Rule]] = {cls.name: cls for cls in (
    FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad, Scaffold,
    Median, TrimmedMean, Krum, MultiKrum, CWT, SWT, Ensemble, LBFGS, Newton)}


def refuses_secure_aggregation(cls: type[Rule]) -> str:
    """Why the rule cannot run under secure aggregation; empty if it can."""
    return cls.clear_reason or ("it needs every update" if issubclass(cls, UpdatesRule) else "")


def refuses_dp(cls: type[Rule]) -> str:
    """Why DP-FedAvg would lose its meaning under the rule; empty if it keeps it."""
    return cls.dp_reason or ("it takes no mean" if issubclass(cls, UpdatesRule) else "")


def make_strategy(cfg: RoundConfig) -> Strategy:
    """The strategy a round config names, its args checked and cross-checked against the whole config."""
    name = cfg.strategy.name
    if name not in REGISTRY:
        raise ConfigError(f"strategy.name: unknown strategy {name!r}; known strategies: {sorted(REGISTRY)}")
    cls = REGISTRY[name]
    args = strategy_args(cfg.strategy)
    if cfg.privacy.secure_aggregation and (reason := refuses_secure_aggregation(cls)):
        summing = ", ".join(sorted(n for n, c in REGISTRY.items() if not refuses_secure_aggregation(c)))
        raise ConfigError(f"privacy.secure_aggregation: strategy {name!r} cannot combine with secure aggregation, "
                          f"which shows the coordinator only the sum of the model updates: {reason}; set "
                          f"privacy.secure_aggregation: false or use a strategy it can compute ({summing})")
    if cfg.privacy.dp is not None and (reason := refuses_dp(cls)):
        raise ConfigError(f"privacy.dp: strategy {name!r} cannot combine with DP-FedAvg because {reason}; "
                          "remove privacy.dp (privacy.dp_sgd protects each site's training instead) or use one "
                          f"of: {', '.join(sorted(n for n, c in REGISTRY.items() if not refuses_dp(c)))}")
    if cfg.privacy.dp_sgd is not None and cls.local_training:
        raise ConfigError(f"privacy.dp_sgd: strategy {name!r} {cls.local_training}, which Opacus's DP-SGD training "
                          "loop does not do; remove privacy.dp_sgd or use one of: "
                          f"{', '.join(sorted(n for n, c in REGISTRY.items() if not c.local_training))}")
    rule, schedule = cls.from_config(args, cfg)
    return Strategy(name, rule, schedule)
