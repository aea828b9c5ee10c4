"""`plexus job export --mlflow` after real jobs over mTLS, read back from a local MLflow store with MlflowClient."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from plexus.cli import main as cli

from integration.harness import Federation, heart_job

mlflow = pytest.importorskip("mlflow")

DP = "privacy: {dp: {mode: central, noise_multiplier: 1.1, clip_norm: 1.0}}\n"


@pytest.fixture(scope="module")
def jobs(pki_root, tmp_path_factory):
    """One federation of two heart-disease sites and its two finished jobs: plain FedAvg, and central DP."""
    fed = Federation(pki_root, tmp_path_factory.mktemp("mlflow") / "state")
    try:
        for name in "ab":
            fed.start_site(name)
        fed.wait_online("a", "b")
        admin = fed.admin()
        plain = admin.submit(heart_job(rounds=2)).job_id
        private = admin.submit(heart_job(name="heart-dp", rounds=2) + DP).job_id
        for job_id in (plain, private):
            assert fed.wait_job(job_id) == "completed", fed.store.job(job_id).message
        yield fed, plain, private
    finally:
        fed.close()



def _rows(fed, job_id, capsys) -> list[dict]:
    assert cli(["job", "metrics", job_id, "--format", "json", *fed.cli_args()]) == 0
    return json.loads(capsys.readouterr().out)


def _export(fed, job_id, uri, capsys, *extra, kit="ops") -> dict:
    assert cli(["job", "export", job_id, "--mlflow", uri, "--json", *extra, *fed.cli_args(kit)]) == 0
    return json.loads(capsys.readouterr().out)


def _as_keys(rows: list[dict]) -> dict[str, dict[int, float]]:
    """The rows of `plexus job metrics --format json` as the run should hold them: key -> round -> value."""
    out = defaultdict(dict)
    for r in rows:
        key = f"{r['kind']}/{r['site']}/{r['name']}" if r["site"] else f"{r['kind']}/{r['name']}"
        out[key][r["round"]] = r["value"]
    return dict(out)


def _history(client, run_id: str) -> dict[str, dict[int, float]]:
    """Every metric of the run: key -> step -> value."""
    keys = client.get_run(run_id).data.metrics
    return {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in keys}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A file: store under tmp_path; the export must allow it for itself and leave the environment as it was."""
    for key in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_DISABLE_TELEMETRY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    return f"file:{tmp_path / 'mlruns'}"


def _artifact(run, path: str) -> str:
    """An artifact's file in the local store (read directly: MlflowClient.download_artifacts leaves a thread pool
    cached for the rest of the process)."""
    return url2pathname(urlparse(f"{run.info.artifact_uri}/{path}").path)


def _reader(uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # undone at the test's end
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


def test_export_holds_every_metric_the_config_and_the_model(jobs, store, tmp_path, capsys, monkeypatch):
    fed, job_id, _ = jobs
    rows = _rows(fed, job_id, capsys)
    out = _export(fed, job_id, store, capsys)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ and "MLFLOW_DISABLE_TELEMETRY" not in os.environ
    assert out["model"] == f"model/{job_id}.safetensors" and out["model_round"] == 2
    client = _reader(store, monkeypatch)
    run = client.get_run(out["run_id"])
    assert run.info.run_name == f"heart {job_id}" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "plexus/heart" == out["experiment"]
    assert {k: v for k, v in run.data.tags.items() if k.startswith("plexus.")} == {
        "plexus.job_id": job_id, "plexus.job_name": "heart", "plexus.status": "completed", "plexus.strategy": "fedavg",
        "plexus.submitted_by": "ops", "plexus.rounds": "2 of 2", "plexus.coordinator": fed.address,
        "plexus.federation": "test-federation", "plexus.exported_by": "ops", "plexus.model_round": "2",
        "plexus.message": fed.admin().job(job_id).summary.message}

    # Every row of `plexus job metrics`, at its round, and nothing else but the weighted means over sites.
    logged = _history(client, out["run_id"])
    expected = _as_keys(rows)
    assert {"eval/a/accuracy", "eval/b/accuracy", "train/a/train_loss"} <= set(expected)
    assert {k: v for k, v in logged.items() if "/mean/" not in k} == expected
    per_site = {(r["round"], r["site"]): r for r in rows if r["kind"] == "eval" and r["name"] == "accuracy"}
    weight = {(r["round"], r["site"]): r["value"] for r in rows if r["kind"] == "eval" and r["name"] == "num_samples"}
    mean = defaultdict(lambda: [0.0, 0.0])
    for key, r in per_site.items():
        mean[key[0]][0] += r["value"] * weight[key]
        mean[key[0]][1] += weight[key]
    assert logged["eval/mean/accuracy"] == pytest.approx({step: s / w for step, (s, w) in mean.items()})
    assert set(logged["train/mean/train_loss"]) == {1, 2}
    assert out["metrics"] == sum(len(v) for v in logged.values())

    # The config the coordinator keeps, as params and whole.
    params = run.data.params
    assert params["train.optimizer.lr"] == "0.1" and params["rounds"] == "2" and params["model.name"] == "logistic"
    assert params["model.args.in_features"] == "13" and params["data.dataset"] == "heart-disease"
    assert [a.path for a in client.list_artifacts(out["run_id"])] == ["config.yaml", "model"]
    with open(_artifact(run, "config.yaml")) as f:
        text = f.read()
    assert text == fed.admin().job(job_id).config_yaml and yaml.safe_load(text)["seed"] == 0 == int(params["seed"])

    # The final model, byte for byte the tensors `plexus job download` writes.
    assert cli(["job", "download", job_id, "-o", str(tmp_path / "dl.safetensors"), *fed.cli_args()]) == 0
    capsys.readouterr()
    logged_model = load_file(_artifact(run, out["model"]))
    downloaded = load_file(tmp_path / "dl.safetensors")
    assert logged_model.keys() == downloaded.keys() and logged_model
    for name, tensor in downloaded.items():
        np.testing.assert_array_equal(logged_model[name], tensor)


def test_a_dp_job_logs_its_epsilon_per_round_for_a_viewer_without_the_model(jobs, store, tmp_path, capsys,
                                                                           monkeypatch):
    fed, _, job_id = jobs
    assert cli(["job", "export", job_id, "--mlflow", store, *fed.cli_args("viewer")]) == 1
    assert "viewer kit: pass --no-model or use an operator kit" in capsys.readouterr().err
    assert not (tmp_path / "mlruns").exists()   # refused before anything was logged

    rows = _rows(fed, job_id, capsys)
    out = _export(fed, job_id, store, capsys, "--no-model", "--experiment", "dp runs", "--run-name", "z=1.1",
                  kit="viewer")
    assert out["model"] is None
    client = _reader(store, monkeypatch)
    run = client.get_run(out["run_id"])
    assert run.info.run_name == "z=1.1" and client.get_experiment(run.info.experiment_id).name == "dp runs"
    assert run.data.tags["plexus.exported_by"] == "viewer" and "plexus.model_round" not in run.data.tags
    assert run.data.params["privacy.dp.noise_multiplier"] == "1.1" and run.data.params["privacy.dp.mode"] == "central"
    epsilon = {r["round"]: r["value"] for r in rows if (r["kind"], r["name"]) == ("privacy", "epsilon")}
    assert set(epsilon) == {1, 2} and epsilon[2] > epsilon[1] > 0
    logged = _history(client, out["run_id"])
    assert logged["privacy/epsilon"] == epsilon
    assert logged == _as_keys(rows) and set(logged) == {"privacy/epsilon", "privacy/delta"}   # no site's metrics
    assert client.list_artifacts(out["run_id"], "model") == []
