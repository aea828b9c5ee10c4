"""The `statistics` strategy: in the clear plexus.statistics.combine_clear over every site's sums, under secure
aggregation the uniform mean times the number of sites; statistics.dp noise from the rule's generator with its ledger
recorded by the driver; and a statistics job ends after its one round, with nothing evaluated."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from driver_rig import DriverRig, rigs
from statistics_jobs import statistics_job_text

from coordinator.drivers.sync import SyncRounds
from coordinator.strategies import (
    REGISTRY,
    ClearStatistics,
    MeanRule,
    Statistics,
    Update,
    UpdatesRule,
    make_strategy,
    refuses_dp,
    refuses_secure_aggregation,
)
from coordinator.tasks import Binding, UpdateHeader
from plexus import statistics as stats
from plexus.config import parse_round_config
from plexus.errors import ConfigError
from plexus.vocab import JobStatus, TaskKind
from plexus.wire import encode


def _job(*, secure=False, min_max=False, dp=""):
    return parse_round_config(statistics_job_text(secure=secure, min_max=min_max, dp=dp))


def _table(ages, sexes):
    return {"age": np.array(ages, dtype=str), "sex": np.array(sexes, dtype=str)}


SITE_A = _table(["34", "51", ""], ["F", "M", "M"])
SITE_B = _table(["47", "62"], ["F", ""])


def _sums(job, table):
    return stats.site_sums(job.statistics, table)


def test_the_clear_rule_combines_every_sites_sums_and_the_secure_rule_multiplies_the_mean_back():
    clear = _job(min_max=True)
    rule = make_strategy(clear).rule
    assert isinstance(rule, ClearStatistics) and isinstance(rule, UpdatesRule)
    a, b = _sums(clear, SITE_A), _sums(clear, SITE_B)
    pooled = rule.combine(1, {}, [Update("a", 1, a), Update("b", 1, b)])
    expected = stats.combine_clear(clear.statistics, [a, b])
    assert pooled.keys() == expected.keys() and all(np.array_equal(pooled[k], expected[k]) for k in expected)
    assert pooled["min/c0"].tolist() == [34.0] and pooled["max/c0"].tolist() == [62.0]
    assert rule.ledger() == {}

    secure = _job(secure=True)
    rule = make_strategy(secure).rule
    assert isinstance(rule, Statistics) and isinstance(rule, MeanRule) and rule.weighting == "uniform"
    a, b = _sums(secure, SITE_A), _sums(secure, SITE_B)
    mean = {k: (a[k] + b[k]) / 2 for k in a}
    out = rule.step(1, None, mean, ["a", "b"], population=2)
    assert all(np.array_equal(out[k], a[k] + b[k]) for k in a)
    assert out["stats/rows"].tolist() == [5.0]


def test_the_registry_entry_computes_under_secure_aggregation_and_refuses_dp_fedavg():
    assert REGISTRY["statistics"] is Statistics
    assert refuses_secure_aggregation(Statistics) == ""
    assert "set statistics.dp, not privacy.dp" in refuses_dp(Statistics)
    training = parse_round_config("name: j\nmodel: {name: mlp}\ndata: {dataset: d}\nrounds: 1\n")
    with pytest.raises(ConfigError, match="statistics is the strategy of `kind: statistics` jobs"):
        Statistics.from_config(None, dataclasses.replace(training, strategy=_job().strategy))


def test_dp_noise_comes_from_the_rules_generator_and_its_ledger_says_what_was_spent():
    job = _job(dp="{mechanism: laplace, epsilon: 0.5}")
    a, b = _sums(job, SITE_A), _sums(job, SITE_B)
    rule = ClearStatistics(job.statistics, rng=np.random.default_rng(7))
    noisy = rule.combine(1, {}, [Update("a", 1, a), Update("b", 1, b)])
    expected, ledger = stats.add_dp_noise(job.statistics, stats.combine_clear(job.statistics, [a, b]),
                                          np.random.default_rng(7))
    assert all(np.array_equal(noisy[k], expected[k]) for k in expected)
    assert not np.array_equal(noisy["stats/rows"], a["stats/rows"] + b["stats/rows"])
    assert rule.ledger() == {"epsilon": ledger.epsilon, "delta": 0.0, "queries": float(len(ledger.queries)),
                             "epsilon_per_query": 0.5}
    # Under secure aggregation the same noise goes on the sum the mean gives back.
    secure = _job(secure=True, dp="{mechanism: laplace, epsilon: 0.5}")
    rule = Statistics(secure.statistics, rng=np.random.default_rng(7))
    out = rule.step(1, None, {k: (a[k] + b[k]) / 2 for k in a}, ["a", "b"], population=2)
    assert all(np.allclose(out[k], expected[k], rtol=0, atol=1e-9) for k in expected)
    assert rule.ledger()["epsilon"] == ledger.epsilon
    # Without an injected generator, the noise is fresh OS randomness: never the same twice.
    first, second = (ClearStatistics(job.statistics).combine(1, {}, [Update("a", 1, a)]) for _ in range(2))
    assert not np.array_equal(first["stats/c0/sum"], second["stats/c0/sum"])


class Rig(DriverRig):
    driver_class = SyncRounds

    def __init__(self, path, *, job):
        self.job = job
        zeros = {name: np.zeros(shape) for name, _, shape in stats.layout(job.statistics)}
        text = statistics_job_text(dp="{mechanism: laplace, epsilon: 0.5}")
        super().__init__(path, text, model=zeros)

    def send_sums(self, site: str, grant, sums: dict) -> str:
        layout, blob = encode(sums)
        header = UpdateHeader(task=Binding(grant.task_id, grant.job_id, grant.round, grant.nonce), num_samples=1,
                              layout=layout)
        return self.stream(site, grant, header, blob)


@pytest.fixture
def rig(tmp_path):
    yield from rigs(tmp_path, Rig)


def test_a_statistics_job_records_its_privacy_ledger_and_ends_after_its_round_without_an_evaluation(rig):
    job = _job(dp="{mechanism: laplace, epsilon: 0.5}")
    r = rig(job=job)
    r.join("a", "b", "c")
    r.driver.tick(r.now)
    grants = {s: r.driver.grant(s) for s in ("a", "b", "c")}
    assert {g.kind for g in grants.values()} == {TaskKind.TRAIN}
    for site, table in (("a", SITE_A), ("b", SITE_B), ("c", SITE_B)):
        assert "accepted" in r.send_sums(site, grants[site], _sums(job, table))
    r.driver.tick(r.now)
    assert r.store.job(r.job_id).current_round == 1
    ledger = stats.dp_ledger(job.statistics)
    privacy = {m.name: m.value for m in r.store.metrics(r.job_id) if m.kind == "privacy" and m.round == 1}
    assert privacy == {"epsilon": ledger.epsilon, "delta": 0.0, "queries": float(len(ledger.queries)),
                       "epsilon_per_query": 0.5}
    spent = [e for e in r.store.events_after(r.job_id, 0) if e.kind == "privacy_spent"]
    assert len(spent) == 1 and f"epsilon {ledger.epsilon:g}" in spent[0].message

    r.driver.tick(r.now)   # the next look ends the job: no round of evaluation of the sums
    row = r.store.job(r.job_id)
    assert row.status == JobStatus.COMPLETED and "pooled the sites' sums" in row.message
    assert [x.round for x in r.store.rounds(r.job_id)] == [1] and r.driver.ended
