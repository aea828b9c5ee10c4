"""The round config's CSV schema (data.label, data.features) and the site's csv options, as the reader reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from plexus.config import dump_round_config, load_round_config, load_site_config, parse_round_config
from plexus.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

JOB = """\
name: j
model: {{name: logistic, args: {{in_features: {inputs}, num_classes: {classes}}}}}
rounds: 1
data:
  dataset: d
{data}"""


def _job(data: str, inputs: int = 3, classes: int = 2) -> str:
    return JOB.format(data=data, inputs=inputs, classes=classes)


def test_classes_and_categories_read_as_the_csv_text_and_round_trip():
    cfg = parse_round_config(_job(
        "  label: {column: y, classes: [0, 1]}\n"
        "  features:\n"
        "    - {name: smoker, categories: [yes, no]}\n"
        "    - {name: dose, impute: 0.5, center: 1, scale: 2}\n"))
    assert cfg.data.label.classes == ("0", "1")
    assert cfg.data.features[0].categories == ("yes", "no")   # YAML 1.1 booleans stay the words in the file
    assert cfg.data.features[1].impute == "0.5" and cfg.data.features[1].scale == 2.0
    assert parse_round_config(dump_round_config(cfg)) == cfg


def test_existing_configs_without_a_schema_still_read_and_dump_as_before():
    cfg = load_round_config(EXAMPLES / "heart-fedavg.yaml")
    assert cfg.data.label is None and cfg.data.features is None
    # agents older than the schema reject unknown keys: a config without one dumps without the keys
    assert "data:\n  dataset: heart-disease\nmodel:" in dump_round_config(cfg)
    assert load_round_config(EXAMPLES / "triage" / "triage-fedavg.yaml").data.label.classes == (
        "home", "readmitted", "icu")


@pytest.mark.parametrize(("data", "inputs", "expected"), [
    ("  label: {column: y, classes: [a, b]}\n", 3,
     "job.yaml:5: data.features: a CSV schema needs both `label` (column and classes) and `features`"),
    ("  label: {column: y, classes: [a, a]}\n  features: [{name: x}]\n", 1,
     "job.yaml:6: data.label.classes: lists a value twice"),
    ("  label: {column: y, classes: [a, b]}\n  features: [{name: x}, {name: x}]\n", 2,
     "job.yaml:7: data.features: lists column(s) ['x'] more than once"),
    ("  label: {column: y, classes: [a, b]}\n  features: [{name: y}]\n", 1,
     "job.yaml:7: data.features: lists the label column 'y'"),
    ("  label: {column: y, classes: [a, b]}\n  features: [{name: x, categories: [p, q], impute: r}]\n", 2,
     "job.yaml:7: data.features[0].impute: 'r' is not one of the declared categories ['p', 'q']"),
    ("  label: {column: y, classes: [a, b]}\n  features: [{name: x, categories: [p, q], scale: 3}]\n", 2,
     "job.yaml:7: data.features[0].scale: applies to numeric columns only"),
    ("  label: {column: y, classes: [a, b]}\n  features: [{name: x, impute: none}]\n", 1,
     "job.yaml:7: data.features[0].impute: 'none' is not a number, and 'x' is a numeric column"),
    ("  label: {column: y, classes: [a, b]}\n  features: [{name: x, scale: 0}]\n", 1,
     "job.yaml:7: data.features[0].scale: 0.0 is out of range"),
    ("  label: {column: y, classes: []}\n  features: [{name: x}]\n", 1,
     "job.yaml:6: data.label.classes: is empty"),
    ("  label: {column: y, classes: [a, ~]}\n  features: [{name: x}]\n", 1,
     "job.yaml:6: data.label.classes[1]: expected a value, got null"),
])
def test_schema_mistakes_name_the_key_and_line(data, inputs, expected):
    with pytest.raises(ConfigError) as err:
        parse_round_config(_job(data, inputs), source="job.yaml")
    assert str(err.value).startswith(expected), str(err.value)


def test_the_model_must_take_the_inputs_and_classes_the_schema_derives():
    data = ("  label: {column: y, classes: [a, b, c]}\n"
            "  features: [{name: age}, {name: sex, categories: [F, M]}, {name: ward, categories: [x, y, z]}]\n")
    with pytest.raises(ConfigError) as err:
        parse_round_config(_job(data, inputs=3, classes=3), source="job.yaml")
    assert str(err.value) == (
        "job.yaml:2: model: args.in_features is 3, but data.features derive 6 model inputs after one-hot encoding "
        "(age, sex=F, sex=M, ward=x, ward=y, ward=z); set in_features: 6")
    with pytest.raises(ConfigError, match="args.num_classes is 2, but data.label declares 3 classes; set num_classes"):
        parse_round_config(_job(data, inputs=6, classes=2), source="job.yaml")
    assert parse_round_config(_job(data, inputs=6, classes=3)).model.args["in_features"] == 6


SITE = """\
site: s
coordinator: "c.example.org:8443"
kit: kit
datasets:
  d: {kind: csv, path: d.csv, label: y, {options}}
"""


def test_site_csv_options_encoding_and_delimiter(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text(SITE.replace("{options}", "encoding: latin-1, delimiter: ';'"))
    spec = load_site_config(path).datasets["d"]
    assert (spec.encoding, spec.delimiter) == ("latin-1", ";")
    for options, expected in [
        ("encoding: klingon", "5: datasets.d.encoding: 'klingon' is not a text encoding Python knows"),
        ("delimiter: ';;'", "5: datasets.d.delimiter: ';;' is not a one-character delimiter"),
    ]:
        path.write_text(SITE.replace("{options}", options))
        with pytest.raises(ConfigError, match=expected):
            load_site_config(path)
    path.write_text(SITE.replace("kind: csv, path: d.csv, label: y, {options}",
                                 "kind: heart-disease, hospital: va, delimiter: ';'"))
    with pytest.raises(ConfigError, match="delimiter: does not apply to kind 'heart-disease'"):
        load_site_config(path)
