"""The strategy interface, client sampling, argument checking and the two plain-mean rules (FedAvg, FedProx)."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from plexus.config import PLAIN_EXP_FLOAT, SITE_NAME, SITE_NAME_RULE, RoundConfig
from plexus.errors import ConfigError
from plexus.wire import Layout

State = dict[str, np.ndarray]



@dataclass(frozen=True)
class Update:
    """One site's result, for rules that need every update at once (robust rules, ensembling)."""

    site: str
    num_samples: int
    state: Mapping[str, np.ndarray]   # read-only, possibly np.memmap; model tensors (+ extras)


@dataclass(frozen=True)
class Sampling:
    """Client sampling settings (sites.fraction/count/min) and the job seed that draws them."""

    fraction: float | None = None
    count: int | None = None
    minimum: int = 1
    seed: int = 0


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


def refuse_sampling(cfg, name: str, chooses: str) -> None:
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


# Strategy arguments -----------------------------------------------------------------------

REQUIRED = object()
_KINDS = {"number": "write a number, e.g. 0.5", "integer": "write a whole number, e.g. 1",
          "boolean": "write true or false", "sites": "write a list of site names, e.g. [site-a, site-b]"}
_SITE_NAME = re.compile(SITE_NAME)


@dataclass(frozen=True)
class Param:
    """One accepted key of strategy.args: its kind, default and range check (value -> problem or None)."""

    kind: str
    default: Any = REQUIRED
    check: Callable[[Any], str | None] | None = None
    nullable: bool = False


def in_range(lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """A range check for Param.check."""
    wanted = (f"> {lo}" if lo_open else f">= {lo}") if hi is None else \
        f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(value: float) -> str | None:
        low = value <= lo if lo_open else value < lo
        high = hi is not None and (value >= hi if hi_open else value > hi)
        return f"{value!r} is out of range; use a value {wanted}" if low or high else None

    return check


def _typed(kind: str, value: Any) -> tuple[Any, str | None]:
    """(converted value, problem) for one argument value of the given kind."""
    if kind == "boolean":
        return value, None if isinstance(value, bool) else "expected true or false"
    if kind == "integer":
        return value, None if isinstance(value, int) and not isinstance(value, bool) else "expected a whole number"
    if kind == "number":
        if isinstance(value, str) and PLAIN_EXP_FLOAT.fullmatch(value):   # YAML 1.1 reads plain 1e-3 as a string
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, "expected a number"
        if not math.isfinite(value):
            return value, "expected a finite number"
        return float(value), None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        return value, "expected a list of site names"
    bad = next((s for s in value if not _SITE_NAME.fullmatch(s)), None)
    if bad is not None:
        return value, f"{bad!r} is not a site name ({SITE_NAME_RULE})"
    return value, None


def read_args(strategy: str, params: Mapping[str, Param], args: Mapping[str, Any]) -> dict[str, Any]:
    """strategy.args checked against `params`, defaults filled in; ConfigError naming the key otherwise."""
    accepted = ", ".join(sorted(params)) or "none"
    for key in args:
        if key not in params:
            fix = "remove it" if not params else f"accepted arguments: {accepted}"
            raise ConfigError(f"strategy.args.{key}: unknown argument for strategy {strategy!r}; {fix}")
    out = {}
    for key, param in params.items():
        if key not in args:
            if param.default is REQUIRED:
                raise ConfigError(f"strategy.args.{key}: required by strategy {strategy!r} but not set; "
                                  f"add it ({_KINDS[param.kind]})")
            out[key] = param.default
            continue
        value = args[key]
        if value is None and param.nullable:
            out[key] = None
            continue
        value, problem = _typed(param.kind, value)
        if problem is None and param.check is not None:
            problem = param.check(value)
        elif problem is not None:
            problem = f"{problem}, got {value!r}; {_KINDS[param.kind]}"
        if problem:
            raise ConfigError(f"strategy.args.{key}: {problem}")
        out[key] = value
    return out


# The interface ----------------------------------------------------------------------------

class Strategy:
    """Picks each round's sites and folds their results into the next global model; no I/O."""

    name: ClassVar[str] = ""
    params: ClassVar[dict[str, Param]] = {}
    secure_aggregation: ClassVar[bool] = True   # the rule needs only Σ w_k x_k (secure aggregation can compute it)
    dp_compatible: ClassVar[bool] = True        # DP-FedAvg (clip + noise on the mean) keeps its meaning
    uses_current: ClassVar[bool] = False        # aggregate reads the current global model
    holds_updates: ClassVar[bool] = False       # needs every update at once: engine calls aggregate_updates
    uniform_weights: ClassVar[bool] = False     # fold every update with weight 1 instead of num_samples
    mean_is_model: ClassVar[bool] = False       # aggregate returns the mean itself (the engine may skip the call)
    min_contributors: int = 1                   # the rule is undefined below this many updates in a round
    # Why the rule needs updates in the clear / why DP-FedAvg would lose its meaning (for config errors).
    clear_reason: ClassVar[str] = ""
    dp_reason: ClassVar[str] = ""
    # How the site's training differs from plain minibatch training, if it does (Opacus DP-SGD runs
    # plain training only, so such strategies refuse privacy.dp_sgd).
    local_training: ClassVar[str] = ""

    sampling: Sampling = Sampling()   # make_strategy sets the job's

    @classmethod
    def from_config(cls, args: dict[str, Any], cfg: RoundConfig) -> Strategy:
        """Build from checked args; override to cross-check the rest of the round config."""
        return cls(**args)

    def configure(self, round_: int, available: list[str], known: list[str]) -> list[str]:
        """The sites that train this round (pure: the engine may call it repeatedly)."""
        s = self.sampling
        return sample_sites(available, fraction=s.fraction, count=s.count, minimum=s.minimum, seed=s.seed,
                            round_=round_)

    def opened(self, round_: int, participants: list[str], known: list[str]) -> list[str]:
        """The round opened with these trainers: commit schedule state; return notes for the event log."""
        return []

    def done(self, rounds_closed: int) -> bool:
        """Whether the schedule finished before cfg.rounds."""
        return False

    def local_steps(self, site: str, sizes: Mapping[str, int]) -> int:
        """Minibatch steps `site` takes this round; 0 means train.steps/epochs."""
        return 0

    def served(self, current: State) -> State:
        """Extra tensors served with the model."""
        return {}

    def update_extras(self, model: Layout) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, wire dtype, shape) of the extra tensors every update carries."""
        return []

    def aggregate(self, round_: int, current: State, mean: State, contributors: list[str]) -> State:
        """The next global model from the weighted mean of the round's updates."""
        raise NotImplementedError(f"strategy {self.name!r} holds updates; the engine calls aggregate_updates")

    def aggregate_updates(self, round_: int, current: State, updates: list[Update]) -> State:
        """The next global model from every update of the round (holds_updates rules)."""
        raise NotImplementedError(f"strategy {self.name!r} folds a weighted mean; the engine calls aggregate")

    def state_arrays(self) -> State:
        """Optimizer / control-variate arrays to checkpoint with the model."""
        return {}

    def state_meta(self) -> dict:
        """JSON-able schedule state to checkpoint with the model."""
        return {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        """Restore what state_arrays/state_meta saved (crash-resume)."""


class FedAvg(Strategy):
    """McMahan et al. 2017: the next model is Σ n_k x_k / Σ n_k over the round's sites."""

    name = "fedavg"
    secure_aggregation = True  # a weighted sum: secure aggregation can compute it without seeing any update
    uses_current = False       # the next model is the mean alone: the engine may free the old one first
    mean_is_model = True

    def aggregate(self, round_: int, current: State, mean: State, contributors: list[str]) -> State:
        return mean


class FedProx(FedAvg):
    """Li et al. 2020: FedAvg at the server; each site adds (mu/2)‖w − x‖² to its loss."""

    name = "fedprox"
    params = {"mu": Param("number", 0.01, in_range(0, lo_open=True))}
    local_training = "adds a proximal term to each site's loss"

    def __init__(self, *, mu: float = 0.01) -> None:
        self.mu = mu
