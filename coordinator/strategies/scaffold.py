"""SCAFFOLD (Karimireddy et al. 2020): server control variate c corrects each site's client drift."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from coordinator.strategies.base import MeanRule, Sampling, Schedule, State, cast, is_float
from plexus.config import RoundConfig
from plexus.errors import ConfigError, IntegrityError
from plexus.wire import FLOAT_DTYPES, SCAFFOLD_C as C, SCAFFOLD_DC as DC, Layout


class Scaffold(MeanRule):
    """x ← x + eta_g (mean y − x); c ← c + (|S|/N) mean Δc; sites get c with the model and return Δc."""

    name = "scaffold"
    local_training = "corrects every gradient step with the control variates"
    reads_current = True
    weighting = "uniform"   # the paper's mean(Δy) and mean(Δc) are unweighted
    # Both means are sums divided by |S|, but the secure-aggregation protocol carries the model update
    # only, not the Δc that every SCAFFOLD update adds.
    clear_reason = ("every update also carries the control-variate change Δc, which the secure-aggregation "
                    "protocol does not carry")
    dp_reason = ("DP-FedAvg clips and noises the model update only, while every update also carries Δc, which "
                 "would reach the coordinator unclipped and un-noised")

    def __init__(self, *, eta_g: float = 1.0) -> None:
        self.eta_g = eta_g
        self._c: dict[str, np.ndarray] = {}
        self._known = 0   # N of the latest round (checkpointed; step is given it afresh every round)

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[Scaffold, Schedule]:
        opt = cfg.train.optimizer
        if opt.name != "sgd" or opt.momentum != 0:
            raise ConfigError(f"train.optimizer: scaffold needs plain SGD (name: sgd, momentum: 0), got name: "
                              f"{opt.name}, momentum: {opt.momentum}, because each site's control-variate update "
                              "(x − y)/(K·lr) assumes the plain SGD step size; set train.optimizer.name: sgd and "
                              "momentum: 0")
        return cls(eta_g=args.eta_g), Sampling.of(cfg)

    def _control(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._c:
            self._c[name] = np.zeros(shape, np.float32)
        return self._c[name]

    def served(self, current: State) -> State:
        return {C + name: self._control(name, x.shape) for name, x in current.items() if is_float(x.dtype)}

    def update_extras(self, model: Layout) -> list[tuple[str, str, tuple[int, ...]]]:
        # float32 whatever the tensor's float dtype, as c is (and as site_agent.local sends Δc)
        return [(DC + t.name, "F32", t.shape) for t in model.tensors if t.dtype in FLOAT_DTYPES]

    def step(self, round_: int, current: State, mean: State, contributors: list[str], *,
             population: int) -> State:
        self._known = population
        share = len(contributors) / max(self._known, len(contributors))   # |S| / N
        out = {}
        for name, x in current.items():
            if not is_float(x.dtype):
                out[name] = cast(mean[name], x.dtype)
                continue
            if DC + name not in mean:
                raise IntegrityError(f"the round's mean lacks {DC + name!r}; every scaffold update must carry "
                                     "Δc for each float tensor")
            x64 = x.astype(np.float64)
            out[name] = (x64 + self.eta_g * (np.asarray(mean[name], np.float64) - x64)).astype(x.dtype)
            c = self._control(name, x.shape).astype(np.float64)
            self._c[name] = (c + share * np.asarray(mean[DC + name], np.float64)).astype(np.float32)
        return out

    def state_arrays(self) -> State:
        return {f"c/{name}": c for name, c in self._c.items()}

    def state_meta(self) -> dict:
        return {"known": self._known}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        self._c = {key[2:]: np.array(a, np.float32) for key, a in arrays.items() if key.startswith("c/")}
        self._known = int(meta.get("known", 0))
