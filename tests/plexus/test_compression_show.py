"""`plexus job show` says how a job's updates and models travel."""

from __future__ import annotations

import pytest

from plexus.admin_client import compression_summary
from plexus.cli.admin import print_job
from plexus.proto.plexus.v1 import admin_pb2

JOB = "name: job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 3\nsites: {min: 3}\n"


def detail(extra: str) -> admin_pb2.JobDetail:
    return admin_pb2.JobDetail(config_yaml=JOB + extra,
                               summary=admin_pb2.JobSummary(job_id="job-1", name="job", strategy="fedavg",
                                                            status="running", rounds=3))


@pytest.mark.parametrize(("extra", "line"), [
    ("compression: {uplink: {codec: topk, fraction: 0.01}, downlink: {codec: delta8}}\n",
     "uplink topk (fraction 0.01, error feedback), downlink delta8"),
    ("compression: {uplink: {codec: randk, k: 5, error_feedback: false}}\n",
     "uplink randk (k 5, no error feedback), downlink none"),
    ("compression: {uplink: {codec: randk, k: 5}}\nprivacy: {secure_aggregation: true}\n",
     "uplink randk (k 5, no error feedback), downlink none"),
    ("compression: {uplink: {codec: int8, block: 64}, downlink: {codec: delta8, block: 128}}\n",
     "uplink int8 (block 64), downlink delta8 (block 128)"),
    ("compression: {downlink: {codec: fp16}}\n", "uplink none, downlink fp16"),
    ("compression: {uplink: {codec: int4}, downlink: {codec: delta4}}\n", "uplink int4, downlink delta4"),
    ("compression: {uplink: {codec: int4, block: 64}, downlink: {codec: delta4, block: 128}}\n",
     "uplink int4 (block 64), downlink delta4 (block 128)"),
])
def test_job_show_prints_the_compression_of_a_job(extra, line, capsys):
    assert compression_summary(detail(extra)) == line
    print_job(detail(extra))
    assert f"  compression: {line}\n" in capsys.readouterr().out


def test_a_job_without_compression_shows_no_such_line(capsys):
    assert compression_summary(detail("")) is None
    print_job(detail(""))
    assert "compression" not in capsys.readouterr().out
