"""The `plexus` CLI against a live coordinator: what an operator types, what they read back."""

from __future__ import annotations

import csv
import io
import json
import stat
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest

from plexus.cli import main as cli, parser
from plexus.config import DatasetSpec, load_site_config
from plexus.datasets import train_rows
from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import HOSPITAL_OF, heart_job, scaled, wait_until


def test_pki_commands_make_kits_and_revoke(tmp_path, capsys):
    root = tmp_path / "fed"
    assert cli(["pki", "init", str(root), "--federation", "cli-test", "--host", "127.0.0.1"]) == 0
    assert cli(["pki", "add-site", str(root), "oslo"]) == 0
    assert cli(["pki", "add-admin", str(root), "ann", "--role", "operator"]) == 0
    assert stat.S_IMODE((root / "sites" / "oslo" / "key.pem").stat().st_mode) == 0o600
    assert cli(["pki", "add-site", str(root), "oslo"]) == 1
    assert "revoke it first" in capsys.readouterr().err
    assert cli(["pki", "revoke", str(root), "oslo"]) == 0
    assert "revoked 'oslo'" in capsys.readouterr().out
    assert cli(["pki", "add-site", str(tmp_path / "nowhere"), "x"]) == 1
    assert "plexus pki init" in capsys.readouterr().err


def test_pki_add_site_maps_the_datasets_it_is_given_into_the_kit(tmp_path, capsys):
    root = tmp_path / "fed"
    assert cli(["pki", "init", str(root), "--federation", "cli-test", "--host", "127.0.0.1"]) == 0
    assert cli(["pki", "add-site", str(root), "bergen", "--dataset", "heart-disease=va",
                "--dataset", "registry=data/heart.csv,label=target", "--dataset", "scans=/srv/scans.npz"]) == 0
    site = load_site_config(root / "sites" / "bergen" / "site.yaml")
    assert site.datasets == {"heart-disease": DatasetSpec(kind="heart-disease", hospital="va"),
                             "registry": DatasetSpec(kind="csv", path=Path.cwd() / "data" / "heart.csv",
                                                     label="target"),
                             "scans": DatasetSpec(kind="npz", path=Path("/srv/scans.npz"))}
    assert cli(["pki", "add-site", str(root), "oslo"]) == 0
    assert "map its datasets in" in capsys.readouterr().out and not load_site_config(
        root / "sites" / "oslo" / "site.yaml").datasets

    for bad, says in (("heart-disease=boston", "a built-in heart-disease hospital (cleveland, hungary, switzerland, "
                                               "va), a .npz file or a .csv file with its label column"),
                      ("registry=/data/heart.csv", "a CSV dataset needs its label column; write "
                                                   "registry=/data/heart.csv,label=COLUMN"),
                      ("heart-disease", "'heart-disease' is not NAME=DATA"),
                      ("-x=va", "dataset name '-x' is not valid")):
        with pytest.raises(SystemExit) as exit_:
            cli(["pki", "add-site", str(root), "lima", f"--dataset={bad}"])
        assert exit_.value.code == 2 and says in capsys.readouterr().err, bad
    assert cli(["pki", "add-site", str(root), "lima", "--dataset", "h=va", "--dataset", "h=cleveland"]) == 1
    assert "--dataset maps h more than once" in capsys.readouterr().err
    assert not (root / "sites" / "lima").exists()   # refused before a certificate was issued


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"plexus {version('plexus-fl')}\n"


@pytest.mark.parametrize("command", [["job", "submit", "JOB"], ["job", "list"], ["job", "show", "j"],
                                     ["job", "watch", "j"], ["job", "abort", "j"], ["job", "resume", "j"],
                                     ["job", "download", "j", "-o", "m"], ["job", "metrics", "j"],
                                     ["job", "plot", "j", "-o", "p"], ["sites", "list"], ["audit"]])
def test_every_admin_command_takes_a_timeout(command, tmp_path):
    job = tmp_path / "x.yaml"   # `job submit` refuses a file that is not there while parsing
    job.write_text("name: x\n")
    command = [str(job) if arg == "JOB" else arg for arg in command]
    assert parser().parse_args([*command, "--timeout", "7.5"]).timeout == 7.5
    assert parser().parse_args(command).timeout is None   # the client's defaults


def test_job_lifecycle_through_the_cli(federation, tmp_path, capsys):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(heart_job(rounds=2, min=2))
    assert cli(["job", "submit", str(job_file), "--wait", *federation.cli_args()]) == 0
    out = capsys.readouterr().out
    assert "round_closed" in out and "job_completed" in out and "accuracy=" in out
    # Each metric says which model it belongs to.
    closed = out[out.index("round 2 round_closed"):out.index("job_completed")]
    assert "\n    global model of round 1 on the sites' held-out rows: accuracy=" in closed
    assert "\n    sites' local models of round 2: train_loss=" in closed
    assert "\n    global model of round 2 on the sites' held-out rows: accuracy=" in out[out.index("job_completed"):]

    assert cli(["job", "list", "--json", *federation.cli_args("viewer")]) == 0
    jobs = json.loads(capsys.readouterr().out)
    assert [(j["status"], j["round"], j["rounds"]) for j in jobs] == [("completed", 2, 2)]
    job_id = jobs[0]["job_id"]

    assert cli(["job", "show", job_id, *federation.cli_args("viewer")]) == 0
    out = capsys.readouterr().out
    assert "status: completed" in out and "eval_accuracy" in out

    assert cli(["job", "metrics", job_id, "--format", "csv", *federation.cli_args("viewer")]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert {(r["site"], r["kind"], r["name"]) for r in rows} >= {("a", "eval", "auc"), ("b", "train", "train_loss")}

    assert cli(["job", "watch", job_id, "--json", *federation.cli_args("viewer")]) == 0
    watched = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    [first] = [e for e in watched if e["kind"] == "round_closed" and e["round"] == 1]
    assert first["global_model"]["round"] == 0 and 0 <= first["global_model"]["eval"]["accuracy"] <= 1
    assert first["local_models"]["round"] == 1 and first["local_models"]["train"]["train_loss"] > 0

    for argv in (["job", "metrics", job_id, "--format", "csv"], ["job", "list"], ["job", "show", job_id]):
        # The reader is gone before the first line (`| head -0`): no traceback, only the exit status.
        reader = subprocess.Popen([sys.executable, "-m", "plexus", *argv, *federation.cli_args("viewer")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        reader.stdout.close()
        assert (reader.wait(timeout=60), reader.stderr.read()) == (1, b""), argv
        reader.stderr.close()

    model = tmp_path / "m.safetensors"
    assert cli(["job", "download", job_id, "--round", "1", "-o", str(model), *federation.cli_args()]) == 0
    from safetensors.numpy import load_file
    assert load_file(str(model))["linear.weight"].shape == (2, 13)
    assert cli(["job", "download", job_id, "--round", "9", "-o", str(model), *federation.cli_args()]) == 1
    assert "round 9 has no model yet" in capsys.readouterr().err

    assert cli(["sites", "list", "--json", *federation.cli_args("viewer")]) == 0
    sites = json.loads(capsys.readouterr().out)
    assert [(s["site"], s["online"], s["datasets"], s["revoked"]) for s in sites] == [
        ("a", True, "heart-disease", False), ("b", True, "heart-disease", False)]
    assert [s["dataset_rows"] for s in sites] == [   # the training rows each agent reported at Join
        {"heart-disease": train_rows(DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[s]))} for s in "ab"]


ASYNC_JOB = """\
name: fedbuff
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 2
sites: {min: 3, deadline_s: 30}
asynchronous: {buffer: 2, max_staleness: 0, staleness: {fn: hinge, a: 0.5, b: 1}}
seed: 0
"""


def test_an_asynchronous_job_through_the_cli_reads_in_versions(federation, tmp_path, capsys):
    """Raw sites over gRPC + mTLS: versions 1 and 2 from a and b, c's update from version 0 refused as stale."""
    sites = {name: federation.raw_site(name) for name in "abc"}
    for site in sites.values():
        site.join()
    federation.wait_online(*sites)
    job_id = federation.admin().submit(ASYNC_JOB).job_id
    tasks = {name: site.next_task() for name, site in sites.items()}
    _, v0 = sites["a"].fetch(tasks["a"])
    for name in "ab":
        sites[name].submit(tasks[name], v0)
    wait_until(lambda: federation.store.job(job_id).current_round == 1, scaled(10), "version 1")
    with pytest.raises(grpc.RpcError, match="1 versions old; asynchronous.max_staleness is 0"):
        sites["c"].submit(tasks["c"], v0)
    for name in "ab":
        sites[name].submit(sites[name].next_task(), v0)
    for site in sites.values():   # the final evaluation, by every online site
        site.report(site.next_task(), fpb.RESULT_EVALUATED)
    assert federation.wait_job(job_id, scaled(20)) == "completed"

    assert cli(["job", "show", job_id, *federation.cli_args("viewer")]) == 0
    out = capsys.readouterr().out
    assert f"job {job_id}  (fedbuff, fedavg)  status: completed  version 2 of 2\n" in out
    assert "  asynchronous: buffer 2, max staleness 0, staleness hinge (a=0.5, b=1)\n" in out
    assert f"\nstaleness of the updates in versions 1-2 (versions behind the newest when taken in):\n" \
           f"  0  {'#' * 40}  4\n" in out
    sites_table = out.split("\nsites (")[1].split("\n\n")[0].splitlines()[2:]
    assert [line.split() for line in sites_table] == [["a", "2", "0"], ["b", "2", "0"], ["c", "0", "1"]]

    assert cli(["job", "show", job_id, "--json", *federation.cli_args("viewer")]) == 0
    view = json.loads(capsys.readouterr().out)["asynchronous"]
    assert (view["version"], view["refused_stale"], view["staleness"]) == (2, 1, [{"staleness": 0, "updates": 4}])

    assert cli(["job", "watch", job_id, *federation.cli_args("viewer")]) == 0
    out = capsys.readouterr().out
    assert "] version 1 made: 2 update(s), 20 samples, staleness a=0, b=0\n    staleness 0:2 (mean 0.00)\n" in out
    assert "] version 2 made: 2 update(s), 20 samples, staleness a=0, b=0\n    staleness 0:2 (mean 0.00); " \
           "refused as stale while it filled: 1 (c=1)\n" in out
    assert "] c: update from version 0 rejected: the update was computed from version 0, 1 versions old; " \
           "asynchronous.max_staleness is 0" in out


def test_abort_and_role_errors_read_clearly(federation, tmp_path, capsys):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(heart_job(rounds=2, min=3))
    assert cli(["job", "submit", str(job_file), "--json", *federation.cli_args()]) == 0
    job_id = json.loads(capsys.readouterr().out)["job_id"]
    assert cli(["job", "abort", job_id, *federation.cli_args("viewer")]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert cli(["job", "abort", job_id, *federation.cli_args()]) == 0
    assert "aborted" in capsys.readouterr().out
    assert cli(["job", "abort", job_id, *federation.cli_args()]) == 1
    assert "already aborted" in capsys.readouterr().err
    assert cli(["job", "show", "no-such-job", *federation.cli_args()]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert cli(["job", "list", "--coordinator", federation.address, "--kit", str(tmp_path / "none")]) == 1
    assert "ca.pem is missing" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["demo", "--sites", "9"], "argument --sites: 9 is out of range: it must be between 1 and 4"),
    (["demo", "--sites", "0"], "argument --sites: 0 is out of range"),
    (["demo", "--sites", "four"], "argument --sites: 'four' is not a whole number"),
    (["demo", "--rounds", "0"], "argument --rounds: 0 is out of range: it must be at least 1"),
    (["demo", "--sites", "2", "--secure-aggregation"], "--secure-aggregation needs --sites 3 or more"),
    (["pki", "init", "DIR", "--federation", "f", "--port", "70000"], "argument --port: 70000 is out of range"),
    (["coordinator", "run", "--config", "MISSING"], "argument --config: MISSING: no such file; check the path"),
    (["site", "run", "--config", "MISSING"], "argument --config: MISSING: no such file"),
    (["site", "check", "--config", "MISSING"], "argument --config: MISSING: no such file"),
    (["site", "run", "--config", "TMP"], "argument --config: TMP is a directory; give the file in it"),
    (["job", "submit", "MISSING", "--kit", "TMP"], "argument file: MISSING: no such file"),
    (["job", "metrics", "j", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["job", "list", "--timeout", "-1"], "argument --timeout: '-1' is not a number of seconds above 0"),
    (["job", "list", "--coordinator", "127.0.0.1:1"], "no admin kit: pass --kit DIR or set PLEXUS_KIT"),
    (["audit", "--against", "HEAD", "--kit", "TMP", "--coordinator", "127.0.0.1:1"],
     "--against HEAD_FILE checks the log: use it with --verify"),
    (["health"], "no address: pass HOST:PORT or --site-config FILE"),
    (["job", "download", "j", "-o", "TMP", "--kit", "TMP"], "argument -o/--output: TMP is a folder; give a file path"),
    (["job", "download", "j", "-o", "", "--kit", "TMP"], "argument -o/--output: is empty"),
    (["job", "download", "j", "-o", "no-such-folder/m.safetensors", "--kit", "TMP"],
     "argument -o/--output: no-such-folder/m.safetensors: its folder no-such-folder does not exist; make it first"),
    (["job", "download", "j", "-o", "m.safetensors", "--round", "-5"], "argument --round: -5 is out of range"),
    (["job", "download", "j", "-o", "m.safetensors", "--round", "9" * 30], "argument --round: 999"),
    (["job", "plot", "j", "-o", "TMP"], "argument -o/--output: TMP is a folder"),
    (["audit", "--limit", "9" * 30], "argument --limit: 999"),
    (["job", "list", "--kit", "TMP", "--coordinator", "127.0.0.1:99999"],
     "--coordinator (or PLEXUS_COORDINATOR): port 99999 in '127.0.0.1:99999' is out of range"),
    (["job", "list", "--kit", "TMP", "--coordinator", "no-port"], "'no-port' is not host:port"),
    (["bogus"], "argument COMMAND: invalid choice: 'bogus'"),
    (["job", "frobnicate"], "argument ACTION: invalid choice: 'frobnicate'"),
])
def test_argument_errors_end_with_one_line_and_exit_2(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PLEXUS_KIT", raising=False)
    head = tmp_path / "head.json"
    head.write_text("{}")
    where = {"MISSING": str(tmp_path / "missing.yaml"), "TMP": str(tmp_path), "HEAD": str(head),
             "DIR": str(tmp_path / "fed")}
    argv = [where.get(arg, arg) for arg in argv]
    says = says.replace("MISSING", where["MISSING"]).replace("TMP", where["TMP"])
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.startswith("usage: plexus") and "Traceback" not in err
    *_, last = err.rstrip("\n").split("\n")
    assert last.startswith("plexus") and ": error: " in last and says in last, err
    assert not (tmp_path / "fed").exists()   # refused before anything was made


def test_demo_with_too_many_sites_ends_with_one_line_as_a_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "plexus", "demo", "--sites", "9", "--workdir", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.rstrip("\n").split("\n")[-1] == (
        "plexus demo: error: argument --sites: 9 is out of range: it must be between 1 and 4 (one site per "
        "hospital in the data)"), done.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("variable, value, says", [
    ("PLEXUS_LOG_FORMAT", "xml", "--log-format (or PLEXUS_LOG_FORMAT) is 'xml'; use one of: text, json"),
    ("PLEXUS_LOG", "LOUD", "PLEXUS_LOG is 'LOUD'; use one of: DEBUG, INFO, WARNING, ERROR, CRITICAL"),
])
def test_a_bad_log_setting_in_the_environment_is_a_usage_error(variable, value, says, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        cli(["pki", "init", str(tmp_path / "fed"), "--federation", "f"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and says in err, err
    assert not (tmp_path / "fed").exists()


def test_a_file_where_a_folder_belongs_is_one_line_and_burns_no_name(tmp_path, capsys):
    """An OSError a command meets is one line naming the path, not a traceback; a site whose kit folder cannot be
    made is refused before its certificate is recorded, so the name can be issued once the way is clear."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    assert cli(["pki", "init", str(in_the_way / "fed"), "--federation", "f"]) == 1
    assert capsys.readouterr().err == f"error: {in_the_way / 'fed'}: Not a directory\n"
    root = tmp_path / "fed"
    assert cli(["pki", "init", str(root), "--federation", "f"]) == 0
    (root / "sites").mkdir(exist_ok=True)
    (root / "sites" / "z").write_text("")
    assert cli(["pki", "add-site", str(root), "z"]) == 1
    assert "cannot make the kit folder" in capsys.readouterr().err
    assert "z" not in (root / "federation.json").read_text()
    (root / "sites" / "z").unlink()
    assert cli(["pki", "add-site", str(root), "z"]) == 0
    assert (root / "sites" / "z" / "key.pem").is_file()


def test_a_round_config_that_is_not_utf8_is_refused_before_any_call(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_bytes(b"\xff\xfe")
    assert cli(["job", "submit", str(job), "--coordinator", "127.0.0.1:1", "--kit", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: {job}: a round config is UTF-8 text; save it as UTF-8\n"
