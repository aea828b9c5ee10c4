"""Text a site sends (failure messages, metric names, names at Join) cannot drive an operator's terminal,
run as a spreadsheet formula in the CSV export, or break `plexus sites list`."""

from __future__ import annotations

import csv
import io

import grpc
import pytest

from plexus.cli import main as cli
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.text import csv_cell, printable

from integration.harness import heart_job

ESCAPES = "\x1b[2J\x1b]8;;http://evil.example\x07click\x1b]8;;\x07\u202egnp.exe\r"
FORMULA = '=HYPERLINK("http://evil.example","ok")'


def _cli(capsys, *args, rc: int = 0) -> str:
    capsys.readouterr()
    assert cli(list(args)) == rc
    return capsys.readouterr().out


def _admin_args(federation):
    return ["--kit", str(federation.root / "admins" / "ops"), "--coordinator", federation.address]


def test_printable_and_csv_cell():
    assert printable("ok\x1b[31m\u202e\n\té") == "ok\\x1b[31m\\u202e\\n\\té"
    for prefix in ("=", "+", "-", "@", "\t", "\r"):
        assert csv_cell(prefix + "1+1").startswith("'")
    assert csv_cell("accuracy") == "accuracy" and csv_cell(-1.5) == -1.5


def test_site_text_reaches_show_watch_and_metrics_escaped(federation, capsys):
    site = federation.raw_site("a")
    site.join()
    admin = federation.admin("ops")
    failed = admin.submit(heart_job(name="failing", min=1, rounds=1)).job_id
    site.report(site.next_task(), fpb.RESULT_FAILED, ESCAPES)
    federation.wait_job(failed)
    job = admin.submit(heart_job(name="metrics", min=1, rounds=1)).job_id
    task = site.next_task()
    site.submit(task, site.fetch(task)[1])
    task = site.next_task()
    assert task.kind == fpb.TASK_EVALUATE
    site.stub.ReportResult(fpb.TaskResult(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                          nonce=task.nonce, status=fpb.RESULT_EVALUATED,
                                          eval_metrics={FORMULA: 0.5, "acc\x1b[31m": 0.9}), timeout=5)
    assert federation.wait_job(job) == "completed"

    args = _admin_args(federation)
    for out in (_cli(capsys, "job", "show", failed, *args), _cli(capsys, "job", "watch", failed, *args, rc=1)):
        assert "\x1b" not in out and "\u202e" not in out and "\r" not in out
        assert "\\x1b[2J" in out and "\\u202e" in out
    table = _cli(capsys, "job", "metrics", job, *args)
    assert "\x1b" not in table and "acc\\x1b[31m" in table
    rows = list(csv.DictReader(io.StringIO(_cli(capsys, "job", "metrics", job, "--format", "csv", *args))))
    names = {row["name"] for row in rows}
    assert "'" + FORMULA in names and FORMULA not in names
    assert not [n for n in names if n.startswith(("=", "+", "-", "@"))]


def test_join_refuses_names_too_long_or_with_control_characters(federation, capsys):
    site = federation.raw_site("a")
    for request, found in (
            (fpb.JoinRequest(datasets=["x" * 5000]), "datasets name 'xxx"),
            (fpb.JoinRequest(models=["mlp\x1b[2J"]), "models name 'mlp\\x1b[2J'"),
            (fpb.JoinRequest(datasets=[f"d{i}" for i in range(300)]), "300 datasets"),
            (fpb.JoinRequest(agent_version="v" * 65), "agent_version"),
            (fpb.JoinRequest(policy_digest="<script>"), "policy_digest"),
            (fpb.JoinRequest(dataset_rows={" padded": 3}), "dataset_rows name"),
            (fpb.JoinRequest(dataset_rows={"heart-disease": 2**31 + 1}), "2147483649 training rows of 'heart-disease'"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            site.stub.Join(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Join refused" in err.value.details() and found in err.value.details(), err.value.details()
    assert "a" not in {row[0] for row in federation.store.sites()}
    assert site.stub.Join(fpb.JoinRequest(agent_version="0.1.0", models=["logistic"], datasets=["heart-disease"],
                                          policy_digest="ab" * 32, dataset_rows={"heart-disease": 10}),
                          timeout=5).site == "a"
    out = _cli(capsys, "sites", "list", *_admin_args(federation))
    assert max(len(line) for line in out.splitlines()) < 200
