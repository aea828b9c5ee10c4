"""The virtual clock: a slow site misses its deadline, a dropout is drawn from the seed, an asynchronous job's
updates arrive in the order the profile makes, and the same profile and seed give the same run twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.store import Store
from plexus.config import DatasetSpec, PolicySpec, SiteConfig
from plexus.datasets import HOSPITALS
from plexus.errors import ConfigError
from simulation.pool import ProcessPool
from simulation.profile import load_profile
from simulation.simulator import Simulator

DEADLINE_S = 5
COMMON = f"""\
model: {{name: logistic, args: {{in_features: 13, num_classes: 2}}}}
data: {{dataset: heart-disease}}
sites: {{min: 2, deadline_s: {DEADLINE_S}}}
train: {{epochs: 1, batch_size: 16, optimizer: {{name: sgd, lr: 0.05}}}}
seed: 3
"""
SYNC = "name: clock-sync\nrounds: 3\n" + COMMON
ASYNC = "name: clock-async\nrounds: 6\nasynchronous: {buffer: 2, max_staleness: 20}\n" + COMMON
# va needs 1,000× the reference time per row: ~20 simulated seconds for its rows, past the 5 s deadline;
# switzerland ~0.3 s for its 30 rows, hungary 12 ms for its 121 (and drops half its tasks), cleveland 1 ms.
PROFILE = """\
sites:
  cleveland: {speed: 20}
  switzerland: {speed: 0.01}
  va: {speed: 0.001}
  hungary: {dropout: 0.5}
"""


def simulate(root: Path) -> tuple[list, dict, object]:
    (root / "profile.yaml").parent.mkdir(parents=True, exist_ok=True)
    (root / "profile.yaml").write_text(PROFILE)
    sites = {h: SiteConfig(site=h, coordinator="unused.invalid:1", kit=Path("unused"),
                           datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=h)},
                           policy=PolicySpec(allowed_models=("logistic",))) for h in HOSPITALS}
    outcome = Simulator([SYNC, ASYNC], sites, root / "state", workers=2, pool=ProcessPool,
                        profile=load_profile(root / "profile.yaml", sorted(sites))).run()
    store = Store(root / "state" / "coordinator")
    try:
        events = [(job_id, e.at, e.kind, e.round, e.site) for job_id, _, _ in outcome.jobs
                  for e in store.events_after(job_id, 0)]
        models = {job_id: {k: v.tobytes() for k, v in store.load_checkpoint(job_id, rounds).items()}
                  for job_id, _, rounds in outcome.jobs}
    finally:
        store.close()
    start = events[0][1]
    return [(job[:-9], round(at - start, 6), kind, round_, site) for job, at, kind, round_, site in events], \
        models, outcome


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return [simulate(tmp_path_factory.mktemp(f"run-{i}")) for i in range(2)]


def test_the_same_profile_and_seed_run_the_same_twice(runs):
    (events_1, models_1, outcome_1), (events_2, models_2, outcome_2) = runs
    # The same events at the same virtual times (a synchronous round takes its on-time answers as they come, so
    # rows of one round may be stored in another order; their times are the answers' own).
    assert sorted(events_1) == sorted(events_2)
    assert list(models_1.values()) == list(models_2.values())
    assert outcome_1.dropped == outcome_2.dropped > 0
    assert outcome_1.simulated_s == outcome_2.simulated_s


def test_a_site_slower_than_the_deadline_never_counts_and_each_round_waits_for_it(runs):
    events, _, outcome = runs[0]
    sync = [e for e in events if e[0] == "clock-sync"]
    assert not [e for e in sync if e[2] == "site_submitted" and e[4] == "va"]
    assert {e[4] for e in sync if e[2] == "site_submitted"} == {"cleveland", "hungary", "switzerland"}
    closes = [at for _, at, kind, _, _ in sync if kind == "round_closed"]
    assert closes == pytest.approx([DEADLINE_S, 2 * DEADLINE_S, 3 * DEADLINE_S], abs=0.01)   # va holds each open
    assert outcome.simulated_s > 3 * DEADLINE_S


def test_a_dropped_site_answers_nothing_in_that_round_and_is_back_later(runs):
    events, _, _ = runs[0]
    sync = [e for e in events if e[0] == "clock-sync" and e[2] == "site_submitted"]
    rounds_of = {site: {r for _, _, _, r, s in sync if s == site} for site in ("cleveland", "hungary")}
    assert rounds_of["cleveland"] == {1, 2, 3}
    assert rounds_of["hungary"] and rounds_of["hungary"] != {1, 2, 3}   # dropout 0.5, drawn from the seed


def test_asynchronous_updates_arrive_in_the_order_of_the_sites_speeds(runs):
    events, _, _ = runs[0]
    buffered = [e[4] for e in events if e[0] == "clock-async" and e[2] == "site_buffered"]
    assert "va" not in buffered                                 # never within its deadline
    assert buffered[0] == "cleveland"
    assert buffered.count("cleveland") > buffered.count("switzerland") > 0
    first = next(at for job, at, kind, _, site in events if job == "clock-async" and kind == "site_buffered")
    started = next(at for job, at, kind, _, _ in events if job == "clock-async" and kind == "job_started")
    assert 0 < first - started < 1   # cleveland's 20× speed: a few hundredths of a second for its rows


def test_a_profile_names_only_the_simulations_sites_and_known_keys(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("sites: {nowhere: {speed: 2}}\n")
    with pytest.raises(ConfigError, match="nowhere.*not sites of this simulation"):
        load_profile(path, ["a", "b"])
    path.write_text("sites: {a: {sped: 2}}\n")
    with pytest.raises(ConfigError, match="unknown keys \\['sped'\\]"):
        load_profile(path, ["a"])
    path.write_text("default: {dropout: 1.5}\n")
    with pytest.raises(ConfigError, match="dropout"):
        load_profile(path, ["a"])
    path.write_text("default: {up_mbps: 8}\nsites: {a: {latency_ms: 0}}\n")
    profile = load_profile(path, ["a", "b"])
    assert profile.transfer_s("a", 10 ** 6, up=True) == pytest.approx(1.0)           # 8 Mbit at 8 Mbit/s
    assert profile.transfer_s("b", 10 ** 6, up=True) == pytest.approx(1.02)          # and 20 ms latency
