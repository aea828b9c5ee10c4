"""The strategy interface: a rule (MeanRule or UpdatesRule) plus a schedule; client sampling; FedAvg, FedProx."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from plexus.config import RoundConfig
from plexus.errors import ConfigError
from plexus.wire import Layout

State = dict[str, np.ndarray]


@dataclass(frozen=True)
class Update:
    """One site's result, for rules that need every update at once (robust rules, ensembling)."""

    site: str
    num_samples: int
    state: Mapping[str, np.ndarray]   # read-only, possibly np.memmap; model tensors (+ extras)


def seeded_rng(purpose: str, *values: int) -> np.random.Generator:
    """A generator seeded from SHA-256 of a purpose label and integers: reproducible, independent per purpose."""
    digest = hashlib.sha256("/".join(["plexus/v1", purpose, *map(str, values)]).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest, "big"))


def sample_sites(available: list[str], *, fraction: float | None, count: int | None, minimum: int,
                 seed: int, round_: int) -> list[str]:
    """The sites that train this round: a seeded draw without replacement from `available`, sorted."""
    pool = sorted(set(available))
    k = len(pool)
    if fraction is not None:
        # round() first: 0.3 × 10 is 3.0000000000000004 in floating point and must not become 4.
        k = math.ceil(round(fraction * len(pool), 9))
    if count is not None:
        k = min(k, count)
    k = min(max(k, minimum), len(pool))
    if k == len(pool):
        return pool
    picked = seeded_rng("site-sampling", seed, round_).choice(len(pool), size=k, replace=False)
    return sorted(pool[i] for i in picked)


def refuse_sampling(cfg: RoundConfig, name: str, chooses: str) -> None:
    """ConfigError for sites.fraction / sites.count with a strategy that picks its own trainers."""
    for key in ("fraction", "count"):
        if getattr(cfg.sites, key) is not None:
            raise ConfigError(f"sites.{key}: {name} trains {chooses} and does not sample sites; "
                              f"remove sites.{key}")


def is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "f"


def cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A copy of `values` in `dtype`; float values bound for an integer tensor are rounded, not truncated."""
    values = np.asarray(values)
    if np.dtype(dtype).kind in "iu" and values.dtype.kind == "f":
        values = np.rint(values)
    return values.astype(dtype)


# Rules ------------------------------------------------------------------------------------

class Rule:
    """How a round's results become the next global model; no I/O. Subclass MeanRule or UpdatesRule."""

    name: ClassVar[str] = ""          # the strategy.name it answers to
    # Why secure aggregation (which shows the coordinator only Σ w_k x_k) cannot compute the rule, and why
    # DP-FedAvg (clip + noise on the weighted mean) would lose its meaning; empty: it can, it would not.
    clear_reason: ClassVar[str] = ""
    dp_reason: ClassVar[str] = ""
    # How the site's training differs from plain minibatch training, if it does (Opacus DP-SGD runs
    # plain training only, so such strategies refuse privacy.dp_sgd); the site half is site_agent.local.
    local_training: ClassVar[str] = ""
    # The rule applies differential privacy to what it reads itself (lbfgs: noise on row-clipped gradient sums),
    # so the driver's DP-FedAvg (update clip check, central noise) stays off; `dp_releases`: noisy values it
    # releases once, besides its rounds, each of which the accountant counts as one more round at q = 1.
    own_dp: ClassVar[bool] = False
    dp_releases: ClassVar[int] = 0

    @classmethod
    def from_config(cls, args: Any, cfg: RoundConfig) -> tuple[Rule, Schedule]:
        """The rule and its schedule from the checked args (plexus.config.STRATEGY_ARGS) and the whole config."""
        return cls(**_fields(args)), Sampling.of(cfg)

    def initial_model(self, state: State) -> State:
        """The job's round-0 model from the one built at submit (exact strategies start from zeros)."""
        return state

    def state_arrays(self) -> State:
        """Optimizer / control-variate arrays to checkpoint with the model."""
        return {}

    def state_meta(self) -> dict:
        """JSON-able rule state to checkpoint with the model."""
        return {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        """Restore what state_arrays/state_meta saved (crash-resume)."""


class MeanRule(Rule):
    """The next global model from the round's weighted mean of updates (a sum: secure aggregation can make it).

    This base class keeps the mean itself (FedAvg): the engine may then write the mean straight
    into the checkpoint without calling `step`.
    """

    weighting: ClassVar[str] = "samples"   # "samples": weigh each update by num_samples; "uniform": by 1
    reads_current: ClassVar[bool] = False  # step reads the current model (else the engine frees it first)

    def served(self, current: State) -> State:
        """Extra tensors served with the model (SCAFFOLD's c)."""
        return {}

    def update_extras(self, model: Layout) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, wire dtype, shape) of the extra tensors every update carries (SCAFFOLD's Δc)."""
        return []

    def step(self, round_: int, current: State | None, mean: State, contributors: list[str], *,
             population: int) -> State:
        """The next global model from the mean; `population`: the sites the round's trainers were drawn from."""
        return mean


class UpdatesRule(Rule):
    """The next global model from every update at once (robust rules, ensembling): updates in the clear.

    Never under secure aggregation or DP-FedAvg: the rule takes no sum or no mean. Subclasses
    say why in clear_reason and dp_reason.
    """

    min_contributors: int = 1   # the rule is undefined below this many updates in a round

    def combine(self, round_: int, current: State, updates: list[Update]) -> State:
        """The next global model from every update of the round."""
        raise NotImplementedError


def keeps_mean(rule: Rule) -> bool:
    """Whether the rule's next model is the round's mean itself (it does not override MeanRule.step)."""
    return isinstance(rule, MeanRule) and type(rule).step is MeanRule.step


def _fields(args: Any) -> dict[str, Any]:
    return {name: getattr(args, name) for name in args.__dataclass_fields__}


# Schedules --------------------------------------------------------------------------------

class Schedule:
    """Who trains each round, and how long; its state is checkpointed with the model."""

    def configure(self, round_: int, available: list[str], known: list[str]) -> list[str]:
        """The sites that train this round (pure: the engine may call it repeatedly)."""
        raise NotImplementedError

    def opened(self, round_: int, participants: list[str], known: list[str]) -> list[str]:
        """The round opened with these trainers: commit schedule state; return notes for the event log."""
        return []

    def done(self, rounds_closed: int) -> bool:
        """Whether the schedule finished before cfg.rounds."""
        return False

    def local_steps(self, site: str, sizes: Mapping[str, int]) -> int:
        """Minibatch steps `site` takes this round; 0 means train.steps/epochs."""
        return 0

    def state_meta(self) -> dict:
        """JSON-able schedule state to checkpoint with the model."""
        return {}

    def load_state(self, meta: Mapping) -> None:
        """Restore what state_meta saved (crash-resume)."""


@dataclass(frozen=True)
class Sampling(Schedule):
    """Client sampling (sites.fraction/count/min) seeded by the job seed: every online site when neither is set."""

    fraction: float | None = None
    count: int | None = None
    minimum: int = 1
    seed: int = 0

    @classmethod
    def of(cls, cfg: RoundConfig) -> Sampling:
        return cls(cfg.sites.fraction, cfg.sites.count, cfg.sites.min, cfg.seed)

    def configure(self, round_: int, available: list[str], known: list[str]) -> list[str]:
        return sample_sites(available, fraction=self.fraction, count=self.count, minimum=self.minimum,
                            seed=self.seed, round_=round_)


# The strategy -----------------------------------------------------------------------------

class Strategy:
    """A rule and a schedule, built by make_strategy; no I/O. The engine dispatches on the rule's type."""

    def __init__(self, name: str, rule: MeanRule | UpdatesRule, schedule: Schedule) -> None:
        self.name, self.rule, self.schedule = name, rule, schedule
        self.population = 0   # known sites ∪ trainers when the latest round opened (MeanRule.step's population)

    @property
    def min_contributors(self) -> int:
        """The fewest updates the rule is defined for."""
        return self.rule.min_contributors if isinstance(self.rule, UpdatesRule) else 1

    def opened(self, round_: int, participants: list[str], known: list[str]) -> list[str]:
        """The round opened: the schedule commits its state; notes for the event log."""
        self.population = len(set(known) | set(participants))
        return self.schedule.opened(round_, participants, known)

    def state_arrays(self) -> State:
        """The rule's arrays to checkpoint (schedules keep JSON only)."""
        return self.rule.state_arrays()

    def state_meta(self) -> dict:
        """Rule and schedule state together (their keys never overlap), as one JSON object."""
        return {**self.rule.state_meta(), **self.schedule.state_meta()}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        """Restore rule and schedule from a checkpoint (crash-resume)."""
        self.rule.load_state(arrays, meta)
        self.schedule.load_state(meta)


class FedAvg(MeanRule):
    """McMahan et al. 2017: the next model is Σ n_k x_k / Σ n_k over the round's sites."""

    name = "fedavg"

    def __init__(self) -> None:
        pass


class FedProx(FedAvg):
    """Li et al. 2020: FedAvg at the server; each site adds (mu/2)‖w − x‖² to its loss (site_agent.local)."""

    name = "fedprox"
    local_training = "adds a proximal term to each site's loss"

    def __init__(self, *, mu: float = 0.01) -> None:
        self.mu = mu
