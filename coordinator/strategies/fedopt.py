"""Server optimizers over the pseudo-gradient Δ = mean − x: FedAvgM and FedOpt (Reddi et al. 2021)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from coordinator.strategies.base import MeanRule, State, cast, is_float


class ServerOptimizer(MeanRule):
    """x ← step(x, Δ) per float tensor (float64 math, state kept as float32); integer tensors take the mean."""

    reads_current = True
    slots: tuple[str, ...] = ()   # optimizer state per tensor, saved as "<slot>/<tensor>"

    def __init__(self) -> None:
        self._state: dict[str, dict[str, np.ndarray]] = {slot: {} for slot in self.slots}

    def step(self, round_: int, current: State, mean: State, contributors: list[str], *,
             population: int) -> State:
        out = {}
        for name, x in current.items():
            if not is_float(x.dtype):
                out[name] = cast(mean[name], x.dtype)
                continue
            x64 = x.astype(np.float64)
            slots = {slot: self._state[slot].get(name, np.zeros(x.shape, np.float32)).astype(np.float64)
                     for slot in self.slots}
            change = self.change(np.asarray(mean[name], np.float64) - x64, slots)
            for slot in self.slots:
                self._state[slot][name] = slots[slot].astype(np.float32)
            out[name] = (x64 + change).astype(x.dtype)
        return out

    def change(self, delta: np.ndarray, slots: dict[str, np.ndarray]) -> np.ndarray:
        """The change to x; updates `slots` (float64) in place or by reassignment."""
        raise NotImplementedError

    def state_arrays(self) -> State:
        return {f"{slot}/{name}": a for slot, arrays in self._state.items() for name, a in arrays.items()}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        self._state = {slot: {} for slot in self.slots}
        for key, a in arrays.items():
            slot, _, name = key.partition("/")
            if slot in self._state:
                self._state[slot][name] = np.array(a, np.float32)


class FedAvgM(ServerOptimizer):
    """Server momentum (Hsu et al. 2019): v ← momentum·v + Δ; x ← x + eta·v."""

    name = "fedavgm"
    slots = ("v",)

    def __init__(self, *, eta: float = 1.0, momentum: float = 0.9) -> None:
        super().__init__()
        self.eta, self.momentum = eta, momentum

    def change(self, delta, slots):
        slots["v"] = self.momentum * slots["v"] + delta
        return self.eta * slots["v"]


class FedAdam(ServerOptimizer):
    """m ← β1 m + (1−β1)Δ; v ← β2 v + (1−β2)Δ²; x ← x + η m/(√v + τ); no bias correction."""

    name = "fedadam"
    slots = ("m", "v")

    def __init__(self, *, eta: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__()
        self.eta, self.beta1, self.beta2, self.tau = eta, beta1, beta2, tau

    def change(self, delta, slots):
        slots["m"] = self.beta1 * slots["m"] + (1 - self.beta1) * delta
        slots["v"] = self.second_moment(slots["v"], delta * delta)
        return self.eta * slots["m"] / (np.sqrt(slots["v"]) + self.tau)

    def second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1 - self.beta2) * sq


class FedYogi(FedAdam):
    """As FedAdam with v ← v − (1−β2)Δ² sign(v − Δ²): v grows no faster than additively."""

    name = "fedyogi"

    def second_moment(self, v, sq):
        return v - (1 - self.beta2) * sq * np.sign(v - sq)


class FedAdagrad(FedAdam):
    """As FedAdam with v ← v + Δ²."""

    name = "fedadagrad"

    def __init__(self, *, eta: float = 0.01, beta1: float = 0.9, tau: float = 1e-3) -> None:
        super().__init__(eta=eta, beta1=beta1, tau=tau)

    def second_moment(self, v, sq):
        return v + sq
