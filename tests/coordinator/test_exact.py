"""Exact federated optimisation at the coordinator (coordinator.strategies.exact): the line search by hand, the
optimisers on quadratics, and the lbfgs/newton rules driven round by round to scikit-learn's pooled optimum."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from driver_rig import DriverRig, rigs
from hypothesis import given, settings, strategies as st

from coordinator.drivers.sync import SyncRounds
from coordinator.strategies import make_strategy
from coordinator.strategies.exact import (
    ACCEPT,
    FAIL,
    MAX_TRIALS,
    RESTART_TRIALS,
    TRY,
    LBFGSOptimizer,
    NewtonOptimizer,
    Objective,
    Stopping,
    Verdict,
    WolfeSearch,
    cubic_minimiser,
    parameter_shapes,
    two_loop,
)
from coordinator.tasks import Binding, UpdateHeader
from plexus.accounting import client_epsilon
from plexus.config import ModelSpec, parse_round_config
from plexus.dp import add_noise, noise_key
from plexus.errors import ConfigError
from plexus.wire import encode

SITES = [f"site{i}" for i in range(5)]


def job(strategy: str, *, rounds: int = 30, model: str = "{name: logistic, args: {in_features: 30, dtype: float64}}",
        extra: str = ""):
    return parse_round_config(f"name: bc\nmodel: {model}\ndata: {{dataset: bc}}\nrounds: {rounds}\n"
                              f"strategy: {strategy}\n{extra}")


# The line search, told one evaluation at a time ---------------------------------------------

def search_on(phi, alpha: float, *, c1: float = 1e-4, c2: float = 0.9) -> tuple[WolfeSearch, list[float], str]:
    """Run a WolfeSearch on φ (returning φ, φ') from its first trial; the search, the trials, the last action."""
    f0, d0 = phi(0.0)
    search = WolfeSearch(f0, d0, alpha, c1, c2)
    trials = [alpha]
    while True:
        verdict = search.tell(*phi(search.alpha))
        if verdict.action != TRY:
            return search, trials, verdict.action
        trials.append(verdict.alpha)


def strong_wolfe(phi, alpha: float, c1: float, c2: float) -> bool:
    (f0, d0), (f, d) = phi(0.0), phi(alpha)
    return f <= f0 + c1 * alpha * d0 and abs(d) <= -c2 * d0


def square(a: float) -> tuple[float, float]:
    """φ(α) = (α − 3)²: x = 0 moving along d = 1 on f(x) = (x − 3)²."""
    return (a - 3.0) ** 2, 2.0 * (a - 3.0)


def test_a_first_trial_that_satisfies_both_conditions_is_accepted_at_once():
    # φ(1) = 4 <= 9 − 1e-4·6 and |φ'(1)| = 4 <= 0.9·6
    _, trials, action = search_on(square, 1.0)
    assert (trials, action) == ([1.0], ACCEPT)


def test_an_overshoot_zooms_to_the_minimiser_of_a_quadratic_in_one_cubic_step():
    # φ(10) = 49 > 9: the bracket is [0, 10], and the cubic through its ends is φ itself, minimised at 3
    _, trials, action = search_on(square, 10.0)
    assert trials == [10.0, 3.0] and action == ACCEPT


def test_a_step_past_the_minimiser_that_violates_curvature_zooms_back():
    # φ(5) = 4 decreases enough, but |φ'(5)| = 4 > 0.1·6: zoom between 5 (lo) and 0 (hi) finds 3
    search, trials, action = search_on(square, 5.0, c2=0.1)
    assert trials == [5.0, 3.0] and action == ACCEPT
    assert search.zooming


def test_too_short_a_step_extrapolates_at_most_four_steps_beyond():
    # φ'(0.1) = −5.8 is still steep (> 0.9·6 in size): the next trial is 0.1 + 4·0.1, short of the cubic's 3
    _, trials, action = search_on(square, 0.1)
    assert trials == [0.1, 0.5] and action == ACCEPT


def test_the_cubic_through_two_points_of_a_cubic_is_its_minimiser():
    def phi(a):   # φ(α) = α³ − 3α, minimum at 1
        return a ** 3 - 3 * a, 3 * a * a - 3

    assert cubic_minimiser([0.0, *phi(0.0)], [2.0, *phi(2.0)]) == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(cubic_minimiser([0.0, 0.0, 1.0], [1.0, 1.0, 1.0]))   # a line's cubic has no minimum


def test_near_the_optimum_the_slopes_decide_where_fs_rounding_hides_the_decrease():
    # F rose by 1e-9 (the loss sums' fixed point), but φ' went from −1e-6 to −5e-7: on a quadratic that is a
    # decrease of 7.5e-7·α, so Hager & Zhang's approximate Wolfe condition accepts the step
    assert WolfeSearch(1.0, -1e-6, 1.0).tell(1.0 + 1e-9, -5e-7).action == ACCEPT
    assert WolfeSearch(1.0, -1e-6, 1.0).tell(1.0 + 1e-5, -5e-7).action == TRY   # beyond rounding: F decides


def test_a_trial_that_evaluates_to_nan_is_bisected_back():
    search = WolfeSearch(9.0, -6.0, 10.0)
    assert search.tell(math.nan, math.nan) == Verdict(TRY, 5.0)
    assert search.tell(*square(5.0)) == Verdict(ACCEPT, 5.0)   # φ(5) = 4, |φ'(5)| = 4 <= 0.9·6


def test_a_search_that_cannot_decrease_fails_after_max_trials():
    # φ rises everywhere but claims a descent slope at 0 (inconsistent values, e.g. a site sending garbage)
    search = WolfeSearch(0.0, -1.0, 1.0)
    for _ in range(MAX_TRIALS - 1):
        assert search.tell(1.0, 1.0).action == TRY
    assert search.tell(1.0, 1.0).action == FAIL


@settings(max_examples=200, deadline=None)
@given(m=st.floats(0.01, 100), a=st.floats(0.01, 10), b=st.floats(0, 10), start=st.floats(1e-3, 1e3),
       c2=st.sampled_from([0.9, 0.5, 0.1]))
def test_every_accepted_step_satisfies_the_strong_wolfe_conditions(m, a, b, start, c2):
    def phi(x):   # strictly convex with its minimum at m > 0, so a strong-Wolfe step exists
        u = x - m
        return a * u * u + b * u ** 4, 2 * a * u + 4 * b * u ** 3

    _, trials, action = search_on(phi, start, c2=c2)
    assert action == ACCEPT, trials
    assert strong_wolfe(phi, trials[-1], 1e-4, c2)


def test_a_search_resumed_from_its_json_state_continues_identically():
    def phi(x):
        return math.cosh(x - 2.0) + 0.1 * x * x, math.sinh(x - 2.0) + 0.2 * x

    live = WolfeSearch(*phi(0.0), 40.0, 1e-4, 0.01)
    resumed = WolfeSearch(*phi(0.0), 40.0, 1e-4, 0.01)
    while True:
        resumed = WolfeSearch.of(json.loads(json.dumps(resumed.meta())))   # a restart between any two rounds
        a, b = live.tell(*phi(live.alpha)), resumed.tell(*phi(resumed.alpha))
        assert a == b
        if a.action != TRY:
            break
    assert live.trials > 2


# The optimisers on quadratics ---------------------------------------------------------------

def quadratic(d: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d, d))
    a = a @ a.T + 0.1 * np.eye(d)
    b = rng.normal(size=d)
    return a, b, np.linalg.solve(a, b)


@pytest.mark.parametrize("seed", range(5))
def test_lbfgs_with_a_near_exact_line_search_minimises_a_quadratic_in_d_iterations(seed):
    """With exact line searches (c2 small; the cubic zoom is exact on a quadratic) L-BFGS with memory >= d is
    conjugate gradients, which terminates in at most d steps."""
    d = 8
    a, b, solution = quadratic(d, seed)
    opt = LBFGSOptimizer(Stopping(gtol=1e-9, ftol=0.0, max_iterations=100), memory=d, c2=1e-6)
    x, evaluations = np.zeros(d), 0
    while not opt.stop:
        x = opt.evaluated(x, 0.5 * x @ a @ x - b @ x, a @ x - b)
        evaluations += 1
    assert opt.stop.startswith("converged") and opt.iterations <= d + 1
    np.testing.assert_allclose(opt.x, solution, atol=1e-9)


def test_on_rounded_sums_a_long_search_restarts_along_the_scaled_gradient_with_a_fresh_memory():
    """Secure rounds (stopping.floor > 0): after RESTART_TRIALS trials without a step the memory is dropped and the
    next trial is x − γ∇F from the best iterate, γ = s·y/y·y of the newest pair; on exact sums it searches on."""
    a, b, _ = quadratic(4, 0)
    f, g = (lambda x: 0.5 * x @ a @ x - b @ x), (lambda x: a @ x - b)
    for floor, restarts in ((1e-6, True), (0.0, False)):
        opt = LBFGSOptimizer(Stopping(gtol=1e-12, ftol=0.0, max_iterations=100, floor=floor))
        x = opt.evaluated(np.zeros(4), f(np.zeros(4)), g(np.zeros(4)))
        while not opt.pairs:   # until a step is accepted and gives a curvature pair
            x = opt.evaluated(x, f(x), g(x))
        (s, y), best = opt.pairs[-1], opt.x.copy()
        for _ in range(RESTART_TRIALS):   # trials that always rise: no step is ever accepted
            x = opt.evaluated(x, f(best) + 1.0, g(x))
        if restarts:
            assert opt.pairs == [] and opt.search.trials == 0
            np.testing.assert_allclose(x, best - (s @ y) / (y @ y) * g(best))
        else:
            assert opt.pairs and opt.search.trials == RESTART_TRIALS and not opt.stop


def test_under_secure_aggregation_the_gradient_within_the_sums_rounding_counts_as_converged():
    stop = Stopping(gtol=1e-10, ftol=0.0, max_iterations=100, floor=2e-6)
    assert stop.why(3, np.array([1.5e-6, -1e-6]), 1.0, None).startswith("converged")
    assert stop.why(3, np.array([3e-6, 0.0]), 1.0, None) == ""
    secure = make_strategy(job("{name: lbfgs, args: {C: 0.5}}", extra=(
        "sites: {min: 3}\nprivacy: {secure_aggregation: true, secagg: {clip: 1024}}\n"))).rule
    assert secure.rounding(4) == 0.5 * 4 * 4 * 2.0 ** -21   # C·K²·2^-(f+1), f = 30 − log2(1024)
    assert make_strategy(job("{name: lbfgs, args: {C: 0.5}}")).rule.rounding(4) == 0.0


def test_two_loop_with_one_pair_is_the_bfgs_update_of_the_scaled_identity():
    rng = np.random.default_rng(1)
    s, y, g = rng.normal(size=(3, 4))
    y = y + 3 * s   # sᵀy > 0
    rho, gamma = 1 / (y @ s), (s @ y) / (y @ y)
    v = np.eye(4) - rho * np.outer(y, s)
    h = v.T @ (gamma * np.eye(4)) @ v + rho * np.outer(s, s)
    np.testing.assert_allclose(two_loop(g, [(s, y)]), -h @ g, rtol=1e-12)


def test_newton_minimises_a_quadratic_in_one_step():
    a, b, solution = quadratic(6, 0)
    opt = NewtonOptimizer(Stopping(gtol=1e-9, ftol=0.0, max_iterations=50))
    x = opt.evaluated(np.zeros(6), 0.0, -b, a)
    np.testing.assert_allclose(x, solution, rtol=1e-10)
    opt.evaluated(x, 0.5 * x @ a @ x - b @ x, a @ x - b, a)
    assert opt.iterations == 1 and opt.stop.startswith("converged")


def test_newton_backtracks_until_armijo_holds():
    # f(x) = √(1 + x²): Newton's full step from x = 2 is x − f'/f'' = −x³ = −8, where f has risen
    def f(x):
        return math.sqrt(1 + x * x), x / math.sqrt(1 + x * x), (1 + x * x) ** -1.5

    opt = NewtonOptimizer(Stopping(gtol=1e-10, ftol=0.0, max_iterations=50))
    v, g, h = f(2.0)
    x = opt.evaluated(np.array([2.0]), v, np.array([g]), np.array([[h]]))
    assert x[0] == pytest.approx(-8.0)
    v, g, h = f(x[0])
    x = opt.evaluated(x, v, np.array([g]), np.array([[h]]))
    assert 2.0 - 0.5 * 10 <= x[0] <= 2.0 - 0.1 * 10 + 1e-12 and opt.backtracks == 1   # α in [0.1, 0.5]


# The model as one vector ------------------------------------------------------------------

@pytest.mark.parametrize("model", [
    "{name: logistic, args: {in_features: 5}}", "{name: logistic, args: {in_features: 5, num_classes: 4}}",
    "{name: mlp, args: {in_features: 5, hidden: [7, 3], num_classes: 3}}",
    "{name: mlp, args: {in_features: 5, hidden: [7, 3], dropout: 0.2}}",
    "{name: linear, args: {in_features: 5}}"])
def test_parameter_shapes_are_torch_named_parameters_in_order(model):
    from plexus.models import REGISTRY, build_model

    spec = ModelSpec(**yaml.safe_load(model))   # the model alone: a linear job also declares data.target: numeric
    if spec.name not in REGISTRY:
        pytest.skip(f"model {spec.name!r} comes with the site half (branch exact-site)")
    built = build_model(spec.name, spec.args, seed=0)
    assert parameter_shapes(spec) == [(name, tuple(p.shape)) for name, p in built.named_parameters()]


def test_binary_logistic_pins_the_class_0_row_and_leaves_biases_unpenalised():
    objective = Objective.of(ModelSpec("logistic", {"in_features": 2}), 0.5)
    # named_parameters order: weight [[w00, w01], [w10, w11]], then bias [b0, b1]; free: w10, w11, b1
    assert objective.free.tolist() == [False, False, True, True, False, True]
    assert objective.penalised.tolist() == [True, True, True, True, False, False]
    x = np.array([1.0, 2.0, 3.0])
    f, g = objective.evaluate(x, 10.0, np.array([9.0, 9.0, 1.0, 1.0, 9.0, 1.0]))
    assert f == 0.5 * 10 + 0.5 * (1 + 4) and g.tolist() == [0.5 + 1, 0.5 + 2, 0.5]
    state = objective.model(x, {"linear.weight": np.zeros((2, 2)), "linear.bias": np.zeros(2, np.float32)})
    assert state["linear.weight"].tolist() == [[0, 0], [1, 2]] and state["linear.bias"].tolist() == [0, 3]
    assert state["linear.bias"].dtype == np.float32


# The rules, round by round, against scikit-learn on breast cancer ---------------------------

@pytest.fixture(scope="module")
def cancer():
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    return (x - x.mean(0)) / x.std(0), y   # standardised once, with the whole set's constants


def site_sums(state, x, y, *, hessian: bool) -> dict[str, np.ndarray]:
    """What a site sends for the `logistic` model: Σ over its rows of softmax cross-entropy, its gradient (every
    row of the weight and bias, named_parameters order) and Hessian, in plain numpy."""
    w, b = state["linear.weight"], state["linear.bias"]
    k, d = w.shape
    z = x @ w.T + b
    z -= z.max(1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(k)[y]
    out = {"exact/loss": np.array([-np.sum(np.log(p[np.arange(len(y)), y]))]),
           "exact/grad": np.concatenate([((p - onehot).T @ x).ravel(), (p - onehot).sum(0)]),
           "exact/rows": np.array([float(len(y))])}
    if hessian:
        xb = np.c_[x, np.ones(len(x))]
        at = [list(range(c * d, (c + 1) * d)) + [k * d + c] for c in range(k)]
        h = np.zeros((k * (d + 1), k * (d + 1)))
        for c in range(k):
            for e in range(k):
                h[np.ix_(at[c], at[e])] = xb.T @ (xb * (p[:, c] * ((c == e) - p[:, e]))[:, None])
        out["exact/hessian"] = h
    return out


def round_mean(state, data, sites, *, hessian: bool):
    """The driver's uniform mean over the sites (each a contiguous shard of the rows): model unchanged, sums / K,
    each site's sums on the driver's fixed-point grid of 2⁻³² (coordinator.aggregate), as the rule gets them."""
    x, y = data
    shards = np.array_split(np.arange(len(y)), len(SITES))
    total: dict[str, np.ndarray] = {}
    for site, rows in zip(SITES, shards):
        if site in sites:
            for name, value in site_sums(state, x[rows], y[rows], hessian=hessian).items():
                total[name] = total.get(name, 0) + np.rint(value * 2.0 ** 32) / 2.0 ** 32
    return {**state, **{name: value / len(sites) for name, value in total.items()}}


def drive(strategy, data, rounds: int, *, restart=None, sites_of=lambda r: SITES, notes=None):
    """Run the strategy as the sync driver would for up to `rounds` rounds; the models served after each round.
    `restart(strategy) -> strategy`: a coordinator restart after every round; `notes`: round -> event notes."""
    state = strategy.rule.initial_model({"linear.weight": np.ones((2, 30)), "linear.bias": np.ones(2)})
    served, notes = [], {} if notes is None else notes
    for r in range(1, rounds + 1):
        sites = sites_of(r)
        notes[r] = strategy.opened(r, sites, SITES)
        mean = round_mean(state, data, sites, hessian=strategy.name == "newton")
        state = strategy.rule.step(r, state, mean, sorted(sites), population=len(SITES))
        served.append(state)
        if restart:
            strategy = restart(strategy)
        if strategy.schedule.done(r):
            break
    return served, strategy


def sklearn_optimum(data, c: float) -> np.ndarray:
    from sklearn.linear_model import LogisticRegression

    fit = LogisticRegression(tol=1e-12, C=c, max_iter=10000).fit(*data)
    return np.r_[fit.coef_[0], fit.intercept_]


def class_1(state) -> np.ndarray:
    assert not state["linear.weight"][0].any() and state["linear.bias"][0] == 0   # class 0 held at zero
    return np.r_[state["linear.weight"][1], state["linear.bias"][1]]


# C = 0.1, not 1: at C = 1 breast cancer is so ill-conditioned (κ ≈ 86 at the optimum) that scikit-learn's own
# lbfgs stops (on its ftol) 1.1e-6 from the optimum that Newton finds to machine precision, and scipy's L-BFGS-B
# needs 53 evaluations to come within 1e-6 of it; at C = 0.1 (κ ≈ 16) its answer is within 2e-7.
@pytest.mark.parametrize("name, rounds", [("lbfgs", 30), ("newton", 8)])
def test_the_rule_reaches_sklearns_pooled_optimum(cancer, name, rounds):
    strategy = make_strategy(job(f"{{name: {name}, args: {{C: 0.1}}}}", rounds=rounds))
    served, strategy = drive(strategy, cancer, rounds)
    assert len(served) <= rounds
    np.testing.assert_allclose(class_1(served[-1]), sklearn_optimum(cancer, 0.1), rtol=0, atol=1e-6)
    assert served[-1]["linear.weight"].dtype == np.float64


def test_newton_stops_before_the_rounds_run_out(cancer):
    strategy = make_strategy(job("{name: newton, args: {C: 0.1}}", rounds=50))
    served, strategy = drive(strategy, cancer, 50)
    assert len(served) == 8 and strategy.schedule.done(8)
    assert strategy.rule.stopped.startswith("converged")


def test_multinomial_newton_matches_sklearn_with_every_row_free():
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    x, y = load_iris(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    strategy = make_strategy(job("{name: newton, args: {C: 1.0}}", rounds=20,
                                 model="{name: logistic, args: {in_features: 4, num_classes: 3}}"))
    state = strategy.rule.initial_model({"linear.weight": np.ones((3, 4)), "linear.bias": np.ones(3)})
    for r in range(1, 21):
        sums = site_sums(state, x, y, hessian=True)
        state = strategy.rule.step(r, state, {**state, **sums}, ["only"], population=1)
        if strategy.schedule.done(r):
            break
    fit = LogisticRegression(tol=1e-12, C=1.0, max_iter=10000, solver="newton-cholesky").fit(x, y)
    np.testing.assert_allclose(state["linear.weight"], fit.coef_, atol=1e-6)
    np.testing.assert_allclose(state["linear.bias"], fit.intercept_ - fit.intercept_.mean(), atol=1e-6)
    assert abs(state["linear.bias"].sum()) < 1e-9   # the singular shift direction never moved


def test_a_round_without_every_site_evaluates_the_same_point_again(cancer):
    strategy = make_strategy(job("{name: lbfgs, args: {C: 0.1}}", rounds=10))
    missing, notes = {3: SITES[:-1]}, {}
    served, strategy = drive(strategy, cancer, 6, sites_of=lambda r: missing.get(r, SITES), notes=notes)
    full, _ = drive(make_strategy(job("{name: lbfgs, args: {C: 0.1}}", rounds=10)), cancer, 5)
    np.testing.assert_array_equal(served[2]["linear.weight"], served[1]["linear.weight"])   # round 3: again
    for got, want in zip(served[3:], full[2:]):   # then on as if round 3 had not happened
        np.testing.assert_array_equal(got["linear.weight"], want["linear.weight"])
    assert notes == {1: [], 2: [], 3: [], 5: [], 6: [], 4: [
        "round 3: sums from 4 site(s), not the job's 5 (missing: site4), are another objective's; the same point "
        "is evaluated again"]}


def test_a_site_that_joins_after_the_first_round_is_not_chosen(cancer):
    strategy = make_strategy(job("{name: lbfgs, args: {C: 0.1}}"))
    assert strategy.schedule.configure(1, SITES, SITES) == SITES
    drive(strategy, cancer, 1)
    assert strategy.schedule.configure(2, [*SITES, "site9"], [*SITES, "site9"]) == SITES
    assert strategy.schedule.configure(2, SITES[1:], SITES) == SITES[1:]   # a round without site0 is repeated


def test_a_first_model_other_than_zeros_is_not_evaluated_but_replaced_by_zeros(cancer):
    strategy = make_strategy(job("{name: lbfgs, args: {C: 0.1}}"))
    ones = {"linear.weight": np.ones((2, 30)), "linear.bias": np.ones(2)}
    out = strategy.rule.step(1, ones, round_mean(ones, cancer, SITES, hessian=False), SITES, population=5)
    assert not any(v.any() for v in out.values()) and strategy.rule.optimizer.x is None
    assert strategy.opened(2, SITES, SITES) == [
        "round 1: the served model is not zeros, where lbfgs starts; zeros next"]


@pytest.mark.parametrize("name", ["lbfgs", "newton"])
def test_a_restarted_coordinator_resumes_mid_line_search_bit_for_bit(cancer, name):
    # c2 0.01: a near-exact line search, so most searches take several trials (rounds)
    args = "{name: lbfgs, args: {C: 0.1, c2: 0.01}}" if name == "lbfgs" else "{name: newton, args: {C: 0.1}}"
    searching = []

    def restart(strategy):
        arrays, meta = strategy.state_arrays(), json.loads(json.dumps(strategy.state_meta()))
        search = meta["exact"].get("search")
        searching.append(bool(search and search["trials"] and not strategy.rule.stopped))
        fresh = make_strategy(job(args, rounds=12))
        fresh.load_state({k: np.array(v) for k, v in arrays.items()}, meta)
        return fresh

    live, _ = drive(make_strategy(job(args, rounds=12)), cancer, 12)
    resumed, _ = drive(make_strategy(job(args, rounds=12)), cancer, 12, restart=restart)
    assert len(live) == len(resumed)
    for a, b in zip(live, resumed):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    if name == "lbfgs":
        assert any(searching)   # some restart fell between two trials of one line search


def test_the_last_round_serves_the_best_iterate_not_a_trial(cancer):
    strategy = make_strategy(job("{name: lbfgs, args: {C: 0.1, c2: 0.01}}", rounds=4))
    served, strategy = drive(strategy, cancer, 4)
    opt = strategy.rule.optimizer
    assert opt.search.trials >= 1 and not strategy.rule.stopped   # the rounds ran out mid-search
    np.testing.assert_array_equal(class_1(served[-1]), opt.x)


def test_dp_takes_noisy_gradient_steps_on_f_over_a_noisy_row_count(cancer):
    extra = "privacy: {dp: {mode: central, noise_multiplier: 0.5, clip_norm: 2.0, reproducible_noise: true}}\n"
    strategy = make_strategy(job("{name: lbfgs, args: {C: 0.1, dp_step: 0.5, max_iterations: 3}}", rounds=10,
                                 extra=extra))
    served, strategy = drive(strategy, cancer, 10)
    assert len(served) == 3 and strategy.rule.stopped.startswith("stopped after max_iterations = 3")
    # round 1 by hand: x0 = 0, ∇F = C·(Σ∇ℓ + N(0, (σ·clip)²)), N̂ = N + N(0, σ²)
    x, y = cancer
    zero = {"linear.weight": np.zeros((2, 30)), "linear.bias": np.zeros(2)}
    grad = round_mean(zero, cancer, SITES, hessian=False)["exact/grad"] * len(SITES)
    noisy = add_noise({"grad": grad}, 0.5 * 2.0, noise_key(0, "bc", 1, "coordinator"))["grad"]
    rows = add_noise({"rows": np.array([float(len(y))])}, 0.5, noise_key(0, "bc", 1, "coordinator/exact-rows"))
    free = Objective.of(ModelSpec("logistic", {"in_features": 30}), 0.1).free
    step = -0.5 * 0.1 * noisy[free] / rows["rows"][0]
    np.testing.assert_allclose(class_1(served[0]), step, rtol=1e-12)


# Config and build-time refusals -------------------------------------------------------------

@pytest.mark.parametrize("extra, key, fix", [
    ("sites: {fraction: 0.5}\n", "sites", "remove sites.fraction"),
    ("sites: {count: 3}\n", "sites", "remove sites.count"),
    ("asynchronous: {buffer: 2}\n", "asynchronous", "remove the asynchronous block"),
    ("compression: {downlink: {codec: fp16}}\n", "compression", "remove compression"),
    ("privacy: {dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0}}\n", "privacy", "remove privacy.dp_sgd"),
])
@pytest.mark.parametrize("name", ["lbfgs", "newton"])
def test_combinations_that_break_the_exact_objective_are_refused(name, extra, key, fix):
    with pytest.raises(ConfigError, match=rf":\d+: {key}: .*strategy '{name}'.*; .*{fix}"):
        job(f"{{name: {name}}}", extra=extra)


def test_newton_under_dp_is_refused_and_lbfgs_is_not():
    dp = "privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0}}\n"
    with pytest.raises(ConfigError, match=r":\d+: privacy: dp cannot protect newton.*use strategy lbfgs"):
        job("{name: newton}", extra=dp)
    assert make_strategy(job("{name: lbfgs}", extra=dp)).name == "lbfgs"


def test_models_without_a_summable_loss_and_inconsistent_wolfe_constants_are_refused():
    with pytest.raises(ConfigError, match=r":2: model: 'cnn' has no per-row loss .* use one of logistic, linear, mlp"):
        job("{name: lbfgs}", model="{name: cnn}")
    with pytest.raises(ConfigError, match=r"strategy: args.c1 \(0.95\) must be below args.c2 \(0.9\)"):
        job("{name: lbfgs, args: {c1: 0.95}}")


def test_newton_refuses_a_hessian_above_max_hessian_dim_at_build_time():
    with pytest.raises(ConfigError, match=r"strategy.args.max_hessian_dim: .* d = 62 parameters, above "
                                          r"max_hessian_dim 50.*raise max_hessian_dim to 62"):
        make_strategy(job("{name: newton, args: {max_hessian_dim: 50}}"))


def test_a_built_model_with_other_parameters_is_refused():
    rule = make_strategy(job("{name: lbfgs}")).rule
    with pytest.raises(ConfigError, match="model: the built model's tensors"):
        rule.initial_model({"w": np.zeros(3)})


def test_a_non_convex_model_warns_in_the_first_rounds_events():
    strategy = make_strategy(job("{name: lbfgs}", model="{name: mlp, args: {in_features: 30, hidden: [4]}}"))
    notes = strategy.opened(1, SITES, SITES)
    assert len(notes) == 1 and notes[0].startswith("warning: model 'mlp' is not convex")
    assert strategy.opened(2, SITES, SITES) == []
    assert make_strategy(job("{name: newton}")).opened(1, SITES, SITES) == []


# Through the sync driver ------------------------------------------------------------------

DRIVER_JOB = """\
name: bc
model: {{name: logistic, args: {{in_features: 3, dtype: float64}}}}
data: {{dataset: heart-disease}}
rounds: 5
sites: {{min: 2, deadline_s: 60}}
strategy: {{name: lbfgs, args: {{C: 1.0}}}}
{privacy}
"""
DP = "privacy: {dp: {mode: central, noise_multiplier: 0.8, clip_norm: 1.0, reproducible_noise: true}}"


class ExactRig(DriverRig):
    """SyncRounds over a real store with a float64 binary logistic model; sites send their sums as updates."""

    driver_class = SyncRounds

    def __init__(self, path, *, privacy: str = ""):
        super().__init__(path, DRIVER_JOB.format(privacy=privacy),
                         model={"linear.weight": np.zeros((2, 3)), "linear.bias": np.zeros(2)})

    def tick(self) -> float:
        return self.driver.tick(self.now)

    def send_sums(self, site: str, grant, model: dict, sums: dict) -> str:
        layout, blob = encode({**model, **sums})
        header = UpdateHeader(task=Binding(grant.task_id, grant.job_id, grant.round, grant.nonce), num_samples=10,
                              layout=layout)
        return self.stream(site, grant, header, blob)


@pytest.fixture
def exact_rig(tmp_path):
    yield from rigs(tmp_path, ExactRig)


def some_sums(seed: int) -> dict[str, np.ndarray]:
    """Sums far beyond dp.clip_norm, as a site's gradient sum over its rows is."""
    rng = np.random.default_rng(seed)
    return {"exact/grad": rng.normal(0, 50, 8), "exact/loss": np.array([40.0 + seed]), "exact/rows": np.array([30.0])}


@pytest.mark.parametrize("privacy", ["", DP])
def test_the_driver_serves_the_rules_next_point_and_leaves_dp_to_the_rule(exact_rig, privacy):
    """Under privacy.dp the rule noises the gradient sum itself: the driver neither refuses the sums as updates
    beyond clip_norm nor adds DP-FedAvg noise to the mean, and counts ε over the row-level Gaussian mechanism:
    σ at q = 1 per round, plus one round for the noisy row count."""
    r = exact_rig(privacy=privacy)
    reference = make_strategy(r.driver.job.cfg)
    model = {"linear.weight": np.zeros((2, 3)), "linear.bias": np.zeros(2)}
    for round_ in (1, 2):
        r.join("a", "b")
        r.tick()
        grants = {s: r.driver.grant(s) for s in ("a", "b")}
        sums = {s: some_sums(round_ * 10 + i) for i, s in enumerate(("a", "b"))}
        for s in ("a", "b"):
            assert "accepted" in r.send_sums(s, grants[s], model, sums[s])
        r.tick()
        assert r.store.job(r.job_id).current_round == round_
        fixed = {k: sum(np.rint(sums[s][k] * 2.0 ** 32) for s in ("a", "b")) for k in sums["a"]}   # the driver's
        mean = {**model, **{k: v / 2.0 ** 33 for k, v in fixed.items()}}                           # 2⁻³² grid
        model = reference.rule.step(round_, model, mean, ["a", "b"], population=2)
        served = r.store.load_checkpoint(r.job_id, round_)
        assert all(np.array_equal(served[k], model[k]) for k in model)   # bit for bit: no noise but the rule's
    epsilons = {m.round: m.value for m in r.store.metrics(r.job_id) if m.kind == "privacy" and m.name == "epsilon"}
    if privacy:
        assert epsilons == {n: pytest.approx(client_epsilon(0.8, [1.0] * (n + 1), 1e-5), rel=1e-12) for n in (1, 2)}
    else:
        assert epsilons == {}
