"""A site whose CSV dataset names no label column: it advertises the file with all its rows, sends a statistics
job the same sums as if it named one, and declines a training job naming the fix.

The coordinator is a recording stand-in for the stub; the real gRPC path runs in tests/integration."""

from __future__ import annotations

import time

import numpy as np

from plexus.config import DatasetSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import Layout, decode
from site_agent.agent import SiteAgent

from fake_coordinator import FakeCoordinator

CSV = "age,sex,ward\n34,F,a\n51,M,a\n47,,b\n,M,b\n62,F,a\n58,M,b\n"

STATISTICS = """\
name: ward-stats
kind: statistics
data: {dataset: wards}
statistics:
  columns:
    - {name: age, range: [0, 100], bins: 4}
    - {name: sex, categories: [F, M]}
  group_by: {column: ward, categories: [a, b]}
sites: {min: 3}
"""

TRAINING = """\
name: ward-train
model: {name: logistic, args: {in_features: 3, num_classes: 2}}
data:
  dataset: wards
  label: {column: ward, classes: [a, b]}
  features:
    - {name: age, impute: 50}
    - {name: sex, categories: [F, M], impute: F}
strategy: {name: fedavg}
rounds: 1
sites: {min: 3}
"""


def _agent(kit, tmp_path, label: str | None = None, features: tuple[str, ...] | None = None) -> SiteAgent:
    path = tmp_path / "wards.csv"
    path.write_text(CSV)
    return SiteAgent(SiteConfig(
        site="a", coordinator="127.0.0.1:1", kit=kit, state_dir=tmp_path / f"state-{label}-{features}",
        datasets={"wards": DatasetSpec(kind="csv", path=path, label=label, features=features)},
        policy=PolicySpec(allowed_models=("statistics", "logistic"))))


def _handle(agent: SiteAgent, text: str) -> FakeCoordinator:
    stub = FakeCoordinator(parse_round_config(text))
    agent.handle(stub, fpb.Task(kind=fpb.TASK_TRAIN, task_id="t1", job_id="job-1", round=1, config_yaml=text,
                                nonce=b"n" * 16, deadline_unix_s=time.time() + 600, seed=7))
    return stub


def _sums(stub: FakeCoordinator) -> dict[str, np.ndarray]:
    (messages,) = stub.updates
    header = messages[0].header
    assert header.num_samples == 1
    return decode(Layout.from_proto(header.manifest), b"".join(m.chunk.data for m in messages[1:]))


def test_join_advertises_every_row(kit, tmp_path):
    assert _agent(kit, tmp_path).advertised_rows() == {"wards": 6}
    # With a label the rows a training job would train on are advertised, as before (ceil(0.34 * 6) = 3 test rows).
    assert _agent(kit, tmp_path, label="ward").advertised_rows() == {"wards": 3}


def test_a_statistics_job_gets_the_same_sums_as_from_a_labelled_entry(kit, tmp_path):
    stub = _handle(_agent(kit, tmp_path), STATISTICS)
    assert stub.results == []
    sums = _sums(stub)
    assert sums["stats/rows"].tolist() == [6, 3, 3]
    labelled = _sums(_handle(_agent(kit, tmp_path, label="ward"), STATISTICS))
    assert sums.keys() == labelled.keys()
    for name, value in labelled.items():
        np.testing.assert_array_equal(sums[name], value, err_msg=name)


def test_a_training_job_is_declined_naming_the_fix(kit, tmp_path):
    stub = _handle(_agent(kit, tmp_path), TRAINING)
    assert stub.updates == []
    (result,) = stub.results
    assert result.status == fpb.RESULT_DECLINED
    assert result.reason == ("dataset 'wards': it serves statistics jobs only at this site: its entry in site.yaml "
                             "names no label column; to train on it, the site adds `label: COLUMN` to the dataset "
                             "in site.yaml")
    assert str(tmp_path) not in result.reason
    # The same file with its label column named trains.
    stub = _handle(_agent(kit, tmp_path, label="ward"), TRAINING)
    assert stub.results == [] and len(stub.updates) == 1


def test_an_entry_that_lists_features_offers_statistics_only_those_and_its_label(kit, tmp_path):
    """The hospital chose which columns leave as features: a statistics job over another is declined, naming it."""
    stub = _handle(_agent(kit, tmp_path, label="ward", features=("age",)), STATISTICS)
    assert stub.updates == []
    (result,) = stub.results
    assert result.status == fpb.RESULT_DECLINED
    assert result.reason == ("dataset 'wards' offers only the columns this site lists for it, and the job asks for "
                             "1 more: ['sex']; describe only offered columns")
    # Offering sex as well, the same job runs (its group column, ward, is the entry's label).
    stub = _handle(_agent(kit, tmp_path, label="ward", features=("age", "sex")), STATISTICS)
    assert stub.results == [] and _sums(stub)["stats/rows"].tolist() == [6, 3, 3]
