"""A site's half of a statistics job: its update is its sums over the raw table (nothing trained or evaluated); a
table whose columns differ, or a cell under policy.min_cell_count, declines the job naming them; under secure
aggregation it advertises weight 1 and refuses sums that clip would cut.

The coordinator is a recording stand-in for the stub; the real gRPC path runs in tests/integration."""

from __future__ import annotations

import time

import numpy as np
import pytest

from plexus import statistics as stats
from plexus.config import DatasetSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import Layout, decode
from site_agent.agent import SiteAgent, check_sums_fit

from fake_coordinator import FakeCoordinator

CSV = """\
age,sex,ward,note
34,F,a,x
51,M,a,
47,,b,y
,M,b,y
62,F,a,
58,M,b,
"""

JOB = """\
name: ward-stats
kind: statistics
data: {dataset: wards}
statistics:
  columns:
    - {name: age, range: [0, 100], bins: 4}
    - {name: sex, categories: [F, M]}
  group_by: {column: ward, categories: [a, b]}
  min_max: MIN_MAX
sites: {min: 3}
privacy: {secure_aggregation: SECURE, secagg: {clip: CLIP}}
"""


def _job(*, secure=False, clip=1024, min_max=None):
    text = (JOB.replace("SECURE", str(secure).lower()).replace("CLIP", str(clip))
            .replace("MIN_MAX", str(not secure if min_max is None else min_max).lower()))
    return text, parse_round_config(text)


def _agent(kit, tmp_path, csv: str = CSV, **policy) -> SiteAgent:
    path = tmp_path / "wards.csv"
    path.write_text(csv)
    # A CSV dataset names its label column for training jobs; a statistics job never reads it.
    return SiteAgent(SiteConfig(
        site="a", coordinator="127.0.0.1:1", kit=kit, state_dir=tmp_path / "state",
        datasets={"wards": DatasetSpec(kind="csv", path=path, label="ward")},
        policy=PolicySpec(**{"allowed_models": ("statistics",), **policy})))


def _task(text: str, kind=fpb.TASK_TRAIN) -> fpb.Task:
    return fpb.Task(kind=kind, task_id="t1", job_id="ward-stats-1", round=1, config_yaml=text, nonce=b"n" * 16,
                    deadline_unix_s=time.time() + 600, seed=7)


def _sent(stub: FakeCoordinator) -> tuple[fpb.UpdateHeader, dict[str, np.ndarray]]:
    (messages,) = stub.updates
    header = messages[0].header
    blob = b"".join(m.chunk.data for m in messages[1:])
    return header, decode(Layout.from_proto(header.manifest), blob)


def _expected(job, csv: str, tmp_path) -> dict[str, np.ndarray]:
    path = tmp_path / "expected.csv"
    path.write_text(csv)
    return stats.site_sums(job.statistics, stats.read_table(DatasetSpec(kind="csv", path=path, label="ward")))


def test_the_update_is_the_sites_sums_and_counts_once(kit, tmp_path):
    text, job = _job()
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path).handle(stub, _task(text))
    header, update = _sent(stub)
    assert stub.results == []
    expected = _expected(job, CSV, tmp_path)
    assert update.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(update[name], value, err_msg=name)
    assert update["stats/rows"].tolist() == [6, 3, 3]
    # Sums are added, never weighed: one site counts once; and nothing evaluated the sums.
    assert header.num_samples == 1 and dict(header.eval_metrics) == {} and dict(header.metrics) == {}


def test_an_evaluation_task_of_a_statistics_job_reports_no_metrics(kit, tmp_path):
    text, job = _job()
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path).handle(stub, _task(text, fpb.TASK_EVALUATE))
    assert [(r.status, dict(r.eval_metrics)) for r in stub.results] == [(fpb.RESULT_EVALUATED, {})]


@pytest.mark.parametrize("csv, says", [
    (CSV.replace("age,", "years,"), "missing column(s) 'age'"),
    (CSV.replace("34,F", "34,X"), "column 'sex': 1 cell(s) hold values not among its declared categories"),
    (CSV.replace("51,M", "fifty,M"), "column 'age': 1 cell(s) are not numbers (data rows 2)"),
    (CSV.replace(",a,", ",c,", 1), "column 'ward': 1 cell(s) hold values not among its declared group_by.categories"),
])
def test_a_table_whose_columns_differ_declines_naming_the_difference(kit, tmp_path, csv, says):
    text, job = _job()
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path, csv).handle(stub, _task(text))
    assert stub.updates == []
    (result,) = stub.results
    assert result.status == fpb.RESULT_DECLINED
    assert result.reason.startswith("dataset 'wards' does not match the job's statistics columns: "), result.reason
    assert says in result.reason
    assert str(tmp_path) not in result.reason   # the site's paths stay at the site


def test_cells_under_min_cell_count_decline_naming_the_cells(kit, tmp_path):
    text, job = _job(min_max=False)
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path, min_cell_count=2).handle(stub, _task(text))
    assert stub.updates == []
    (result,) = stub.results
    assert result.status == fpb.RESULT_DECLINED
    assert "fewer than this site's min_cell_count 2" in result.reason
    # ward b holds one row aged 47 and one with no sex: those cells count 1; empty cells are fine.
    assert "b / age / histogram [25, 50)" in result.reason and "b / sex / missing" in result.reason
    assert "histogram [0, 25)" not in result.reason
    # With every cell at 1 row allowed, the same site sends its sums.
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path, min_cell_count=1).handle(stub, _task(text))
    assert len(stub.updates) == 1 and stub.results == []


def test_a_site_without_statistics_in_its_allowed_models_declines(kit, tmp_path):
    text, job = _job()
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path, allowed_models=("logistic",)).handle(stub, _task(text))
    (result,) = stub.results
    assert result.status == fpb.RESULT_DECLINED
    assert "model 'statistics' is not in this site's policy.allowed_models ['logistic']" in result.reason


def test_under_secure_aggregation_the_site_advertises_weight_one(kit, tmp_path):
    text, job = _job(secure=True)
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path).handle(stub, _task(text, fpb.TASK_SECAGG_ADVERTISE))
    assert stub.results == [] and [m.advert.num_samples for m in stub.secagg] == [1]


def _secure_failure(kit, tmp_path, clip: float, csv: str = CSV) -> str:
    text, job = _job(secure=True, clip=clip)
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path, csv).handle(stub, _task(text, fpb.TASK_SECAGG_ADVERTISE))
    assert stub.secagg == []
    (result,) = stub.results
    assert result.status == fpb.RESULT_FAILED
    return result.reason


def test_under_secure_aggregation_sums_beyond_clip_fail_the_task_with_the_clip_they_need(kit, tmp_path):
    # Ages inside their range [0, 100] make every sum at most the site's 6 rows: the rows count is the largest,
    # and the site names only the power of two above it.
    reason = _secure_failure(kit, tmp_path, clip=4)
    assert "reach up to 8 in magnitude, beyond privacy.secagg.clip = 4" in reason, reason
    assert reason.endswith("set privacy.secagg.clip to at least 8")
    text, job = _job(secure=True, clip=6)
    stub = FakeCoordinator(job)
    _agent(kit, tmp_path).handle(stub, _task(text, fpb.TASK_SECAGG_ADVERTISE))
    assert stub.results == [] and len(stub.secagg) == 1


def test_a_value_far_outside_its_range_is_summed_as_it_is_and_can_exceed_the_rows_clip(kit, tmp_path):
    # Age 1000 in range [0, 100] is u = (1000 − 50)/50 = 19, and Σu² ≈ 361: beyond a clip of the site's rows.
    reason = _secure_failure(kit, tmp_path, clip=6, csv=CSV.replace("62,F", "1000,F"))
    assert "reach up to 512 in magnitude, beyond privacy.secagg.clip = 6" in reason, reason


def test_check_sums_fit():
    check_sums_fit([np.array([3.0, -4.0]), np.zeros(0)], 4.0)
    with pytest.raises(ValueError, match="reach up to 8 in magnitude, beyond privacy.secagg.clip = 4, .* set "
                                         "privacy.secagg.clip to at least 8$"):
        check_sums_fit([np.array([3.0, -4.5])], 4.0)
    with pytest.raises(ValueError, match="exceed the largest clip, 1048576, so secure aggregation cannot sum them"):
        check_sums_fit([np.array([3e6])], 2.0 ** 20)


def test_max_epsilon_and_min_dp_noise_read_a_statistics_jobs_own_dp():
    from site_agent.policy import refusal

    def job(dp: str = ""):
        text = JOB.replace("SECURE", "false").replace("CLIP", "4").replace("MIN_MAX", "false")
        return parse_round_config(text.replace("  min_max: false\n", f"  min_max: false\n  dp: {dp}\n" if dp else
                                               "  min_max: false\n"))

    installed = {"statistics"}
    capped = PolicySpec(allowed_models=("statistics",), max_epsilon=8.0)
    assert refusal(capped, job(), installed) == ("this site's policy caps ε at 8.0, and the statistics job has no "
                                                 "statistics.dp (its ε is unbounded)")
    queries = len(stats.dp_ledger(job("{mechanism: laplace, epsilon: 0.5}").statistics).queries)
    assert queries == 8 and refusal(capped, job("{mechanism: laplace, epsilon: 1.0}"), installed) is None
    assert refusal(capped, job("{mechanism: laplace, epsilon: 1.5}"), installed) == (
        "the statistics job's ε is 12 over its 8 queries (1.5 each, added up), above this site's policy.max_epsilon "
        "8.0; set statistics.dp.epsilon to at most 1, or describe fewer columns")
    noisy = PolicySpec(allowed_models=("statistics",), min_dp_noise=1.5)
    # Laplace at ε 0.5 per query: scale / sensitivity = 1 / ε = 2.
    assert refusal(noisy, job("{mechanism: laplace, epsilon: 0.5}"), installed) is None
    assert "below this site's policy.min_dp_noise 1.5" in refusal(noisy, job("{mechanism: laplace, epsilon: 1.0}"),
                                                                  installed)
    assert refusal(noisy, job(), installed).endswith("adds no differential-privacy noise (set statistics.dp)")
