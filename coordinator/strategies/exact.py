"""Exact federated optimisation: lbfgs and newton minimise the pooled objective itself, not a mean of local fits.

Each round the sites return sums over all their rows at the served point (loss, gradient and, for newton,
Hessian: update extras `exact/*`), so the coordinator sees F(w) = C·Σℓ_i(w) + ½‖w_pen‖² (scikit-learn's
objective; w_pen: every weight but biases) and its derivatives exactly as one machine holding every row would.
Each evaluation costs a round, so the optimisers are state machines told one evaluation at a time: pure math
first (two-loop recursion, a strong-Wolfe line search that can stop and resume between any two rounds, the
Newton step), then the rules that feed them. No I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import numpy as np

from coordinator.strategies.base import MeanRule, Sampling, Schedule, State, cast
from plexus.config import DPSpec, ModelSpec, RoundConfig
from plexus.dp import add_noise, noise_key
from plexus.errors import ConfigError, IntegrityError
from plexus.secagg import frac_bits
from plexus.wire import EXACT_GRAD as GRAD, EXACT_HESSIAN as HESSIAN, EXACT_LOSS as LOSS, EXACT_ROWS as ROWS, Layout

log = logging.getLogger("plexus.coordinator")


# The L-BFGS direction ---------------------------------------------------------------------

def two_loop(g: np.ndarray, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """−H·g for the L-BFGS inverse-Hessian estimate H of the (s, y) pairs, oldest first (Nocedal & Wright
    Algorithm 7.4), its initial matrix scaled by sᵀy/yᵀy of the newest pair."""
    q = np.array(g, np.float64)
    taken = []
    for s, y in reversed(pairs):
        rho = 1.0 / float(y @ s)
        a = rho * float(s @ q)
        q -= a * y
        taken.append((rho, a))
    if pairs:
        s, y = pairs[-1]
        q *= float(s @ y) / float(y @ y)
    for (s, y), (rho, a) in zip(pairs, reversed(taken)):
        q += (a - rho * float(y @ q)) * s
    return -q


# The strong-Wolfe line search ---------------------------------------------------------------

ACCEPT, TRY, FAIL = "accept", "try", "fail"
MAX_TRIALS = 20          # evaluations (rounds) one line search may take, as scipy's maxls
# Trials one line search along a quasi-Newton direction may take on a secure round's sums before the memory is
# dropped and the search starts again along −∇F: curvature pairs from sums rounded to its coarse fixed-point grid
# can turn the direction almost orthogonal to the gradient, and a search along it then zooms on rounding.
RESTART_TRIALS = 4
# The least cos∠(−∇F, d) a quasi-Newton direction may have (else −∇F): the "angle condition" of the convergence
# proofs (Nocedal & Wright §3.2), which rounded curvature pairs can break.
MIN_COSINE = 1e-4
_EXTRAPOLATE = (1.1, 4.0)   # a longer trial lies 1.1..4 times the last step beyond the last trial (MINPACK)
_SAFEGUARD = 0.1         # a zoom trial keeps this share of the bracket from either end, else bisection


# Hager & Zhang's ε (CG_DESCENT's approximate Wolfe conditions): how far above F(x) a trial may land, relative to
# it, and still pass where its slope proves the decrease.
ROUNDING = 1e-6


def sufficient_decrease(f0: float, slope0: float, alpha: float, f: float, slope: float, c1: float) -> bool:
    """Armijo's φ(α) <= φ(0) + c1·α·φ'(0); or, within F's rounding of φ(0), the same read off the slopes:
    φ'(α) <= (2c1 − 1)·φ'(0), which on a quadratic is Armijo's condition exactly (Hager & Zhang 2005).

    The loss sums reach the coordinator on a fixed-point grid (coordinator.aggregate: 2⁻³²; under secure
    aggregation clip/L), so near the optimum F's decrease drowns in it while the gradient's does not.
    """
    if f <= f0 + c1 * alpha * slope0:   # false for NaN as well
        return True
    return f <= f0 + ROUNDING * abs(f0) and slope <= (2.0 * c1 - 1.0) * slope0


@dataclass(frozen=True)
class Verdict:
    """What the line search makes of an evaluation: ACCEPT `alpha`, TRY `alpha` next, or FAIL (`why`)."""

    action: str
    alpha: float
    why: str = ""


@dataclass
class WolfeSearch:
    """A strong-Wolfe line search on φ(α) = F(x + α·d) (Nocedal & Wright Algorithms 3.5 and 3.6) that is told one
    evaluation at a time: `alpha` is the trial to evaluate; `tell(φ(alpha), φ'(alpha))` accepts it or names the
    next. Its fields are its whole state, JSON-able (`meta`/`of`), so a restarted coordinator resumes mid-search.

    Points are [α, φ, φ'] lists. Bracketing (`zooming` false) extrapolates from `prev`; zooming keeps `lo` (the
    best point with sufficient decrease) and `hi` and tries the safeguarded cubic minimiser between them.
    """

    f0: float
    slope0: float            # φ'(0) < 0: d is a descent direction
    alpha: float             # the trial being evaluated
    c1: float = 1e-4
    c2: float = 0.9
    trials: int = 0
    zooming: bool = False
    prev: list | None = None
    lo: list | None = None
    hi: list | None = None

    def tell(self, f: float, slope: float) -> Verdict:
        """φ and φ' at `alpha`: ACCEPT it if it satisfies the strong Wolfe conditions, else the next trial."""
        self.trials += 1
        a = self.alpha
        point = [a, f, slope]
        prev = self.prev or [0.0, self.f0, self.slope0]
        decreases = sufficient_decrease(self.f0, self.slope0, a, f, slope, self.c1)
        flat = abs(slope) <= -self.c2 * self.slope0
        if not self.zooming:
            if not decreases or (self.trials > 1 and f >= prev[1]):
                self.zooming, self.lo, self.hi = True, prev, point
            elif flat:
                return Verdict(ACCEPT, a)
            elif slope >= 0:
                self.zooming, self.lo, self.hi = True, point, prev
            else:
                self.prev = point
                return self._next(_extrapolated(prev, point), "no step")
        elif not decreases or f >= self.lo[1]:
            self.hi = point
        elif flat:
            return Verdict(ACCEPT, a)
        else:
            if slope * (self.hi[0] - self.lo[0]) >= 0:
                self.hi = self.lo
            self.lo = point
        return self._next(_zoomed(self.lo, self.hi), "the bracket shrank to nothing")

    def _next(self, alpha: float, stuck: str) -> Verdict:
        if self.trials >= MAX_TRIALS:
            return Verdict(FAIL, self.alpha, f"no strong-Wolfe step in {MAX_TRIALS} trials")
        if not math.isfinite(alpha) or alpha <= 0 or alpha == self.alpha:
            return Verdict(FAIL, self.alpha, f"the line search is stuck ({stuck}), at the limit of float64")
        self.alpha = alpha
        return Verdict(TRY, alpha)

    def meta(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, meta: Mapping) -> WolfeSearch:
        return cls(**meta)


def cubic_minimiser(p: Sequence[float], q: Sequence[float]) -> float:
    """The minimiser of the cubic through points p and q ([α, φ, φ'] each; Nocedal & Wright 3.59); NaN if none."""
    (a0, f0, d0), (a1, f1, d1) = p, q
    with np.errstate(all="ignore"):
        e = d0 + d1 - 3.0 * (f0 - f1) / (a0 - a1)
        root = e * e - d0 * d1
        if not root >= 0:
            return math.nan
        r = math.copysign(math.sqrt(root), a1 - a0)
        denominator = d1 - d0 + 2.0 * r
        return a1 - (a1 - a0) * (d1 + r - e) / denominator if denominator else math.nan


def _zoomed(lo: Sequence[float], hi: Sequence[float]) -> float:
    """The cubic's minimiser inside [lo, hi] away from both ends, else the midpoint (bisection)."""
    left, right = sorted((lo[0], hi[0]))
    margin = _SAFEGUARD * (right - left)
    alpha = cubic_minimiser(lo, hi)
    return alpha if left + margin <= alpha <= right - margin else 0.5 * (left + right)


def _extrapolated(prev: Sequence[float], point: Sequence[float]) -> float:
    """A longer trial: the cubic's minimiser past `point`, kept 1.1..4 times the last step beyond it."""
    step = point[0] - prev[0]
    low, high = (point[0] + k * step for k in _EXTRAPOLATE)
    alpha = cubic_minimiser(prev, point)
    return alpha if low <= alpha <= high else high


# The optimisers, over a float64 vector of free coordinates ---------------------------------

@dataclass(frozen=True)
class Stopping:
    """When an optimiser stops: ‖∇F‖∞ <= gtol, relative decrease of F <= ftol, or max_iterations accepted steps.

    `floor`: the gradient's own rounding (a secure round's fixed point, ExactRule.step sets it): a gradient within
    it of zero is as converged as the sums can tell, so gtol below it counts as it."""

    gtol: float
    ftol: float
    max_iterations: int
    floor: float = 0.0

    def why(self, iterations: int, g: np.ndarray, f: float, decrease: float | None) -> str:
        """Why the optimiser stops at this accepted iterate (F(x) = f, `decrease` from the last); empty if it goes
        on."""
        norm = float(np.max(np.abs(g), initial=0.0))
        if norm <= self.gtol:
            return f"converged: ‖∇F‖∞ = {norm:.3g} <= gtol {self.gtol:g}"
        if norm <= self.floor:
            return (f"converged: ‖∇F‖∞ = {norm:.3g}, within twice the secure sum's rounding ({self.floor / 2:.3g} per "
                    "coordinate)")
        if decrease is not None and decrease <= self.ftol * max(abs(f), 1.0):
            return f"converged: F decreased by {decrease:.3g}, relative to it at most ftol {self.ftol:g}"
        if iterations >= self.max_iterations:
            return f"stopped after max_iterations = {self.max_iterations} iterations"
        return ""


class Optimizer:
    """A minimiser told one evaluation at a time; `evaluated` returns the next point. x/f/g: the last accepted
    iterate (the best point so far: every accepted step decreases F). `stop`: why it stopped, or empty."""

    arrays: ClassVar[tuple[str, ...]] = ("x", "g", "d")

    def __init__(self, stopping: Stopping) -> None:
        self.stopping = stopping
        self.x: np.ndarray | None = None
        self.f = 0.0
        self.g: np.ndarray | None = None
        self.d: np.ndarray | None = None   # the search direction from x
        self.iterations = 0
        self.stop = ""

    def _accepted(self, x: np.ndarray, f: float, g: np.ndarray) -> bool:
        """Take x as the next iterate; whether to go on."""
        decrease = None
        if self.x is not None:
            # F's own change, or if larger the one its slopes give (exact on a quadratic, and free of the loss
            # sums' rounding, which alone must not pass for convergence): ftol needs both to be small.
            decrease = max(self.f - f, -0.5 * float((x - self.x) @ (self.g + g)))
            self.iterations += 1
        self.x, self.f, self.g = x, f, g
        self.stop = self.stopping.why(self.iterations, g, f, decrease)
        return not self.stop

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.arrays if getattr(self, name) is not None}

    def state_meta(self) -> dict:
        return {"f": self.f, "iterations": self.iterations, "stop": self.stop}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        for name in self.arrays:
            setattr(self, name, np.array(arrays[name], np.float64) if name in arrays else None)
        self.f, self.iterations, self.stop = float(meta["f"]), int(meta["iterations"]), str(meta["stop"])


class LBFGSOptimizer(Optimizer):
    """L-BFGS with a strong-Wolfe line search, each trial one evaluation; the first step has length 1, as scipy's."""

    def __init__(self, stopping: Stopping, *, memory: int = 30, c1: float = 1e-4, c2: float = 0.9) -> None:
        super().__init__(stopping)
        self.memory, self.c1, self.c2 = memory, c1, c2
        self.pairs: list[tuple[np.ndarray, np.ndarray]] = []
        self.search: WolfeSearch | None = None

    def evaluated(self, x: np.ndarray, f: float, g: np.ndarray) -> np.ndarray:
        """F and ∇F at x (the point this optimiser asked for last); the point to evaluate next (x_k once stopped)."""
        if self.x is None:
            return self._direction(x, f, g) if self._accepted(x, f, g) else self.x
        verdict = self.search.tell(f, float(g @ self.d))
        # On coarsely rounded sums (a secure round's: stopping.floor) a long search is a search on rounding.
        patience = RESTART_TRIALS if self.stopping.floor > 0 else MAX_TRIALS
        if self.pairs and verdict.action != ACCEPT and (verdict.action == FAIL or self.search.trials >= patience):
            # Search along −γ∇F from the best iterate instead, with a fresh memory (L-BFGS's usual restart); γ, the
            # newest pair's s·y/y·y, keeps the step at the scale of the curvature seen so far.
            (s_, y_), self.pairs = self.pairs[-1], []
            return self._direction(self.x, self.f, self.g, scale=float(s_ @ y_) / float(y_ @ y_))
        if verdict.action == TRY:
            return self.x + verdict.alpha * self.d
        if verdict.action == FAIL:
            self.stop = f"line search failed: {verdict.why}; the best iterate stands"
            return self.x
        s, y = x - self.x, g - self.g
        if float(s @ y) > np.finfo(np.float64).eps * float(y @ y):   # else H would not stay positive definite
            self.pairs = [*self.pairs, (s, y)][-self.memory:]
        return self._direction(x, f, g) if self._accepted(x, f, g) else self.x

    def _direction(self, x: np.ndarray, f: float, g: np.ndarray, scale: float | None = None) -> np.ndarray:
        """Start a line search from x along the two-loop direction (−scale·∇F after a restart); its first trial."""
        d = two_loop(g, self.pairs) if scale is None else -scale * g
        if not -float(g @ d) > MIN_COSINE * float(np.linalg.norm(g) * np.linalg.norm(d)):
            self.pairs, d, scale = [], -g, None   # (nearly) lost descent to rounding: start the memory afresh
        # No curvature known yet: a first step of length 1, as scipy's.
        alpha = 1.0 if self.pairs or scale is not None else 1.0 / float(np.linalg.norm(g))
        self.d = d
        self.search = WolfeSearch(f, float(g @ d), alpha, self.c1, self.c2)
        return x + alpha * d

    def state_arrays(self) -> dict[str, np.ndarray]:
        out = super().state_arrays()
        if self.pairs:
            out["s"] = np.stack([s for s, _ in self.pairs])
            out["y"] = np.stack([y for _, y in self.pairs])
        return out

    def state_meta(self) -> dict:
        return {**super().state_meta(), "search": self.search.meta() if self.search else None}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        super().load_state(arrays, meta)
        s, y = (np.array(arrays[k], np.float64) for k in ("s", "y")) if "s" in arrays else ((), ())
        self.pairs = list(zip(s, y))
        self.search = WolfeSearch.of(meta["search"]) if meta.get("search") else None


ARMIJO_C1 = 1e-4
MAX_BACKTRACKS = 30


def newton_direction(g: np.ndarray, h: np.ndarray) -> np.ndarray:
    """p with H·p = −g, least squares: a singular H (a multinomial model's intercept shift) gives the minimum-norm
    step, which does not move along the null direction; −g when that is no descent direction (non-convex F)."""
    p = np.linalg.lstsq(h, -g, rcond=None)[0]
    return p if float(g @ p) < 0 else -g


class NewtonOptimizer(Optimizer):
    """Damped Newton: step 1 along −H⁻¹∇F first, backtracking (Armijo, c1 1e-4) by safeguarded quadratic
    interpolation, each trial one evaluation."""

    def __init__(self, stopping: Stopping) -> None:
        super().__init__(stopping)
        self.alpha = 1.0
        self.backtracks = 0

    def evaluated(self, x: np.ndarray, f: float, g: np.ndarray, h: np.ndarray) -> np.ndarray:
        """F, ∇F and ∇²F at x (the point asked for last); the point to evaluate next (x_k once stopped)."""
        if self.x is None:
            return self._direction(x, f, g, h) if self._accepted(x, f, g) else self.x
        slope = float(self.g @ self.d)
        if sufficient_decrease(self.f, slope, self.alpha, f, float(g @ self.d), ARMIJO_C1):
            return self._direction(x, f, g, h) if self._accepted(x, f, g) else self.x
        self.backtracks += 1
        if self.backtracks > MAX_BACKTRACKS:
            self.stop = (f"line search failed: no sufficient decrease in {MAX_BACKTRACKS} trials; the best iterate "
                         "stands")
            return self.x
        # The minimiser of the quadratic through f_k, slope and f(α), kept in [0.1α, 0.5α].
        a = self.alpha
        with np.errstate(all="ignore"):
            quadratic = -slope * a * a / (2.0 * (f - self.f - slope * a))
        self.alpha = min(max(quadratic, 0.1 * a), 0.5 * a) if math.isfinite(quadratic) else 0.5 * a
        return self.x + self.alpha * self.d

    def _direction(self, x: np.ndarray, f: float, g: np.ndarray, h: np.ndarray) -> np.ndarray:
        self.d, self.alpha, self.backtracks = newton_direction(g, h), 1.0, 0
        # The decrease the quadratic model promises (half the squared Newton decrement): below ftol·|F| no
        # step can show in float64's F, and Armijo would reject it on rounding alone.
        promised = -0.5 * float(g @ self.d)
        if promised <= self.stopping.ftol * max(abs(f), 1.0):
            self.stop = (f"converged: the Newton step promises F a decrease of {promised:.3g}, relative to it at most "
                         f"ftol {self.stopping.ftol:g}")
            return self.x
        return x + self.d

    def state_meta(self) -> dict:
        return {**super().state_meta(), "alpha": self.alpha, "backtracks": self.backtracks}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        super().load_state(arrays, meta)
        self.alpha, self.backtracks = float(meta["alpha"]), int(meta["backtracks"])


# The model's parameters as one vector ------------------------------------------------------

def parameter_shapes(model: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter of an exact-strategy model, in torch's named_parameters order (weight before
    bias, layers in order), the order in which the sites concatenate exact/grad. Computed from the model's args, as
    the coordinator never imports torch; tests check it against the built models."""
    args = model.args

    def count(key: str, default: Any = None) -> int:
        value = args.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.args.{key}: must be a positive integer, got {value!r}; set it")
        return value

    if model.name in ("logistic", "linear"):
        outputs = count("num_classes", 2) if model.name == "logistic" else 1
        inputs = count("in_features")
        return [("linear.weight", (outputs, inputs)), ("linear.bias", (outputs,))]
    if model.name == "mlp":
        hidden = args.get("hidden", (32,))
        if isinstance(hidden, (str, bytes)) or not isinstance(hidden, Sequence):
            raise ConfigError(f"model.args.hidden: must be a list of layer widths, got {hidden!r}; set it")
        widths = [count("in_features"), *(_width(h) for h in hidden), count("num_classes", 2)]
        per_layer = 3 if args.get("dropout", 0.0) else 2   # Linear, ReLU(, Dropout): Sequential indices
        shapes = []
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            shapes += [(f"layers.{i * per_layer}.weight", (b, a)), (f"layers.{i * per_layer}.bias", (b,))]
        return shapes
    raise ConfigError(f"model: {model.name!r} is not a model the exact strategies know; use logistic, linear or mlp")


def _width(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model.args.hidden: {value!r} is not a layer width; use positive integers")
    return value


@dataclass(frozen=True)
class Objective:
    """F(w) = C·Σℓ_i(w) + ½‖w_pen‖² over the model's parameters as one float64 vector (named_parameters order).

    `free` marks the coordinates the optimiser moves: all, except for a two-class `logistic`, whose class-0 row
    (weight and bias) stays at zero so that the class-1 row is scikit-learn's binary coef_/intercept_.
    """

    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    free: np.ndarray        # bool [d]
    penalised: np.ndarray   # bool [d]: every weight but the biases
    C: float | None

    @classmethod
    def of(cls, model: ModelSpec, C: float | None) -> Objective:
        tensors = tuple(parameter_shapes(model))
        free = np.concatenate([np.ones(math.prod(shape), bool) for _, shape in tensors])
        penalised = np.concatenate([np.full(math.prod(shape), not name.endswith("bias"), bool)
                                    for name, shape in tensors])
        if model.name == "logistic" and tensors[1][1] == (2,):
            classes, inputs = tensors[0][1]
            free[:inputs] = False                                        # linear.weight[0, :]
            free[classes * inputs] = False                               # linear.bias[0]
        return cls(tensors, free, penalised, C)

    @property
    def size(self) -> int:
        """d: the parameters' element count, the length of exact/grad."""
        return len(self.free)

    def flatten(self, state: Mapping[str, np.ndarray]) -> np.ndarray:
        """The free coordinates of the model `state`, float64."""
        missing = [name for name, _ in self.tensors if name not in state]
        if missing or len(state) != len(self.tensors):
            raise IntegrityError(f"the model's tensors {sorted(state)} are not the parameters the exact strategy "
                                 f"expects ({[name for name, _ in self.tensors]}); the job's model changed")
        full = np.concatenate([np.asarray(state[name], np.float64).reshape(-1) for name, _ in self.tensors])
        return full[self.free]

    def model(self, x: np.ndarray, like: Mapping[str, np.ndarray]) -> State:
        """The model whose free coordinates are x (the rest zero), each tensor in the dtype of `like`'s."""
        full = np.zeros(self.size)
        full[self.free] = x
        out, at = {}, 0
        for name, shape in self.tensors:
            n = math.prod(shape)
            out[name] = cast(full[at:at + n].reshape(shape), np.asarray(like[name]).dtype)
            at += n
        return out

    def evaluate(self, x: np.ndarray, loss: float, grad: np.ndarray) -> tuple[float, np.ndarray]:
        """F and ∇F (free coordinates) at x from the pooled Σℓ_i and Σ∇ℓ_i (all d coordinates)."""
        c = 1.0 if self.C is None else self.C
        pen = self.penalised[self.free] if self.C is not None else np.zeros(len(x), bool)
        return c * loss + 0.5 * float(np.sum(x[pen] ** 2)), c * grad[self.free] + np.where(pen, x, 0.0)

    def hessian(self, h: np.ndarray) -> np.ndarray:
        """∇²F (free coordinates) from the pooled Σ∇²ℓ_i (d×d)."""
        c = 1.0 if self.C is None else self.C
        out = c * h[np.ix_(self.free, self.free)]
        if self.C is not None:
            out[np.diag_indices_from(out)] += self.penalised[self.free]
        return out


# The rules ------------------------------------------------------------------------------

NON_CONVEX = ("model {model!r} is not convex: strategy {name!r} finds a stationary point near its start (zeros), "
              "not the best model, and newton may fall back to gradient steps")


class ExactRule(MeanRule):
    """The round's sums (the uniform mean of every site's sums × the number of sites) evaluate F at the served
    point; the optimiser's next point is the next model served. Subclasses: LBFGS and Newton."""

    weighting = "uniform"   # the mean × K is the pooled sum, whatever each site's row count
    reads_current = True
    own_dp = True           # DP (lbfgs): the rule noises the gradient sum itself; no DP-FedAvg clip or noise
    dp_releases = 1         # ... and releases the noisy row count once, counted as one more round at q = 1
    local_training = "computes loss and gradient sums over all its rows at the served model instead of training"
    hessian: ClassVar[bool] = False

    def __init__(self, objective: Objective, optimizer: Optimizer, *, rounds: int) -> None:
        self.objective, self.optimizer, self.rounds = objective, optimizer, rounds
        self.sites: list[str] | None = None   # the first round's contributors: the objective's rows
        self.note = ""                         # for the next round's event log (Converging.opened)
        self.secure_clip: float | None = None  # privacy.secagg.clip when the sums arrive by secure aggregation

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[ExactRule, Schedule]:
        rule = cls.build(args, cfg)
        if cfg.privacy.secure_aggregation:
            rule.secure_clip = cfg.privacy.secagg.clip
        return rule, Converging(Sampling.of(cfg), rule, cfg)

    def rounding(self, sites: int) -> float:
        """How far a secure round's pooled gradient sum of F may be off per coordinate: K·K·2^-(f+1) on each sum
        (docs/privacy.md; K sites advertised and surviving), times C. 0 for the clear sum (2^-32, negligible)."""
        if self.secure_clip is None:
            return 0.0
        c = 1.0 if self.objective.C is None else self.objective.C
        return c * sites * sites * 2.0 ** -(frac_bits(self.secure_clip) + 1)

    @classmethod
    def build(cls, args, cfg: RoundConfig) -> ExactRule:
        raise NotImplementedError

    @property
    def stopped(self) -> str:
        return self.optimizer.stop

    def initial_model(self, state: State) -> State:
        """Zeros, as scikit-learn starts, whatever the model's random initialisation."""
        built, expected = {n: tuple(np.shape(v)) for n, v in state.items()}, dict(self.objective.tensors)
        if built != expected:
            raise ConfigError(f"model: the built model's tensors {built} are not the parameters {expected} strategy "
                              f"{self.name!r} sums gradients over; use a model the exact strategies know")
        return {name: np.zeros_like(value) for name, value in state.items()}

    def update_extras(self, model: Layout) -> list[tuple[str, str, tuple[int, ...]]]:
        d = self.objective.size
        return [(GRAD, "F64", (d,)), (LOSS, "F64", (1,)), (ROWS, "F64", (1,))] + \
            ([(HESSIAN, "F64", (d, d))] if self.hessian else [])

    def step(self, round_: int, current: State, mean: State, contributors: list[str], *,
             population: int) -> State:
        if self.sites is None:
            self.sites = sorted(contributors)
        if sorted(contributors) != self.sites:
            missing = sorted(set(self.sites) - set(contributors))
            self.note = (f"round {round_}: sums from {len(contributors)} site(s), not the job's {len(self.sites)}"
                         f"{' (missing: ' + ', '.join(missing) + ')' if missing else ''}, are another objective's; "
                         "the same point is evaluated again")
            log.warning("%s", self.note)
            return {name: np.array(value) for name, value in current.items()}
        x = self.objective.flatten(current)
        if self.optimizer.x is None and any(np.any(np.asarray(current[n]) != 0) for n, _ in self.objective.tensors):
            # A job whose round-0 model is not initial_model's (built elsewhere): start where scikit-learn does.
            self.note = f"round {round_}: the served model is not zeros, where {self.name} starts; zeros next"
            return self.objective.model(np.zeros(len(x)), current)
        if self.stopped:
            nxt = self.optimizer.x if self.optimizer.x is not None else x
        else:
            self.optimizer.stopping = replace(self.optimizer.stopping, floor=2.0 * self.rounding(len(contributors)))
            nxt = self.advance(round_, x, self.sums(mean, len(contributors)))
        if round_ >= self.rounds and not self.stopped and self.optimizer.x is not None:
            nxt = self.optimizer.x   # the job's last round: the best iterate, not a trial point
        return self.objective.model(nxt, current)

    def sums(self, mean: State, sites: int) -> dict[str, np.ndarray]:
        """The pooled sums: each extra's uniform mean × the number of sites; IntegrityError if one is missing."""
        out = {}
        for name in [GRAD, LOSS, ROWS] + ([HESSIAN] if self.hessian else []):
            if name not in mean:
                raise IntegrityError(f"the round's mean lacks {name!r}; every {self.name} update must carry it")
            out[name] = np.asarray(mean[name], np.float64) * sites
        if not np.all(np.isfinite(out[GRAD])):
            raise IntegrityError(f"the round's gradient sum is not finite; a site sent NaN or infinity in {GRAD!r}")
        return out

    def advance(self, round_: int, x: np.ndarray, sums: Mapping[str, np.ndarray]) -> np.ndarray:
        """The next point to evaluate, from the pooled sums at x."""
        raise NotImplementedError

    def pop_note(self) -> str:
        note, self.note = self.note, ""
        return note

    def state_arrays(self) -> State:
        return {f"exact/{name}": a for name, a in self.optimizer.state_arrays().items()}

    def state_meta(self) -> dict:
        return {"exact": {"sites": self.sites, "note": self.note, **self.optimizer.state_meta()}}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        saved = meta.get("exact")
        if saved is None:
            return
        self.sites, self.note = saved["sites"], saved["note"]
        self.optimizer.load_state({key[len("exact/"):]: a for key, a in arrays.items() if key.startswith("exact/")},
                                  saved)


class LBFGS(ExactRule):
    """L-BFGS (memory m) with a strong-Wolfe line search, one trial per round.

    Under privacy.dp the sites clip each row's gradient to clip_norm and the rule (central mode; the sites in
    distributed mode) adds N(0, (σ·clip_norm)²) to the gradient sum. A line search steered by noisy values would
    accept or reject steps on noise, so instead each round takes one gradient-descent step of args.dp_step on
    F/N, N the pooled row count, itself released once with N(0, σ²) noise (the accountant counts that release
    as one more round). The loss is not used, and the job runs max_iterations rounds (or `rounds`).
    """

    name = "lbfgs"

    def __init__(self, objective: Objective, optimizer: LBFGSOptimizer, *, rounds: int, dp: DPSpec | None = None,
                 dp_step: float = 0.1, job: str = "", seed: int = 0) -> None:
        super().__init__(objective, optimizer, rounds=rounds)
        self.dp, self.dp_step, self.job, self.seed = dp, dp_step, job, seed
        self.rows: float | None = None   # DP: the noisy pooled row count N̂

    @classmethod
    def build(cls, args, cfg: RoundConfig) -> LBFGS:
        optimizer = LBFGSOptimizer(Stopping(args.gtol, args.ftol, args.max_iterations), memory=args.memory,
                                   c1=args.c1, c2=args.c2)
        return cls(Objective.of(cfg.model, args.C), optimizer, rounds=cfg.rounds, dp=cfg.privacy.dp,
                   dp_step=args.dp_step, job=cfg.name, seed=cfg.seed)

    def advance(self, round_: int, x: np.ndarray, sums: Mapping[str, np.ndarray]) -> np.ndarray:
        if self.dp is not None:
            return self._noisy_step(round_, x, sums)
        f, g = self.objective.evaluate(x, float(sums[LOSS][0]), sums[GRAD])
        if self.optimizer.x is None and not math.isfinite(f):
            raise IntegrityError("the loss sum at the starting point is not finite; check the sites' data")
        return self.optimizer.evaluated(x, f, g)

    def _noisy_step(self, round_: int, x: np.ndarray, sums: Mapping[str, np.ndarray]) -> np.ndarray:
        dp, seed = self.dp, self.seed if self.dp.reproducible_noise else None
        grad = sums[GRAD]
        if dp.mode == "central":   # distributed: the sites' noise shares are in the sum already
            grad = add_noise({"grad": grad}, dp.noise_multiplier * dp.clip_norm,
                             noise_key(seed, self.job, round_, "coordinator"))["grad"]
        if self.rows is None:   # one row changes the count by 1: sensitivity 1, noise σ
            noisy = add_noise({"rows": sums[ROWS]}, dp.noise_multiplier,
                              noise_key(seed, self.job, round_, "coordinator/exact-rows"))["rows"]
            self.rows = max(float(noisy[0]), 1.0)
        _, g = self.objective.evaluate(x, 0.0, grad)
        opt = self.optimizer
        opt.iterations += 1
        opt.x = x - self.dp_step * g / self.rows   # the iterate: no loss tells a better one
        if opt.iterations >= opt.stopping.max_iterations:   # now: another round would spend ε on nothing
            opt.stop = f"stopped after max_iterations = {opt.stopping.max_iterations} noisy gradient steps"
        return opt.x

    def state_meta(self) -> dict:
        meta = super().state_meta()
        meta["exact"]["rows"] = self.rows
        return meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
        super().load_state(arrays, meta)
        if "exact" in meta:
            self.rows = meta["exact"].get("rows")


class Newton(ExactRule):
    """Damped Newton: the sites also send the d×d Hessian sum; step −(∇²F)⁻¹∇F, backtracking one trial per round."""

    name = "newton"
    hessian = True
    dp_reason = ("the Hessian sum would need noise of its own, which leaves it indefinite; use lbfgs, which takes "
                 "noisy gradient steps under privacy.dp")

    @classmethod
    def build(cls, args, cfg: RoundConfig) -> Newton:
        objective = Objective.of(cfg.model, args.C)
        if objective.size > args.max_hessian_dim:
            raise ConfigError(f"strategy.args.max_hessian_dim: model {cfg.model.name!r} has d = {objective.size} "
                              f"parameters, above max_hessian_dim {args.max_hessian_dim}, and every site would send "
                              f"the d×d Hessian sum each round ({objective.size ** 2 * 8 / 1e6:.1f} MB); use "
                              f"strategy lbfgs, or raise max_hessian_dim to {objective.size} or more")
        return cls(objective, NewtonOptimizer(Stopping(args.gtol, args.ftol, args.max_iterations)),
                   rounds=cfg.rounds)

    def advance(self, round_: int, x: np.ndarray, sums: Mapping[str, np.ndarray]) -> np.ndarray:
        f, g = self.objective.evaluate(x, float(sums[LOSS][0]), sums[GRAD])
        if self.optimizer.x is None and not math.isfinite(f):
            raise IntegrityError("the loss sum at the starting point is not finite; check the sites' data")
        return self.optimizer.evaluated(x, f, g, self.objective.hessian(sums[HESSIAN]))


class Converging(Schedule):
    """Every online site of the job each round, until the rule's optimiser has stopped. The job's sites are the
    first round's contributors: a site that joins the federation later would change the objective."""

    def __init__(self, sampling: Sampling, rule: ExactRule, cfg: RoundConfig) -> None:
        self.sampling, self.rule = sampling, rule
        self.warning = "" if cfg.model.name in ("logistic", "linear") else \
            NON_CONVEX.format(model=cfg.model.name, name=rule.name)

    def configure(self, round_: int, available: list[str], known: list[str]) -> list[str]:
        chosen = self.sampling.configure(round_, available, known)
        return chosen if self.rule.sites is None else [s for s in chosen if s in self.rule.sites]

    def opened(self, round_: int, participants: list[str], known: list[str]) -> list[str]:
        notes = [note] if (note := self.rule.pop_note()) else []
        if round_ == 1 and self.warning:
            log.warning("%s", self.warning)
            notes.insert(0, f"warning: {self.warning}")
        return notes

    def done(self, rounds_closed: int) -> bool:
        return bool(self.rule.stopped)
