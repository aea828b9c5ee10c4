"""What `plexus job export --mlflow` logs of a job (plexus.tracking), against hand-built job details; and the
command's refusal without MLflow installed."""

from __future__ import annotations

import os
import sys

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from plexus import pki, tracking
from plexus.cli import main as cli
from plexus.proto.plexus.v1 import admin_pb2
from plexus.tracking import MAX_KEY, MAX_PARAM_VALUE, Point

CONFIG = """\
data: {dataset: heart-disease}
model:
  args: {in_features: 13, num_classes: 2}
  name: logistic
privacy: {dp: null, secure_aggregation: false}
rounds: 2
sites: {min: 2, deadline_s: 30.0, exclude: []}
train:
  optimizer: {lr: 0.1, name: sgd}
strategy: {args: {}, name: fedavg}
"""


def _detail(status: str = "completed", message: str = "final model evaluated by 2 site(s)") -> admin_pb2.JobDetail:
    rows = [(0, "a", "eval", "accuracy", 0.5), (0, "a", "eval", "num_samples", 30.0),
            (0, "b", "eval", "accuracy", 0.8), (0, "b", "eval", "num_samples", 10.0),
            (1, "a", "train", "train_loss", 0.6), (1, "a", "train", "num_samples", 100.0),
            (1, "b", "train", "train_loss", 0.2), (1, "b", "train", "num_samples", 300.0),
            (1, "", "privacy", "epsilon", 1.25)]
    return admin_pb2.JobDetail(
        summary=admin_pb2.JobSummary(job_id="heart-0a1b2c3d", name="heart", status=status, rounds=2, current_round=1,
                                     message=message, submitted_by="ops", created_unix_s=1000.0,
                                     updated_unix_s=1030.5, strategy="fedavg"),
        config_yaml=CONFIG,
        rounds=[admin_pb2.RoundInfo(round=1, status="closed", opened_unix_s=1001.0, closed_unix_s=1010.0),
                admin_pb2.RoundInfo(round=2, status="open", opened_unix_s=1010.5)],
        metrics=[admin_pb2.MetricRow(round=r, site=s, kind=k, name=n, value=v) for r, s, k, n, v in rows])


def test_every_row_keeps_its_round_and_value_and_the_means_over_sites_follow():
    assert tracking.metrics(_detail()) == [
        Point("eval/a/accuracy", 0.5, 0, 1_000_000), Point("eval/a/num_samples", 30.0, 0, 1_000_000),
        Point("eval/b/accuracy", 0.8, 0, 1_000_000), Point("eval/b/num_samples", 10.0, 0, 1_000_000),
        Point("train/a/train_loss", 0.6, 1, 1_010_000), Point("train/a/num_samples", 100.0, 1, 1_010_000),
        Point("train/b/train_loss", 0.2, 1, 1_010_000), Point("train/b/num_samples", 300.0, 1, 1_010_000),
        Point("privacy/epsilon", 1.25, 1, 1_010_000),
        # weighted by the sites' rows: (0.5·30 + 0.8·10) / 40 and (0.6·100 + 0.2·300) / 400
        Point("eval/mean/accuracy", pytest.approx(0.575), 0, 1_000_000),
        Point("train/mean/train_loss", pytest.approx(0.3), 1, 1_010_000)]


def test_a_sites_own_epsilon_is_logged_per_site_and_never_averaged_over_sites():
    detail = _detail()
    detail.metrics.extend([admin_pb2.MetricRow(round=1, site=s, kind="train", name="epsilon", value=v)
                           for s, v in (("a", 0.5), ("b", 3.0))])
    keys = {p.key: p.value for p in tracking.metrics(detail)}
    assert keys["train/a/epsilon"] == 0.5 and keys["train/b/epsilon"] == 3.0
    assert "train/mean/epsilon" not in keys and "train/mean/train_loss" in keys


def test_a_round_the_detail_does_not_list_is_stamped_with_the_jobs_last_update():
    detail = _detail()
    detail.metrics.add(round=2, site="a", kind="eval", name="accuracy", value=0.7)
    assert tracking.metrics(detail)[9] == Point("eval/a/accuracy", 0.7, 2, 1_010_500)   # round 2: opened, not closed
    detail.metrics.add(round=7, site="a", kind="eval", name="auc", value=0.9)
    assert Point("eval/a/auc", 0.9, 7, 1_030_500) in tracking.metrics(detail)


def test_keys_are_kind_site_name_and_a_site_named_mean_cannot_pass_for_the_mean():
    assert tracking.metric_key("privacy", "", "epsilon") == "privacy/epsilon"
    assert tracking.metric_key("eval", "cleveland", "auc") == "eval/cleveland/auc"
    assert tracking.metric_key("eval", "mean", "auc") == "eval/site.mean/auc"
    assert tracking.metric_key("async", "", "staleness_3") == "async/staleness_3"


def test_names_mlflow_refuses_are_made_safe_and_stay_distinct():
    assert tracking.clean("train_loss") == "train_loss"
    assert tracking.clean("a:b") != tracking.clean("a/b") != tracking.clean("a_b") == "a_b"
    assert tracking.clean("a:b").startswith("a_b-") and len(tracking.clean("a:b")) == len("a_b-") + 6
    for odd in ("", ".", "..", "x/../y", "naïve", "\x1b[31m"):
        assert tracking.clean(odd) not in ("", ".", "..") and "/" not in tracking.clean(odd)
    long = tracking.metric_key("eval", "a", "x" * 400)
    assert len(long) == MAX_KEY and long != tracking.metric_key("eval", "a", "x" * 401)


@settings(deadline=None)   # the first example imports MLflow
@given(st.text(max_size=300), st.text(max_size=70), st.text(max_size=300))
def test_every_key_is_one_mlflow_accepts(kind, site, name):
    validation = pytest.importorskip("mlflow.utils.validation")
    key = tracking.metric_key(kind, site, name)
    validation._validate_metric_name(key)   # raises MlflowException for a key MLflow would refuse
    assert len(key) <= MAX_KEY
    (param, value), = tracking.params(yaml.safe_dump({name: {kind: site}}))
    validation._validate_param_name(param)
    assert len(param) <= MAX_KEY and value == site


def test_the_config_is_flattened_to_dotted_params_with_values_as_text():
    assert tracking.params(CONFIG) == [
        ("data.dataset", "heart-disease"), ("model.args.in_features", "13"), ("model.args.num_classes", "2"),
        ("model.name", "logistic"), ("privacy.dp", "null"), ("privacy.secure_aggregation", "false"),
        ("rounds", "2"), ("sites.deadline_s", "30.0"), ("sites.exclude", "[]"), ("sites.min", "2"),
        ("strategy.args", "{}"), ("strategy.name", "fedavg"), ("train.optimizer.lr", "0.1"),
        ("train.optimizer.name", "sgd")]


def test_a_value_past_mlflows_limit_is_cut_saying_where_the_whole_is():
    (key, value), = tracking.params(f"notes: {'y' * 7000}\n")
    assert key == "notes" and len(value) == MAX_PARAM_VALUE and value.startswith("y" * 5000)
    assert value.endswith("[cut: 7000 characters in all; the whole config is the run's artifact config.yaml]")
    assert tracking.params("just text") == [] and tracking.params(": [") == []


def test_the_run_is_named_after_the_job_tagged_with_where_it_came_from_and_ends_as_the_job_did():
    run = tracking.export(_detail(), coordinator="127.0.0.1:8443", federation="consortium", exported_by="ann",
                          model_round=1)
    assert (run.experiment, run.run_name, run.start_ms, run.end_ms) == ("plexus/heart", "heart heart-0a1b2c3d",
                                                                        1_000_000, 1_030_500)
    assert run.tags == {"plexus.job_id": "heart-0a1b2c3d", "plexus.job_name": "heart", "plexus.status": "completed",
                        "plexus.strategy": "fedavg", "plexus.submitted_by": "ops", "plexus.rounds": "1 of 2",
                        "plexus.coordinator": "127.0.0.1:8443", "plexus.federation": "consortium",
                        "plexus.exported_by": "ann", "plexus.message": "final model evaluated by 2 site(s)",
                        "plexus.model_round": "1"}
    assert run.config_yaml == CONFIG and run.params == tracking.params(CONFIG) and run.run_status == "FINISHED"
    named = tracking.export(_detail("aborted", ""), coordinator="c:1", federation="f", exported_by="ann",
                            experiment="mine", run_name="try 3")
    assert (named.experiment, named.run_name, named.run_status) == ("mine", "try 3", "KILLED")
    assert "plexus.message" not in named.tags and "plexus.model_round" not in named.tags
    assert [tracking.export(_detail(s), coordinator="c:1", federation="f", exported_by="a").run_status
            for s in ("failed", "budget_reached", "running")] == ["FAILED", "FINISHED", "FINISHED"]


def test_batches_keep_to_mlflows_limits_per_call():
    points = [Point(f"m{i}", 0.0, 0, 0) for i in range(2500)]
    named = [(f"p{i}", "v") for i in range(250)]
    sizes = [(len(m), len(p)) for m, p in tracking.batches(points, named)]
    assert sizes == [(0, 100), (0, 100), (0, 50), (1000, 0), (1000, 0), (500, 0)]
    assert [p for _, batch in tracking.batches(points, named) for p in batch] == named
    assert list(tracking.batches([], [])) == []


def test_export_without_mlflow_installed_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)   # `import mlflow` raises ImportError
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    code = cli(["job", "export", "j", "--mlflow", f"file:{tmp_path}/mlruns", "--kit", str(tmp_path / "kit"),
                "--coordinator", "127.0.0.1:1"])
    assert code == 1 and "pip install 'plexus-fl[mlflow]'" in capsys.readouterr().err
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ   # set for the export only, and put back


def test_a_uri_mlflow_cannot_use_is_refused_before_the_coordinator_is_asked(tmp_path, capsys):
    pytest.importorskip("mlflow")
    pki.init_federation(tmp_path / "fed", "f", hosts=["127.0.0.1"])
    pki.add_admin(tmp_path / "fed", "ann", role="operator")
    kit = tmp_path / "fed" / "admins" / "ann"
    code = cli(["job", "export", "j", "--mlflow", f"sqlite:///{tmp_path}/m.db", "--kit", str(kit),
                "--coordinator", "127.0.0.1:1"])   # nothing listens there: asking it would fail otherwise
    err = capsys.readouterr().err
    assert code == 1 and "MLflow cannot use sqlite:///" in err and "a tracking server's http(s):// URI" in err
    assert not (tmp_path / "m.db").exists()
