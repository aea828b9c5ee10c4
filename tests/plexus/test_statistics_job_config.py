"""`kind: statistics` in a round config: what it derives (model, rounds, strategy), that the dumped config reads
back the same, and what it refuses, each with its line and fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from plexus.config import (
    ModelSpec,
    PolicySpec,
    StrategySpec,
    dump_round_config,
    load_round_config,
    load_site_config,
    parse_round_config,
    statistics_args,
)
from plexus.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

JOB = """\
name: heart-stats
kind: statistics
data: {dataset: heart-disease}
statistics:
  columns:
    - {name: age, range: [0, 100], bins: 10}
    - {name: chol}
    - {name: sex, categories: [Male, Female]}
  group_by: {column: num, categories: [0, 1, 2, 3, 4]}
  quantiles: [0.25, 0.5, 0.75]
  covariance: true
sites: {min: 4, deadline_s: 60}
"""


def error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_round_config(textwrap.dedent(text), source="job.yaml")
    return str(info.value)


def test_a_statistics_job_derives_its_model_rounds_and_strategy_from_the_block():
    cfg = parse_round_config(JOB)
    assert cfg.kind == "statistics"
    assert cfg.model == ModelSpec(name="statistics", args=statistics_args(cfg.statistics))
    assert cfg.rounds == 1 and cfg.strategy == StrategySpec(name="statistics")
    assert cfg.model.args["columns"][0] == {"name": "age", "range": [0.0, 100.0], "bins": 10}
    assert cfg.model.args["group_by"] == {"column": "num", "categories": ["0", "1", "2", "3", "4"]}


def test_the_dumped_config_reads_back_the_same_job():
    cfg = parse_round_config(JOB)
    text = dump_round_config(cfg)
    assert "kind: statistics" in text and "name: statistics" in text
    assert parse_round_config(text) == cfg
    assert dump_round_config(parse_round_config(text)) == text


def test_a_training_job_dumps_without_kind_so_older_agents_still_read_it():
    text = dump_round_config(load_round_config(EXAMPLES / "heart-fedavg.yaml"))
    assert "kind" not in text
    training = "name: j\nmodel: {name: mlp}\ndata: {dataset: d}\nrounds: 2\n"
    assert parse_round_config("kind: train\n" + training) == parse_round_config(training)


def test_written_model_rounds_and_strategy_are_accepted_when_they_are_what_the_block_derives():
    cfg = parse_round_config(JOB)
    args = dump_round_config(cfg).split("model:\n")[1].split("\nname: heart-stats")[0]
    written = JOB + "rounds: 1\nstrategy: {name: statistics}\nmodel:\n" + args + "\n"
    assert parse_round_config(written) == cfg


@pytest.mark.parametrize("extra, says", [
    ("rounds: 3\n", "job.yaml:13: rounds: is 3, and a statistics job is one round of sums; remove it: a statistics "
                    "job derives model, rounds and strategy from its statistics block"),
    ("strategy: {name: fedavg}\n",
     "job.yaml:13: strategy: is 'fedavg' with args {}, not {name: statistics}; remove it"),
    ("model: {name: mlp, args: {in_features: 3}}\n", "job.yaml:13: model: names model 'mlp'; remove it"),
    ("model: {name: statistics}\n", "job.yaml:13: model: has args other than the statistics block; remove it"),
    ("train: {epochs: 2}\n", "job.yaml:13: train: does not apply to a statistics job, which trains nothing and sends "
                             "its sums once, exactly; remove `train:`"),
    ("compression: {uplink: {codec: fp16}}\n", "job.yaml:13: compression: does not apply to a statistics job"),
    ("asynchronous: {buffer: 2}\n", "job.yaml:13: asynchronous: does not apply to a statistics job"),
    ("privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0}}\n",
     "job.yaml:13: privacy: dp noises training updates; a statistics job adds its noise per query: remove "
     "privacy.dp and set statistics.dp (mechanism, epsilon)"),
    ("privacy: {dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0}}\n", "remove privacy.dp_sgd"),
])
def test_what_a_statistics_job_does_not_take_is_refused_with_its_line_and_fix(extra, says):
    assert says in error(JOB + extra)


def test_sampling_sites_and_a_csv_schema_are_refused():
    assert "sites: fraction and count sample the sites of a round, and a statistics job pools the rows of every " \
           "site; remove them" in error(JOB.replace("sites: {min: 4, deadline_s: 60}", "sites: {min: 4, count: 4}"))
    schema = "data: {dataset: d, label: {column: y, classes: [0, 1]}, features: [{name: age}]}"
    assert "job.yaml:3: data: label and features declare a training job's inputs" in error(
        JOB.replace("data: {dataset: heart-disease}", schema))


def test_min_max_under_secure_aggregation_is_refused_because_a_min_is_not_a_sum():
    secure = JOB.replace("sites: {min: 4, deadline_s: 60}", "sites: {min: 4}\nprivacy: {secure_aggregation: true}")
    says = error(secure)
    assert "job.yaml:5: statistics: min_max is on (the default)" in says and "a min is not a sum" in says
    assert "set statistics.min_max: false" in says
    cfg = parse_round_config(secure.replace("covariance: true", "covariance: true\n  min_max: false")
                             .replace("{name: chol}", "{name: chol, range: [0, 600]}"))
    assert cfg.privacy.secure_aggregation and not cfg.statistics.min_max


def test_a_numeric_column_without_a_range_under_secure_aggregation_is_refused_at_its_line():
    secure = (JOB.replace("sites: {min: 4, deadline_s: 60}", "sites: {min: 4}\nprivacy: {secure_aggregation: true}")
              .replace("covariance: true", "covariance: true\n  min_max: false"))
    says = error(secure)
    assert says.startswith("job.yaml:7: statistics.columns[1]: 'chol' is numeric and has no `range`, and under "
                           "privacy.secure_aggregation every numeric column needs one"), says
    assert "privacy.secagg.clip at least the largest site's rows covers them" in says
    assert says.endswith("add `range: [lo, hi]` spanning its values, or describe it as `categories`, or set "
                         "privacy.secure_aggregation: false")
    # With a range on it, or in the clear, the job reads.
    assert parse_round_config(secure.replace("{name: chol}", "{name: chol, range: [0, 600]}"))
    assert parse_round_config(secure.replace("secure_aggregation: true", "secure_aggregation: false"))


def test_a_statistics_block_on_a_training_job_and_a_statistics_job_without_one_are_refused():
    training = "name: j\nmodel: {name: mlp}\ndata: {dataset: d}\nrounds: 2\nstatistics: {columns: [{name: a}]}\n"
    assert "job.yaml:5: statistics: describes a statistics job, and this is a training job; add `kind: statistics`" \
        in error(training)
    assert error("name: j\nkind: statistics\ndata: {dataset: d}\n") == (
        "job.yaml:2: kind: is statistics, but the job has no `statistics:` block; add one listing the columns to "
        "describe (docs/statistics.md)")
    assert "kind: 'survey' is not allowed; use one of: statistics, train" in error(
        "name: j\nkind: survey\nmodel: {name: mlp}\ndata: {dataset: d}\nrounds: 1\n")


def test_a_mistake_inside_the_statistics_block_is_reported_once_with_its_line():
    says = error(JOB.replace("{name: chol}", "{name: chol, bins: 0}"))
    assert says.startswith("job.yaml:7: statistics.columns[1].bins: 0 is out of range"), says


def test_site_policy_min_cell_count(tmp_path):
    path = tmp_path / "site.yaml"
    site = "site: a\ncoordinator: c.example.org:8443\nkit: kit\npolicy: {allowed_models: [statistics], %s}\n"
    path.write_text(site % "min_cell_count: 5")
    assert load_site_config(path).policy == PolicySpec(allowed_models=("statistics",), min_cell_count=5)
    path.write_text(site % "min_cell_count: 0")
    with pytest.raises(ConfigError, match="policy.min_cell_count: 0 is out of range"):
        load_site_config(path)


def test_the_example_statistics_job_reads():
    cfg = load_round_config(EXAMPLES / "heart-statistics.yaml")
    assert cfg.kind == "statistics" and [c.name for c in cfg.statistics.columns][:2] == ["age", "trestbps"]
