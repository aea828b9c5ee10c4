"""Strategies: small classes over plain arrays that pick sites and fold results.

A strategy does no I/O. `configure` says which available sites train this
round; `aggregate` turns the weighted mean of the sites' models into the next
global model. The round engine (coordinator.engine) is the only caller.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from plexus.config import StrategySpec
from plexus.errors import ConfigError

State = dict[str, np.ndarray]


class FedAvg:
    """McMahan et al. 2017: the next model is Σ n_k x_k / Σ n_k over the round's sites."""

    secure_aggregation = True  # a weighted sum: secure aggregation can compute it without seeing any update
    uses_current = False       # the next model is the mean alone: the engine may free the old one first

    def configure(self, round_: int, available: list[str]) -> list[str]:
        return sorted(available)

    def aggregate(self, round_: int, current: Mapping[str, np.ndarray], mean: State) -> State:
        return mean


REGISTRY = {"fedavg": FedAvg}


def make_strategy(spec: StrategySpec):
    """Build the strategy a round config names; unknown names list the known ones."""
    if spec.name not in REGISTRY:
        raise ConfigError(f"strategy.name: unknown strategy {spec.name!r}; known strategies: {sorted(REGISTRY)}")
    try:
        return REGISTRY[spec.name](**spec.args)
    except TypeError as exc:
        raise ConfigError(f"strategy.args: {spec.name} does not accept {dict(spec.args)}: {exc}") from None
