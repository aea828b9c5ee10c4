"""Strategies: small classes over plain arrays that pick sites and fold results.

A strategy does no I/O. `configure` says which available sites train this
round; `aggregate` turns the weighted mean of the sites' models into the next
global model (`aggregate_updates` gets every update, for rules that cannot
stream). The round engine (coordinator.engine) is the only caller. The
interface is fixed in docs/strategies-internals.md.
"""

from __future__ import annotations

from coordinator.strategies.base import FedAvg, FedProx, Sampling, State, Strategy, Update, read_args, sample_sites
from coordinator.strategies.ensemble import Ensemble
from coordinator.strategies.fedopt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from coordinator.strategies.robust import Krum, Median, MultiKrum, TrimmedMean
from coordinator.strategies.scaffold import Scaffold
from coordinator.strategies.sequential import CWT, SWT
from plexus.config import RoundConfig
from plexus.errors import ConfigError

__all__ = [
    "CWT", "SWT", "Ensemble", "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedProx", "FedYogi", "Krum",
    "Median", "MultiKrum", "REGISTRY", "Sampling", "Scaffold", "State", "Strategy", "TrimmedMean", "Update",
    "make_strategy", "sample_sites",
]

REGISTRY: dict[str, type[Strategy]] = {cls.name: cls for cls in (
    FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad, Scaffold,
    Median, TrimmedMean, Krum, MultiKrum, CWT, SWT, Ensemble)}


def make_strategy(cfg: RoundConfig) -> Strategy:
    """The strategy a round config names, its args checked and cross-checked against the whole config."""
    name = cfg.strategy.name
    if name not in REGISTRY:
        raise ConfigError(f"strategy.name: unknown strategy {name!r}; known strategies: {sorted(REGISTRY)}")
    cls = REGISTRY[name]
    args = read_args(name, cls.params, cfg.strategy.args)
    if cfg.privacy.secure_aggregation and not cls.secure_aggregation:
        summing = ", ".join(sorted(n for n, c in REGISTRY.items() if c.secure_aggregation))
        raise ConfigError(f"privacy.secure_aggregation: strategy {name!r} cannot combine with secure aggregation, "
                          f"which shows the coordinator only the sum of the model updates: {cls.clear_reason}; set "
                          f"privacy.secure_aggregation: false or use a strategy it can compute ({summing})")
    if cfg.privacy.dp is not None and not cls.dp_compatible:
        raise ConfigError(f"privacy.dp: strategy {name!r} cannot combine with DP-FedAvg because {cls.dp_reason}; "
                          "remove privacy.dp (privacy.dp_sgd protects each site's training instead) or use one "
                          f"of: {', '.join(sorted(n for n, c in REGISTRY.items() if c.dp_compatible))}")
    if cfg.privacy.dp_sgd is not None and cls.local_training:
        raise ConfigError(f"privacy.dp_sgd: strategy {name!r} {cls.local_training}, which Opacus's DP-SGD training "
                          "loop does not do; remove privacy.dp_sgd or use one of: "
                          f"{', '.join(sorted(n for n, c in REGISTRY.items() if not c.local_training))}")
    strategy = cls.from_config(args, cfg)
    strategy.sampling = Sampling(cfg.sites.fraction, cfg.sites.count, cfg.sites.min, cfg.seed)
    return strategy
