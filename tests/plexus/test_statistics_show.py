"""`plexus job show` and `job download` for a statistics job: the figures from its pooled sums, as a table, CSV or
JSON (with the DP ledger); a training job's model is not statistics, and a job not pooled yet has none."""

from __future__ import annotations

import json

import numpy as np
import pytest
from statistics_jobs import statistics_job_text

from plexus import statistics as stats
from plexus.admin_client import job_statistics, statistics_spec
from plexus.cli import main as cli
from plexus.cli.admin import print_job
from plexus.config import parse_round_config
from plexus.errors import PlexusError
from plexus.proto.plexus.v1 import admin_pb2

TRAINING = "name: job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 3\n"


def detail(text: str, *, round_: int = 1) -> admin_pb2.JobDetail:
    return admin_pb2.JobDetail(config_yaml=text, summary=admin_pb2.JobSummary(
        job_id="job-1", name="stats", strategy="statistics", status="completed", rounds=1, current_round=round_),
        rounds=[admin_pb2.RoundInfo(round=1, status="closed", contributors=["a", "b", "c"], total_samples=3)])


def stats_job(dp: str = "") -> str:
    return statistics_job_text(dp=dp)


class Client:
    """What job_statistics asks of an AdminClient: a job's model, here pooled sums of two small tables."""

    def __init__(self, text: str):
        self.job_detail = detail(text)
        spec = parse_round_config(text).statistics or parse_round_config(stats_job()).statistics
        tables = [{"age": np.array(a, dtype=str), "sex": np.array(s, dtype=str)}
                  for a, s in ((["34", "51", ""], ["F", "M", "M"]), (["47", "62"], ["F", ""]))]
        self.sums = stats.combine_clear(spec, [stats.site_sums(spec, t) for t in tables])
        self.asked = []

    def download(self, job_id, round_=-1):
        self.asked.append((job_id, round_))
        return 1, self.sums

    def job(self, job_id):
        return self.job_detail

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_the_figures_of_a_statistics_job_come_from_its_pooled_sums():
    client = Client(stats_job())
    got, figures, ledger = job_statistics(client, client.job_detail)
    assert got == 1 and ledger is None and client.asked == [("job-1", -1)]
    values = {(f.column, f.statistic): f.value for f in figures}
    assert values[("", "rows")] == 5 and values[("age", "mean")] == pytest.approx(48.5)
    assert values[("sex", "category F")] == 2
    text = stats_job("{mechanism: laplace, epsilon: 0.5}")
    _, _, ledger = job_statistics(Client(text), detail(text))
    assert ledger == stats.dp_ledger(parse_round_config(text).statistics)


def test_a_training_job_or_a_statistics_job_not_pooled_yet_has_no_figures():
    assert statistics_spec(detail(TRAINING)) is None
    with pytest.raises(PlexusError, match="job job-1 is a training job, whose result is a model, not statistics; "
                                          r"download it as safetensors \(-o FILE.safetensors\)"):
        job_statistics(Client(stats_job()), detail(TRAINING))
    with pytest.raises(PlexusError, match=r"job job-1 has not pooled its sites' sums yet \(status completed\); "
                                          "follow it with `plexus job watch job-1`"):
        job_statistics(Client(stats_job()), detail(stats_job(), round_=0))


def test_job_show_prints_the_figures_table_under_the_rounds(capsys):
    client = Client(stats_job("{mechanism: laplace, epsilon: 0.5}"))
    _, figures, ledger = job_statistics(client, client.job_detail)
    print_job(client.job_detail, statistics=(figures, ledger))
    out = capsys.readouterr().out
    assert "\nrounds:\n" in out and "eval_*" not in out
    assert "statistics of the pooled rows" in out and stats.to_table(figures) in out
    assert f"epsilon 0.5 per query, {ledger.epsilon:g} in total over {len(ledger.queries)} queries" in out
    print_job(client.job_detail, statistics=(figures, ledger), as_json=True)
    shown = json.loads(capsys.readouterr().out)
    assert shown["statistics"] == json.loads(stats.to_json(figures, ledger))


@pytest.fixture
def admin(monkeypatch, tmp_path):
    """`plexus job ...` with its AdminClient replaced by a Client of `text` (the job's config)."""
    def use(text: str) -> list[str]:
        client = Client(text)
        monkeypatch.setattr("plexus.cli.admin.connect", lambda args: client)
        return ["--kit", str(tmp_path)]
    return use


@pytest.mark.parametrize("name, given, fmt", [("f.csv", [], "csv"), ("f.JSON", [], "json"),
                                              ("f.txt", ["--format", "csv"], "csv"),
                                              ("f.csv", ["--format", "json"], "json")])
def test_job_download_writes_the_figures_as_format_says_or_else_the_suffix(admin, tmp_path, capsys, name, given, fmt):
    kit = admin(stats_job())
    path = tmp_path / name
    assert cli(["job", "download", "job-1", "-o", str(path), *given, *kit]) == 0
    assert capsys.readouterr().out == f"wrote round 1 of job job-1 to {path} ({fmt})\n"
    text = path.read_text()
    if fmt == "csv":
        assert text.startswith("group,column,statistic,value\nall,,rows,5.0\n")
    else:
        assert json.loads(text)["dp"] is None and json.loads(text)["figures"][0]["value"] == 5.0


def test_job_download_refuses_csv_for_a_training_job_with_the_reason(admin, tmp_path, capsys):
    kit = admin(TRAINING)
    assert cli(["job", "download", "job-1", "-o", str(tmp_path / "model.csv"), *kit]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "as csv: job job-1 is a training job" in err and "-o FILE.safetensors" in err
    assert not (tmp_path / "model.csv").exists()
