"""The dashboard's JSON views of hand-built Admin replies: what each page is given to show."""

from __future__ import annotations

import json
import math

from plexus.dashboard import views
from plexus.proto.plexus.v1 import admin_pb2 as apb

DP_JOB = """\
name: heart-dp
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 3
sites: {min: 2}
privacy: {dp: {mode: central, noise_multiplier: 1.1, clip_norm: 1.0, target_epsilon: 8}}
"""

ASYNC_JOB = """\
name: heart-async
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 4
sites: {min: 2}
asynchronous: {buffer: 2}
"""


def _metric(round_, site, kind, name, value):
    return apb.MetricRow(round=round_, site=site, kind=kind, name=name, value=value)


def _detail(config=DP_JOB, **summary) -> apb.JobDetail:
    s = {"job_id": "j1", "name": "heart-dp", "status": "running", "rounds": 3, "current_round": 2,
         "submitted_by": "ops", "created_unix_s": 100.0, "updated_unix_s": 130.0, "strategy": "fedavg", **summary}
    return apb.JobDetail(
        summary=apb.JobSummary(**s), config_yaml=config,
        rounds=[apb.RoundInfo(round=1, status="closed", opened_unix_s=101.0, closed_unix_s=104.5,
                              contributors=["a", "b"], total_samples=300),
                apb.RoundInfo(round=2, status="closed", opened_unix_s=105.0, closed_unix_s=107.0,
                              contributors=["a", "b"], total_samples=300),
                apb.RoundInfo(round=3, status="open", opened_unix_s=108.0)],
        site_events=[apb.SiteStatus(site="a", status="submitted", round=1),
                     apb.SiteStatus(site="c", status="declined", round=1,
                                    reason="model 'logistic' is not in this site's policy.allowed_models ['mlp']"),
                     apb.SiteStatus(site="b", status="submitted", round=1),
                     apb.SiteStatus(site="a", status="late", round=2, reason="by the round deadline (30 s)")],
        metrics=[_metric(0, "a", "eval", "accuracy", 0.5), _metric(0, "a", "eval", "num_samples", 100),
                 _metric(0, "b", "eval", "accuracy", 0.8), _metric(0, "b", "eval", "num_samples", 300),
                 _metric(1, "a", "eval", "accuracy", 0.7), _metric(1, "a", "eval", "num_samples", 100),
                 _metric(1, "a", "train", "train_loss", 0.6), _metric(1, "b", "train", "train_loss", float("nan")),
                 _metric(1, "", "privacy", "epsilon", 1.25), _metric(2, "", "privacy", "epsilon", 2.5)])


def test_a_jobs_line_reads_mode_and_privacy_from_its_config():
    out = views.job_summary(_detail())
    assert out == {"job_id": "j1", "name": "heart-dp", "status": "running", "strategy": "fedavg", "mode": "sync",
                   "privacy": {"dp": "dp-fedavg central σ=1.1 clip 1", "epsilon_target": 8.0, "epsilon_spent": 2.5,
                               "secure_aggregation": False},
                   "round": 2, "rounds": 3, "total_rounds": 3, "submitted_by": "ops", "created": 100.0,
                   "updated": 130.0, "message": "", "terminal": False}


def test_mode_is_async_for_an_asynchronous_job_and_unknown_for_a_config_this_version_cannot_read():
    assert views.job_summary(_detail(ASYNC_JOB))["mode"] == "async"
    unreadable = views.job_summary(_detail("name: x\nfrom_the_future: true\n"))
    assert unreadable["mode"] == "unknown"
    assert unreadable["privacy"] == {"dp": None, "epsilon_target": None, "epsilon_spent": 2.5,
                                     "secure_aggregation": False}


def test_terminal_follows_the_status():
    for status in ("completed", "budget_reached", "failed", "aborted"):
        assert views.job_summary(_detail(status=status))["terminal"]
    for status in ("queued", "running"):
        assert not views.job_summary(_detail(status=status))["terminal"]


def test_rounds_carry_each_sites_outcome_and_reason_declines_included():
    detail = views.job_detail(_detail())
    rounds = detail["rounds"]
    assert detail["round"] == 2 and detail["total_rounds"] == 3   # `rounds` is the list here
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[0] == {"round": 1, "status": "closed", "opened": 101.0, "closed": 104.5, "contributors": ["a", "b"],
                         "total_samples": 300, "message": "",
                         "sites": [{"site": "a", "status": "submitted", "reason": ""},
                                   {"site": "c", "status": "declined",
                                    "reason": "model 'logistic' is not in this site's policy.allowed_models ['mlp']"},
                                   {"site": "b", "status": "submitted", "reason": ""}]}
    assert rounds[1]["sites"] == [{"site": "a", "status": "late", "reason": "by the round deadline (30 s)"}]
    assert rounds[2]["closed"] is None and rounds[2]["sites"] == []


def test_a_round_only_a_site_event_names_is_shown_too():
    detail = _detail()
    detail.site_events.append(apb.SiteStatus(site="b", status="buffered", round=7))
    last = views.job_detail(detail)["rounds"][-1]
    assert last["round"] == 7 and last["status"] == "" and last["sites"] == [
        {"site": "b", "status": "buffered", "reason": ""}]


def test_curves_hold_the_weighted_global_mean_and_each_site_without_num_samples():
    curves = views.job_detail(_detail())["curves"]
    assert set(curves) == {"eval", "train"} and set(curves["eval"]) == {"accuracy"}
    accuracy = curves["eval"]["accuracy"]
    assert accuracy["global"] == [[0, (0.5 * 100 + 0.8 * 300) / 400], [1, 0.7]]
    assert accuracy["sites"] == {"a": [[0, 0.5], [1, 0.7]], "b": [[0, 0.8]]}
    # a NaN (a site whose loss diverged) is a gap, never a NaN JSON cannot carry
    assert curves["train"]["train_loss"]["sites"] == {"a": [[1, 0.6]], "b": [[1, None]]}
    assert curves["train"]["train_loss"]["global"] == [[1, None]]


def test_epsilon_is_the_ledger_per_round_with_its_target():
    out = views.job_detail(_detail())
    assert out["epsilon"] == [[1, 1.25], [2, 2.5]] and out["epsilon_target"] == 8.0


def test_a_job_without_metrics_has_no_curves_and_a_synchronous_job_no_async_view():
    detail = _detail()
    del detail.metrics[:]
    out = views.job_detail(detail)
    assert out["curves"] == {} and out["epsilon"] == [] and out["async"] is None
    assert out["config_yaml"] == DP_JOB


def test_an_asynchronous_job_carries_its_versions_view():
    detail = _detail(ASYNC_JOB, rounds=4, current_round=1)
    detail.metrics.extend([_metric(1, "", "async", "updates", 2), _metric(1, "", "async", "staleness_0", 2),
                           _metric(1, "a", "async", "contributions", 1), _metric(1, "b", "async", "contributions", 1)])
    view = views.job_detail(detail)["async"]
    assert view["mode"]["buffer"] == 2 and view["version"] == 1 and view["versions"] == 4
    assert view["sites"] == [{"site": "a", "contributions": 1, "refused_stale": 0},
                             {"site": "b", "contributions": 1, "refused_stale": 0}]
    assert view["staleness"] == [{"staleness": 0, "updates": 2}]


def test_every_view_is_strict_json():
    detail = _detail(created_unix_s=math.inf)
    json.dumps(views.job_detail(detail), allow_nan=False)
    assert views.job_summary(detail)["created"] is None


def test_a_site_row_has_its_rows_per_dataset_and_whether_it_is_revoked():
    info = apb.SiteInfo(site="a", last_seen_unix_s=200.0, online=True, policy_digest="ab" * 32, models=["logistic"],
                        datasets=["heart-disease"], agent_version="0.1.0", dataset_rows={"heart-disease": 199},
                        revoked=True)
    assert views.site(info) == {"site": "a", "online": True, "last_seen": 200.0, "datasets": ["heart-disease"],
                                "dataset_rows": {"heart-disease": 199}, "revoked": True, "version": "0.1.0",
                                "policy_digest": "ab" * 32, "models": ["logistic"]}
    assert views.site(apb.SiteInfo(site="never"))["last_seen"] is None


def test_the_audit_view_says_whether_the_chain_verified_and_lists_the_entries():
    reply = apb.AuditReply(verified=False, problem="entry 3: hash mismatch", count=9, entries=[
        apb.AuditEntry(seq=8, at=10.0, actor="admin:ops", action="job_submitted", subject="job:j1",
                       details_json='{"x": 1}', hash="h")])
    assert views.audit(reply) == {"verified": False, "problem": "entry 3: hash mismatch", "count": 9, "entries": [
        {"seq": 8, "at": 10.0, "actor": "admin:ops", "action": "job_submitted", "subject": "job:j1"}]}


def test_me_says_who_may_abort():
    assert views.me("ops", "operator", "127.0.0.1:1", "t")["can_abort"]
    assert views.me("root", "admin", "127.0.0.1:1", "t")["can_abort"]
    assert views.me("viewer", "viewer", "127.0.0.1:1", "t") == {
        "name": "viewer", "role": "viewer", "coordinator": "127.0.0.1:1", "can_abort": False, "csrf": "t"}


def test_an_event_as_the_stream_names_it():
    e = apb.JobEvent(unix_s=5.0, kind="site_declined", round=1, site="c", message="policy")
    assert views.event(e) == {"kind": "site_declined", "round": 1, "site": "c", "message": "policy", "unix_s": 5.0}
