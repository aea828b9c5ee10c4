"""Tests for coordinator.strategies: hand-computed server math, robust rules, schedules, config checks."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from coordinator.strategies import (
    REGISTRY,
    MeanRule,
    Strategy,
    Update,
    UpdatesRule,
    keeps_mean,
    make_strategy,
    refuses_dp,
    refuses_secure_aggregation,
    sample_sites,
)
from coordinator.strategies.robust import krum_scores
from plexus.config import (
    ASYNC_STRATEGIES,
    COMPRESSIBLE_STRATEGIES,
    STRATEGY_ARGS,
    SUMMING_STRATEGIES,
    parse_round_config,
)
from plexus.errors import ConfigError, IntegrityError
from plexus.wire import Layout

BASE = "name: job\nmodel: {name: mlp, args: {in_features: 4}}\ndata: {dataset: heart}\nrounds: 5\n"
DP = "privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0}}\n"
SECAGG = "privacy: {secure_aggregation: true}\n"


def cfg(strategy: str, *extra: str):
    """A round config; `strategy` is a bare registry name or a YAML flow mapping."""
    strategy = strategy if strategy.startswith("{") else f"{{name: {strategy}}}"
    return parse_round_config(BASE + f"strategy: {strategy}\n" + "".join(extra))


def build(strategy: str, *extra: str) -> Strategy:
    return make_strategy(cfg(strategy, *extra))


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def step(s: Strategy, round_: int, current, mean, contributors):
    """The MeanRule's next model, with the population the strategy recorded when the round opened."""
    return s.rule.step(round_, current, mean, contributors, population=s.population)


def restored(strategy: Strategy, config: str, *extra: str) -> Strategy:
    """A fresh strategy loaded from `strategy`'s saved state, meta through JSON as a checkpoint would."""
    fresh = build(config, *extra)
    arrays = {k: np.array(v) for k, v in strategy.state_arrays().items()}
    fresh.load_state(arrays, json.loads(json.dumps(strategy.state_meta())))
    return fresh


# FedAvgM and FedOpt ----------------------------------------------------------------------

def test_fedavgm_two_rounds_by_hand():
    s = build("{name: fedavgm, args: {eta: 0.5, momentum: 0.5}}")
    x0 = {"w": f32(1, 2), "n": np.array([5], np.int64)}

    # Δ = [2, 0] − [1, 2] = [1, −2]; v = Δ; x = x + 0.5 v
    x1 = step(s, 1, x0, {"w": f32(2, 0), "n": np.array([7], np.int64)}, ["a", "b"])
    assert x1["w"].tolist() == [1.5, 1.0] and x1["w"].dtype == np.float32
    assert x1["n"].tolist() == [7] and x1["n"].dtype == np.int64
    assert s.state_arrays()["v/w"].tolist() == [1.0, -2.0]

    # Δ = [2.5, 1] − [1.5, 1] = [1, 0]; v = 0.5·[1, −2] + [1, 0] = [1.5, −1]; x = [1.5 + 0.75, 1 − 0.5]
    x2 = step(s, 2, x1, {"w": f32(2.5, 1.0), "n": np.array([7], np.int64)}, ["a"])
    assert x2["w"].tolist() == [2.25, 0.5]
    assert s.state_arrays()["v/w"].tolist() == [1.5, -1.0]


OPT = "{name: %s, args: {eta: 0.3, beta1: 0.5, %stau: 1.0}}"


@pytest.mark.parametrize("name, v1, v2", [
    # round 1: Δ = [2, −4], Δ² = [4, 16]. Adam: v = 0.25 Δ² = [1, 4]. Yogi from v = 0: v = −0.25 Δ² sign(−Δ²)
    # = [1, 4] as well. Adagrad: v = Δ² = [4, 16].
    # round 2: Δ = [0, 4], Δ² = [0, 16]. Adam: v = 0.75 [1, 4] + 0.25 [0, 16] = [0.75, 7].
    # Yogi: sign(v − Δ²) = [1, −1], v = [1, 4] − 0.25 [0, 16] [1, −1] = [1, 8]. Adagrad: [4, 32].
    ("fedadam", [1.0, 4.0], [0.75, 7.0]),
    ("fedyogi", [1.0, 4.0], [1.0, 8.0]),
    ("fedadagrad", [4.0, 16.0], [4.0, 32.0]),
])
def test_fedopt_two_rounds_by_hand(name, v1, v2):
    config = OPT % (name, "" if name == "fedadagrad" else "beta2: 0.75, ")
    s = build(config)
    x0 = {"w": np.array([1.0, 2.0]), "n": np.array([3], np.int32)}

    # m = 0.5 Δ = [1, −2]; x = x + 0.3 m / (√v + 1)
    x1 = step(s, 1, x0, {"w": np.array([3.0, -2.0]), "n": np.array([4], np.int32)}, ["a"])
    assert x1["w"] == pytest.approx([1 + 0.3 * 1 / (math.sqrt(v1[0]) + 1), 2 + 0.3 * -2 / (math.sqrt(v1[1]) + 1)])
    assert x1["w"].dtype == np.float64 and x1["n"].tolist() == [4] and x1["n"].dtype == np.int32
    state = s.state_arrays()
    assert state["m/w"].tolist() == [1.0, -2.0] and state["v/w"].tolist() == v1

    # m = 0.5 [1, −2] + 0.5 [0, 4] = [0.5, 1]
    mean = {"w": x1["w"] + np.array([0.0, 4.0]), "n": np.array([4], np.int32)}
    x2 = step(s, 2, x1, mean, ["a"])
    assert x2["w"] == pytest.approx(x1["w"] + 0.3 * np.array([0.5, 1.0]) / (np.sqrt(v2) + 1), rel=1e-6)
    state = s.state_arrays()
    assert state["m/w"].tolist() == [0.5, 1.0] and state["v/w"] == pytest.approx(v2)


def test_fedopt_casts_to_the_current_dtype_and_keeps_only_model_names():
    s = build("fedadam")
    out = step(s, 1, {"w": f32(0, 0)}, {"w": f32(1, 1)}, ["a"])
    assert set(out) == {"w"} and out["w"].dtype == np.float32


# SCAFFOLD ---------------------------------------------------------------------------------

def test_scaffold_x_and_c_over_two_rounds_with_partial_participation():
    s = build("{name: scaffold, args: {eta_g: 0.5}}")
    assert s.rule.weighting == "uniform" and s.rule.reads_current and not keeps_mean(s.rule)
    assert refuses_secure_aggregation(type(s.rule)) and refuses_dp(type(s.rule))
    x0 = {"w": f32(1, 2), "n": np.array([1], np.int64)}
    assert {k: v.tolist() for k, v in s.rule.served(x0).items()} == {"scaffold/c/w": [0.0, 0.0]}
    assert s.rule.served(x0)["scaffold/c/w"].dtype == np.float32

    # |S|/N = 2/4. x = [1, 2] + 0.5 ([3, 0] − [1, 2]) = [2, 1]; c = 0 + 0.5 [0.4, −0.2] = [0.2, −0.1]
    assert s.opened(1, ["a", "b"], ["a", "b", "c", "d"]) == []
    x1 = step(s, 1, x0, {"w": f32(3, 0), "n": np.array([3], np.int64), "scaffold/dc/w": f32(0.4, -0.2)},
                     ["a", "b"])
    assert x1["w"].tolist() == [2.0, 1.0] and x1["n"].tolist() == [3] and set(x1) == {"w", "n"}
    assert s.rule.served(x1)["scaffold/c/w"] == pytest.approx([0.2, -0.1])

    # |S|/N = 3/4. x = [2, 1] + 0.5 ([2, 3] − [2, 1]) = [2, 2]; c = [0.2, −0.1] + 0.75 [0.4, 0.4] = [0.5, 0.2]
    s.opened(2, ["a", "b", "c"], ["a", "b", "c", "d"])
    x2 = step(s, 2, x1, {"w": f32(2, 3), "n": np.array([3], np.int64), "scaffold/dc/w": f32(0.4, 0.4)},
                     ["a", "b", "c"])
    assert x2["w"].tolist() == [2.0, 2.0]
    assert s.rule.served(x2)["scaffold/c/w"] == pytest.approx([0.5, 0.2])
    assert s.state_arrays()["c/w"] == pytest.approx([0.5, 0.2])


def test_scaffold_update_extras_cover_the_float_tensors():
    layout = Layout.build([("w", "F32", (2, 3)), ("steps", "I64", ()), ("h", "F16", (4,))])
    assert build("scaffold").rule.update_extras(layout) == [("scaffold/dc/h", "F32", (4,)),
                                                       ("scaffold/dc/w", "F32", (2, 3))]


def test_scaffold_refuses_a_mean_without_dc():
    s = build("scaffold")
    with pytest.raises(IntegrityError, match="scaffold/dc/w"):
        step(s, 1, {"w": f32(1)}, {"w": f32(2)}, ["a"])


# state round-trip -------------------------------------------------------------------------

ROUND_TRIP = ["fedavgm", "{name: fedadam, args: {eta: 0.1}}", "fedyogi", "fedadagrad", "scaffold"]


@pytest.mark.parametrize("config", ROUND_TRIP)
def test_restored_strategy_continues_identically(config):
    x0 = {"w": f32(0.5, -1.0, 2.0), "n": np.array([2], np.int64)}
    means = [{"w": f32(1.0, -0.5, 1.0), "n": np.array([3], np.int64), "scaffold/dc/w": f32(0.1, 0.2, -0.3)},
             {"w": f32(0.25, 0.5, 3.0), "n": np.array([4], np.int64), "scaffold/dc/w": f32(-0.2, 0.0, 0.7)}]
    known = ["a", "b", "c"]
    s = build(config)
    s.opened(1, ["a", "b"], known)
    x1 = step(s, 1, x0, means[0], ["a", "b"])
    twin = restored(s, config)

    outs = []
    for strategy in (s, twin):
        strategy.opened(2, ["a"], known)
        outs.append((step(strategy, 2, x1, means[1], ["a"]), strategy.rule.served(x1)))
    (a, served_a), (b, served_b) = outs
    assert {k: v.tobytes() for k, v in a.items()} == {k: v.tobytes() for k, v in b.items()}
    assert {k: v.tobytes() for k, v in served_a.items()} == {k: v.tobytes() for k, v in served_b.items()}


# robust rules -----------------------------------------------------------------------------

def points() -> list[Update]:
    """Five updates whose float state is the point (w, b): a (0,0), b (3,0), c (0,1), d (1,1), e (9,9)."""
    coords = {"a": (0, 0), "b": (3, 0), "c": (0, 1), "d": (1, 1), "e": (9, 9)}
    return [Update(site, 10, {"w": f32(x), "b": f32(y), "n": np.array([i], np.int64)})
            for i, (site, (x, y)) in enumerate(coords.items())]


def test_median_and_trimmed_mean_by_hand():
    updates = points()[::-1]   # order of arrival must not matter
    current = {"w": f32(0), "b": f32(0), "n": np.array([0], np.int64)}

    med = build("median").rule.combine(1, current, updates)
    # w: [0, 3, 0, 1, 9] → 1; b: [0, 0, 1, 1, 9] → 1; n from the first site (a)
    assert med["w"].tolist() == [1.0] and med["b"].tolist() == [1.0] and med["n"].tolist() == [0]

    tm = build("{name: trimmed_mean, args: {beta: 0.2}}").rule.combine(1, current, updates)
    # floor(0.2·5) = 1 per side. w sorted [0, 0, 1, 3, 9] → mean(0, 1, 3); b [0, 0, 1, 1, 9] → mean(0, 1, 1)
    assert tm["w"] == pytest.approx([4 / 3]) and tm["b"] == pytest.approx([2 / 3])
    assert tm["w"].dtype == np.float32 and tm["n"].tolist() == [0]


def test_krum_scores_by_hand_over_all_tensors_together():
    # squared distances (both tensors): a: b9 c1 d2 e162; b: c10 d5 e117; c: d1 e145; d: e128.
    # the n − f − 2 = 2 nearest: a 1+2, b 5+9, c 1+1, d 1+2, e 117+128
    assert krum_scores(points(), ["w", "b"], 1).tolist() == [3, 14, 2, 3, 245]


def test_krum_picks_the_lowest_score_using_every_tensor():
    current = {"w": f32(0), "b": f32(0), "n": np.array([0], np.int64)}
    out = build("krum", "sites: {min: 5}\n").rule.combine(1, current, points()[::-1])
    # c wins (score 2); with w alone a and c would tie and a would win
    assert out["w"].tolist() == [0.0] and out["b"].tolist() == [1.0] and out["n"].tolist() == [2]


def test_krum_ties_go_to_the_lowest_site_name():
    updates = [Update(s, 1, {"w": f32(x)}) for s, x in [("e", 1), ("d", 0), ("c", 0), ("b", 1), ("a", 5)]]
    # scores (2 nearest): d 0+1, c 0+1, e 0+1, b 0+1, a 16+16 → d, c, e, b all 1 → b
    out = build("krum", "sites: {min: 5}\n").rule.combine(1, {}, updates)
    assert out["w"].tolist() == [1.0]


@pytest.mark.parametrize("m, w, b", [(None, 1.0, 0.5), (2, 0.0, 0.5), (3, 1 / 3, 2 / 3)])
def test_multi_krum_means_the_m_best(m, w, b):
    # ranking: c (2), a (3), d (3, after a by name), b (14), e (245); default m = n − f = 4
    args = "" if m is None else f", args: {{m: {m}}}"
    out = build(f"{{name: multi_krum{args}}}", "sites: {min: 5}\n").rule.combine(1, {}, points())
    assert out["w"] == pytest.approx([w]) and out["b"] == pytest.approx([b]) and out["n"].tolist() == [2]


@pytest.mark.parametrize("config", ["median", "{name: trimmed_mean, args: {beta: 0.2}}", "krum", "multi_krum"])
def test_a_planted_outlier_does_not_move_robust_rules(config):
    rng = np.random.default_rng(7)
    honest = [Update(f"h{i}", 10, {"w": (1.0 + 0.01 * rng.standard_normal(3)).astype(np.float32)}) for i in range(6)]
    attacker = Update("x", 1000, {"w": f32(1000, 1000, 1000)})
    updates = honest + [attacker]
    honest_mean = np.mean([u.state["w"] for u in honest], axis=0)
    weighted = sum(u.num_samples * u.state["w"].astype(np.float64) for u in updates) / sum(
        u.num_samples for u in updates)
    assert np.linalg.norm(weighted - honest_mean) > 100

    out = build(config, "sites: {min: 5}\n").rule.combine(1, {"w": f32(0, 0, 0)}, updates)
    assert np.linalg.norm(out["w"] - honest_mean) < 0.05


def test_robust_rules_need_the_updates_in_the_clear():
    for name in ("median", "trimmed_mean", "krum", "multi_krum"):
        s = REGISTRY[name]
        assert issubclass(s, UpdatesRule) and refuses_secure_aggregation(s) and refuses_dp(s)


@pytest.mark.parametrize("name", ["krum", "multi_krum"])
def test_krum_config_needs_n_above_2f_plus_2(name):
    with pytest.raises(ConfigError, match=r"sites.min: .*needs n > 2f\+2, at least 5 .*sites.min is 4"):
        build(name, "sites: {min: 4}\n")
    with pytest.raises(ConfigError, match=r"sites.min: .*at least 7 .*sites.min is 5"):
        build(f"{{name: {name}, args: {{f: 2}}}}", "sites: {min: 5}\n")
    assert build(name, "sites: {min: 5}\n").min_contributors == 5
    assert build(f"{{name: {name}, args: {{f: 0}}}}", "sites: {min: 3}\n").min_contributors == 3


def test_multi_krum_m_must_fit_the_smallest_round():
    with pytest.raises(ConfigError, match=r"strategy.args.m: 5 is out of range.*m in 1\.\.4"):
        build("{name: multi_krum, args: {m: 5}}", "sites: {min: 5}\n")
    with pytest.raises(ConfigError, match="strategy.args.m: 0 is out of range"):
        build("{name: multi_krum, args: {m: 0}}", "sites: {min: 5}\n")
    assert build("{name: multi_krum, args: {m: 4}}", "sites: {min: 5}\n").rule.m == 4


# client sampling --------------------------------------------------------------------------

SITES = [f"s{i:02d}" for i in range(10)]


@pytest.mark.parametrize("fraction, count, minimum, n, k", [
    (None, None, 1, 10, 10), (0.3, None, 1, 10, 3), (0.25, None, 1, 10, 3), (0.3, 2, 1, 10, 2),
    (None, 4, 1, 10, 4), (0.3, None, 4, 10, 4), (0.1, None, 1, 3, 1), (None, None, 5, 3, 3), (0.5, 8, 6, 4, 4),
])
def test_sampling_arithmetic(fraction, count, minimum, n, k):
    chosen = sample_sites(SITES[:n][::-1], fraction=fraction, count=count, minimum=minimum, seed=1, round_=1)
    assert len(chosen) == k and chosen == sorted(chosen) and set(chosen) <= set(SITES[:n])


def test_sampling_is_seeded_and_varies_by_round_and_seed():
    def draw(seed, round_):
        return sample_sites(SITES, fraction=0.3, count=None, minimum=1, seed=seed, round_=round_)

    assert draw(3, 1) == draw(3, 1) == sample_sites(SITES[::-1], fraction=0.3, count=None, minimum=1, seed=3,
                                                    round_=1)
    assert len({tuple(draw(3, r)) for r in range(1, 6)}) > 1
    assert [draw(3, r) for r in range(1, 6)] != [draw(4, r) for r in range(1, 6)]


def test_configure_samples_with_the_job_settings():
    s = build("fedavg", "seed: 9\nsites: {fraction: 0.3}\n")
    assert s.schedule.configure(2, SITES, SITES) == sample_sites(SITES, fraction=0.3, count=None, minimum=1, seed=9,
                                                        round_=2)
    assert build("fedadam").schedule.configure(1, ["b", "a"], ["a", "b", "c"]) == ["a", "b"]


# cwt and swt ------------------------------------------------------------------------------

CWT = "sites: {min: 1}\n"


def run_cwt(s: Strategy, rounds: int, known: list[str], available: list[str] | None = None):
    visits, notes = [], []
    for r in range(1, rounds + 1):
        chosen = s.schedule.configure(r, known if available is None else available, known)
        notes += s.opened(r, chosen, known)
        visits += chosen
    return visits, notes


def test_cwt_cycles_through_the_known_sites_in_order():
    visits, notes = run_cwt(build("cwt"), 6, ["c", "a", "b"])
    assert visits == ["a", "b", "c", "a", "b", "c"] and notes == []


def test_cwt_shuffle_is_seeded_and_differs_per_cycle():
    known = [f"s{i}" for i in range(6)]
    visits, _ = run_cwt(build("{name: cwt, args: {shuffle: true}}", "seed: 5\n"), 18, known)
    cycles = [visits[i:i + 6] for i in range(0, 18, 6)]
    assert all(sorted(c) == known for c in cycles) and len({tuple(c) for c in cycles}) > 1
    again, _ = run_cwt(build("{name: cwt, args: {shuffle: true}}", "seed: 5\n"), 18, known)
    other, _ = run_cwt(build("{name: cwt, args: {shuffle: true}}", "seed: 6\n"), 18, known)
    assert again == visits and other != visits


def test_cwt_skips_missing_sites_with_a_note_and_configure_is_pure():
    s = build("cwt")
    known = ["a", "b", "c"]
    assert s.schedule.configure(1, known, known) == ["a"]
    s.opened(1, ["a"], known)
    meta = s.state_meta()
    assert s.schedule.configure(2, ["a", "c"], known) == ["c"] == s.schedule.configure(2, ["a", "c"], known)
    assert s.state_meta() == meta
    assert s.opened(2, ["c"], known) == ["cwt: skipped b (not online when its turn came)"]
    # the cycle is spent: the next one starts at a; looking ahead runs into it when the rest is offline
    assert s.schedule.configure(3, ["b"], known) == ["b"]
    assert s.schedule.configure(3, [], known) == []
    assert s.opened(3, ["b"], known) == ["cwt: skipped a (not online when its turn came)"]


def test_cwt_looks_ahead_into_the_next_cycle():
    s = build("cwt")
    known = ["a", "b", "c"]
    run_cwt(s, 2, known)                         # a, b visited; c is due
    assert s.schedule.configure(3, ["a"], known) == ["a"]
    assert s.opened(3, ["a"], known) == ["cwt: skipped c (not online when its turn came)"]
    assert s.schedule.configure(4, known, known) == ["b"]


def test_cwt_state_round_trip():
    known = ["a", "b", "c", "d"]
    s = build("{name: cwt, args: {shuffle: true}}")
    run_cwt(s, 3, known)
    twin = restored(s, "{name: cwt, args: {shuffle: true}}")
    assert run_cwt(s, 7, known, ["a", "c", "d"]) == run_cwt(twin, 7, known, ["a", "c", "d"])


def test_cwt_proportional_local_steps():
    s = build("{name: cwt, args: {proportional: true}}", "train: {steps: 10}\n")
    sizes = {"a": 100, "b": 300}
    # mean size 200: a 10·100/200 = 5, b 10·300/200 = 15
    steps = s.schedule.local_steps
    assert (steps("a", sizes), steps("b", sizes), steps("z", sizes)) == (5, 15, 0)
    assert s.schedule.local_steps("a", {"a": 1, "b": 1000}) == 1       # never below one step
    assert build("cwt").schedule.local_steps("a", sizes) == 0


def test_cwt_and_swt_config_checks():
    for name in ("cwt", "swt"):
        with pytest.raises(ConfigError, match=f"sites.min: {name} trains exactly one site per round"):
            build(name, "sites: {min: 2}\n")
        with pytest.raises(ConfigError, match=f"sites.fraction: {name} .* does not sample"):
            build(name, "sites: {fraction: 0.5}\n")
        with pytest.raises(ConfigError, match="sites.count: "):
            build(name, "sites: {count: 1}\n")
        assert refuses_secure_aggregation(REGISTRY[name])
    with pytest.raises(ConfigError, match="strategy.args.proportional: needs train.steps"):
        build("{name: cwt, args: {proportional: true}}")


def test_swt_visits_each_site_once_then_is_done():
    s = build("swt")
    known = ["c", "a", "b"]
    assert s.schedule.configure(1, known, known) == ["a"] and not s.schedule.done(0)
    assert s.opened(1, ["a"], known) == []
    assert not s.schedule.done(1)
    assert s.schedule.configure(2, ["a", "c"], known) == ["c"]
    assert s.opened(2, ["c"], ["a", "b", "c", "d"]) == ["swt: skipped b (not online when its turn came)"]
    assert not s.schedule.done(1)          # round 2, the last visit, has not closed yet
    assert s.schedule.done(2)
    assert s.schedule.configure(3, known + ["d"], known + ["d"]) == []   # the order was fixed at the first round
    twin = restored(s, "swt")
    assert twin.schedule.done(2) and twin.state_meta() == s.state_meta()


# ensemble ---------------------------------------------------------------------------------

ENSEMBLE = "{name: ensemble, args: {members: [h1, h2, h3]%s}}"


def ensemble_model(value: float) -> dict[str, np.ndarray]:
    return {**{f"members.{i}.w": f32(value + i, value + i) for i in range(3)}, "weights": np.zeros(3, np.float32)}


def test_ensemble_copies_each_members_own_tensors_and_weights_by_samples():
    s = build(ENSEMBLE % "")
    assert s.schedule.configure(1, ["h3", "h1", "x"], ["h1", "h2", "h3", "x"]) == ["h1", "h3"]
    current = ensemble_model(0.0)
    updates = [Update("h2", 30, ensemble_model(20.0)), Update("h1", 10, ensemble_model(10.0))]
    out = s.rule.combine(1, current, updates)
    assert out["members.0.w"].tolist() == [10.0, 10.0]     # h1's member 0
    assert out["members.1.w"].tolist() == [21.0, 21.0]     # h2's member 1
    assert out["members.2.w"].tolist() == [2.0, 2.0]       # untouched
    assert out["weights"].tolist() == [0.25, 0.75, 0.0] and out["weights"].dtype == np.float32

    twin = restored(s, ENSEMBLE % "")
    for strategy in (s, twin):
        nxt = strategy.rule.combine(2, out, [Update("h3", 60, ensemble_model(30.0))])
        assert nxt["members.2.w"].tolist() == [32.0, 32.0] and nxt["members.0.w"].tolist() == [10.0, 10.0]
        assert nxt["weights"] == pytest.approx([0.1, 0.3, 0.6])


def test_ensemble_unweighted_and_non_members():
    s = build(ENSEMBLE % ", weighted: false")
    out = s.rule.combine(1, ensemble_model(0.0), [Update("h1", 10, ensemble_model(1.0)),
                                                       Update("h3", 90, ensemble_model(1.0))])
    assert out["weights"] == pytest.approx([0.5, 0.0, 0.5])
    with pytest.raises(IntegrityError, match="'x' is not an ensemble member"):
        s.rule.combine(2, out, [Update("x", 5, ensemble_model(1.0))])


@pytest.mark.parametrize("members, problem", [
    ("[h1]", ": lists 1 site"), ("[h1, h1]", ": lists h1 more than once"),
    ("h1", r": expected a list, got a string \(h1\)"),
    ("[h1, 3]", r"\[1\]: expected a string, got an integer \(3\)"), ("[h1, Bad]", ": 'Bad' is not a site name"),
])
def test_ensemble_members_are_checked(members, problem):
    with pytest.raises(ConfigError, match=f"strategy.args.members{problem}"):
        build(f"{{name: ensemble, args: {{members: {members}}}}}")
    with pytest.raises(ConfigError, match="strategy.args.members: required"):
        build("ensemble")


# config errors ----------------------------------------------------------------------------

def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"strategy.name: unknown strategy 'fedsgd'; known strategies: \['cwt', "):
        build("fedsgd")


def test_unknown_argument_lists_the_accepted_ones():
    with pytest.raises(ConfigError, match="strategy.args.lr: unknown argument .* accepted arguments: "
                                          "beta1, beta2, eta, tau"):
        build("{name: fedadam, args: {lr: 0.1}}")
    with pytest.raises(ConfigError, match="strategy.args.mu: unknown argument for strategy 'fedavg'; remove it"):
        build("{name: fedavg, args: {mu: 0.1}}")


@pytest.mark.parametrize("strategy, key, problem", [
    ("{name: fedadam, args: {eta: -1}}", "eta", "-1.0 is out of range; use a value > 0"),
    ("{name: fedadam, args: {eta: true}}", "eta", r"expected a number, got a boolean \(true\)"),
    ("{name: fedadam, args: {eta: .inf}}", "eta", "inf is not a finite number"),
    ("{name: fedadam, args: {eta: fast}}", "eta", r"expected a number, got a string \(fast\)"),
    ("{name: fedadam, args: {beta1: 1.0}}", "beta1", r"1.0 is out of range; use a value in \[0, 1\)"),
    ("{name: fedprox, args: {mu: 0}}", "mu", "0.0 is out of range; use a value > 0"),
    ("{name: trimmed_mean, args: {beta: 0.5}}", "beta", "0.5 is out of range"),
    ("{name: krum, args: {f: 1.5}}", "f", r"expected an integer, got a number \(1.5\); write a whole number"),
    ("{name: krum, args: {f: -1}}", "f", "-1 is out of range"),
    ("{name: cwt, args: {shuffle: 'yes'}}", "shuffle",
     r"expected a boolean, got a string \(yes\); write true or false"),
])
def test_bad_argument_values_name_the_key(strategy, key, problem):
    with pytest.raises(ConfigError, match=f"strategy.args.{key}: {problem}"):
        build(strategy, "sites: {min: 5}\n" if "krum" in strategy else "")


def test_plain_exponent_numbers_are_read_as_numbers():
    assert build("{name: fedadam, args: {tau: 1e-3}}").rule.tau == 1e-3
    assert build("{name: fedadam, args: {tau: '1e-3'}}").rule.tau == 1e-3   # as free-form args always were


def test_argument_errors_carry_the_file_and_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^<round config>:5: strategy.args.eta: -1.0 is out of range"):
        build("{name: fedadam, args: {eta: -1}}")
    path = tmp_path / "job.yaml"
    path.write_text(BASE + "strategy:\n  name: fedprox\n  args:\n    mu: 0\n")
    from plexus.config import load_round_config

    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:8: strategy.args.mu: 0.0 is out of range"):
        load_round_config(path)
    with pytest.raises(ConfigError, match=r"^<round config>:5: strategy.name: unknown strategy 'fedsgd'"):
        build("fedsgd")


def test_args_built_in_code_are_checked_by_the_same_rules():
    from plexus.config import StrategySpec, strategy_args

    assert strategy_args(StrategySpec("fedprox", {"mu": 3.0})).mu == 3.0
    with pytest.raises(ConfigError, match=r"strategy.args.mu: 0.0 is out of range; use a value > 0"):
        strategy_args(StrategySpec("fedprox", {"mu": 0}))
    with pytest.raises(ConfigError, match="strategy.name: unknown strategy 'nope'"):
        strategy_args(StrategySpec("nope"))


@pytest.mark.parametrize("strategy", ["median", "trimmed_mean", "krum", "multi_krum", "scaffold",
                                      "{name: ensemble, args: {members: [h1, h2]}}"])
def test_dp_is_refused_where_it_loses_its_meaning(strategy):
    with pytest.raises(ConfigError, match="privacy.dp: strategy .* cannot combine with DP-FedAvg because"):
        build(strategy, "sites: {min: 1}\n" if "krum" not in strategy else "sites: {min: 5}\n", DP)


@pytest.mark.parametrize("strategy", ["median", "trimmed_mean", "krum", "multi_krum", "cwt", "swt", "scaffold",
                                      "{name: ensemble, args: {members: [h1, h2]}}"])
def test_secure_aggregation_is_refused_where_it_cannot_compute_the_rule(strategy):
    name = strategy if "ensemble" not in strategy else "ensemble"
    with pytest.raises(ConfigError, match=f"privacy.secure_aggregation: strategy '{name}' cannot combine with "
                                          "secure aggregation, which shows the coordinator only the sum"):
        build(strategy, "sites: {min: 5}\n" if "krum" in strategy else "sites: {min: 3}\n", SECAGG)


def test_sum_based_strategies_accept_secure_aggregation_and_dp():
    for name in ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        assert not refuses_secure_aggregation(type(build(name, "sites: {min: 3}\n", SECAGG).rule))
    for name in ("fedavg", "fedadam", "cwt"):
        assert not refuses_dp(type(build(name, DP).rule))


def test_scaffold_needs_plain_sgd():
    with pytest.raises(ConfigError, match="train.optimizer: scaffold needs plain SGD"):
        build("scaffold", "train: {optimizer: {name: adam}}\n")
    with pytest.raises(ConfigError, match="momentum: 0.9"):
        build("scaffold", "train: {optimizer: {name: sgd, momentum: 0.9}}\n")


def test_ensemble_config_cross_checks():
    with pytest.raises(ConfigError, match="sites.min: is 3 but only the 2 member sites train"):
        build("{name: ensemble, args: {members: [h1, h2]}}", "sites: {min: 3}\n")
    with pytest.raises(ConfigError, match="sites.fraction: ensemble .* does not sample"):
        build("{name: ensemble, args: {members: [h1, h2]}}", "sites: {fraction: 0.5}\n")


def test_registry_names():
    assert sorted(REGISTRY) == sorted(STRATEGY_ARGS)   # the config schema and the rules name the same strategies
    assert sorted(REGISTRY) == sorted(["fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "scaffold",
                                       "median", "trimmed_mean", "krum", "multi_krum", "cwt", "swt", "ensemble",
                                       "lbfgs", "newton"])
    assert all(REGISTRY[name].name == name for name in REGISTRY)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "examples").glob("heart-*.yaml")),
                         ids=lambda p: p.name)
def test_example_round_configs_are_valid(path):
    from plexus.config import load_round_config

    cfg = load_round_config(path)
    assert make_strategy(cfg).name == cfg.strategy.name


@pytest.mark.parametrize("strategy", ["fedprox", "scaffold", "{name: ensemble, args: {members: [h1, h2]}}"])
def test_dp_sgd_is_refused_where_the_site_trains_differently(strategy):
    dp_sgd = "privacy: {dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0}}\n"
    with pytest.raises(ConfigError, match=r"privacy.dp_sgd: strategy '\w+' .* which Opacus's DP-SGD training loop"):
        build(strategy, dp_sgd)
    assert build("fedadam", dp_sgd).name == "fedadam"


# what the engine reads from a rule ----------------------------------------------------------

# name: (every update at once, the current model kept until the next is built, uniform weights, the mean is
#        the model, secure aggregation can compute it, DP-FedAvg keeps its meaning), as the engine relied on them
ENGINE_VIEW = {
    "fedavg": (False, False, False, True, True, True), "fedprox": (False, False, False, True, True, True),
    **{name: (False, True, False, False, True, True) for name in ("fedavgm", "fedadam", "fedyogi", "fedadagrad")},
    "scaffold": (False, True, True, False, False, False),
    **{name: (True, True, False, False, False, False) for name in ("median", "trimmed_mean", "krum", "multi_krum")},
    "cwt": (False, False, False, True, False, True), "swt": (False, False, False, True, False, True),
    "ensemble": (True, True, False, False, False, False),
    "lbfgs": (False, True, True, False, True, True), "newton": (False, True, True, False, True, False),
}


@pytest.mark.parametrize("name", sorted(ENGINE_VIEW))
def test_the_rule_type_and_its_few_attributes_say_what_the_engine_needs(name):
    args = {"ensemble": "{name: ensemble, args: {members: [h1, h2]}}"}.get(name, name)
    rule = build(args, "sites: {min: 5}\n" if "krum" in name else "").rule
    every = isinstance(rule, UpdatesRule)
    view = (every, every or rule.reads_current,
            not every and rule.weighting == "uniform", keeps_mean(rule),
            not refuses_secure_aggregation(type(rule)), not refuses_dp(type(rule)))
    assert view == ENGINE_VIEW[name]


def test_the_strategies_that_take_compressed_updates_are_the_mean_rules_with_nothing_beside_the_model():
    """A compressed update is a Δ of the model's tensors folded into a weighted mean (plexus.config's list, which
    the config checks read, must name exactly those rules)."""
    plain_mean = {name for name, cls in REGISTRY.items()
                  if issubclass(cls, MeanRule) and cls.update_extras is MeanRule.update_extras}
    assert set(COMPRESSIBLE_STRATEGIES) == plain_mean


def test_asynchronous_strategies_send_nothing_beside_the_model():
    """An asynchronous secure cohort masks the model's Δ only (site_agent's _keep): a rule with update extras must
    stay out of plexus.config's ASYNC_STRATEGIES, which the config checks read."""
    assert all(REGISTRY[name].update_extras is MeanRule.update_extras for name in ASYNC_STRATEGIES)


def test_the_summing_strategies_are_the_uniform_rules_secure_aggregation_computes():
    """A site reads SUMMING_STRATEGIES to advertise weight 1 in a secure round; the coordinator reads the rule's
    weighting, and refuses any other advert: both must name the same rules."""
    secure_means = {name: cls for name, cls in REGISTRY.items()
                    if issubclass(cls, MeanRule) and not refuses_secure_aggregation(cls)}
    assert {name for name, cls in secure_means.items() if cls.weighting == "uniform"} == \
        SUMMING_STRATEGIES & set(secure_means)
