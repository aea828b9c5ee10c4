"""`plexus site check`: a local dry run of what a site advertises and what it would tell the coordinator."""

from __future__ import annotations

import shutil
from pathlib import Path

from plexus.cli import main as cli

TRIAGE = Path(__file__).resolve().parents[2] / "examples" / "triage"
JOB = TRIAGE / "triage-fedavg.yaml"


def _check(capsys, *args) -> tuple[int, str]:
    code = cli(["site", "check", *map(str, args)])
    return code, capsys.readouterr().out


def test_the_example_raw_file_is_accepted_and_its_id_column_left_out(capsys):
    code, out = _check(capsys, "--config", TRIAGE / "site-ward-a.yaml", "--job", JOB)
    assert code == 0, out
    assert "    patient_id  text: 12 distinct ('A-101' x1," in out
    assert "    bmi         numeric, 2 empty" in out
    assert "  advertised at Join with 7 training rows" in out
    assert ("  declared features (7 model inputs): age numeric (x - 60) / 20; bmi numeric (x - 26) / 5, empty -> 26; "
            "sex one-hot [F, M]; ward one-hot [cardio, general, ortho]") in out
    assert "  columns in the file that are not features (left unused): ['patient_id']" in out
    assert "  this site accepts the job: 7 training rows, 5 test rows, model input shape (7,), 3 classes" in out


def test_a_reordered_semicolon_file_without_a_class_is_accepted_with_the_declared_indices(capsys):
    code, out = _check(capsys, "--config", TRIAGE / "site-ward-b.yaml", "--job", JOB)
    assert code == 0, out
    assert "  declared label 'outcome': home=0, readmitted=1, icu=2" in out
    assert "  training rows per class: home 2, readmitted 3, icu 0" in out


def test_a_wrong_delimiter_flag_shows_the_dataset_would_not_be_advertised(capsys):
    code, out = _check(capsys, "--config", TRIAGE / "site-ward-b.yaml", "--delimiter", ",")
    assert code == 1
    assert "  NOT advertised at Join: it does not load:" in out
    assert "(the header looks ';'-separated: set the dataset's `delimiter: ';'`)" in out


def test_a_missing_column_prints_the_decline_and_keeps_the_detail_local(tmp_path, capsys):
    lines = (TRIAGE / "ward-a.csv").read_text().splitlines()
    cut = [",".join(v for i, v in enumerate(line.split(",")) if i != 4) for line in lines]   # drop bmi
    (tmp_path / "ward.csv").write_text("\n".join(cut) + "\n", encoding="latin-1")
    (tmp_path / "site.yaml").write_text(
        "site: ward-c\ncoordinator: 'c.example.org:8443'\nkit: kit\n"
        "datasets:\n  triage: {kind: csv, path: ward.csv, label: outcome, encoding: latin-1}\n")
    code, out = _check(capsys, "--config", tmp_path / "site.yaml", "--job", JOB)
    assert code == 1
    assert ("  this site DECLINES the job; the coordinator is told:\n"
            "    dataset 'triage': missing column(s) ['bmi']; the file's columns the job does not declare "
            "(left unused): ['patient_id']\n"
            "  detail (stays at this site):\n"
            f"    {tmp_path / 'ward.csv'}: missing column(s) ['bmi']; the file's columns: "
            "['patient_id', 'age', 'sex', 'ward', 'outcome']") in out


def test_a_dataset_that_does_not_load_is_reported_not_advertised(tmp_path, capsys):
    shutil.copy(TRIAGE / "ward-a.csv", tmp_path / "ward.csv")
    (tmp_path / "site.yaml").write_text(
        "site: ward-d\ncoordinator: 'c.example.org:8443'\nkit: kit\ndatasets:\n"
        "  triage: {kind: csv, path: ward.csv, label: outcome}\n"
        "  old: {kind: csv, path: gone.csv, label: outcome}\n")
    code, out = _check(capsys, "--config", tmp_path / "site.yaml")
    assert code == 1
    assert f"dataset 'old': kind csv, file {tmp_path / 'gone.csv'}\n  NOT advertised at Join" in out
    assert "dataset 'triage': kind csv" in out and "  advertised at Join with 7 training rows" in out
    code, out = _check(capsys, "--config", tmp_path / "site.yaml", "--dataset", "triage", "--encoding", "cp1252")
    assert code == 0 and "encoding cp1252" in out


def test_an_emulated_slowdown_is_printed_first(tmp_path, capsys):
    shutil.copy(TRIAGE / "ward-a.csv", tmp_path / "ward.csv")
    (tmp_path / "site.yaml").write_text(
        "site: ward-e\ncoordinator: 'c.example.org:8443'\nkit: kit\nemulation: {slowdown: 5}\n"
        "datasets:\n  triage: {kind: csv, path: ward.csv, label: outcome}\n")
    code, out = _check(capsys, "--config", tmp_path / "site.yaml")
    assert code == 0
    assert out.startswith("site ward-e: datasets ['triage']\nEMULATION ONLY: emulation.slowdown 5 stretches every "
                          "training task; remove `emulation:` at any real site (docs/install-site.md)\n")


def test_a_training_team_is_printed(tmp_path, capsys):
    shutil.copy(TRIAGE / "ward-a.csv", tmp_path / "ward.csv")
    (tmp_path / "site.yaml").write_text(
        "site: ward-f\ncoordinator: 'c.example.org:8443'\nkit: kit\n"
        "training: {workers: 2, nodes: {count: 3, rank: 0, address: '10.0.0.5:29500'}}\n"
        "datasets:\n  triage: {kind: csv, path: ward.csv, label: outcome}\n")
    code, out = _check(capsys, "--config", tmp_path / "site.yaml")
    assert code == 0
    assert ("training: 2 gloo workers on cpu per node, 6 in all on 3 nodes (this is node 0; rendezvous "
            "10.0.0.5:29500); DP-SGD jobs are declined (docs/install-site.md)\n") in out


STATISTICS = """\
name: ward-stats
kind: statistics
data: {dataset: triage}
statistics:
  columns:
    - {name: age, range: [0, 100], bins: 4}
    - {name: bmi}
  group_by: {column: sex, categories: [F, M]}
sites: {min: 3}
"""


def _site(tmp_path, entry: str, policy: str = "") -> Path:
    shutil.copy(TRIAGE / "ward-a.csv", tmp_path / "ward-a.csv")
    (tmp_path / "stats.yaml").write_text(STATISTICS)
    (tmp_path / "site.yaml").write_text("site: ward-a\ncoordinator: 'c.example.org:8443'\nkit: kit\n"
                                        f"datasets:\n  triage: {{kind: csv, path: ward-a.csv{entry}}}\n{policy}")
    return tmp_path / "site.yaml"


def test_a_csv_without_label_is_shown_as_for_statistics_jobs_only(tmp_path, capsys):
    site = _site(tmp_path, "")
    code, out = _check(capsys, "--config", site)
    assert code == 0, out
    assert "  12 data rows, encoding utf-8, delimiter ','; no label: statistics jobs only\n" in out
    assert "    outcome     text: 3 distinct ('home' x5, 'readmitted' x4, 'icu' x3)" in out
    assert "  advertised at Join with 12 rows (all of them: statistics jobs read every row)" in out

    code, out = _check(capsys, "--config", site, "--job", tmp_path / "stats.yaml")
    assert code == 0, out
    assert "statistics job 'ward-stats' of columns ['age', 'bmi'] by 'sex' uses dataset 'triage'" in out
    assert "  this site accepts the job: its sums over 12 rows (every row)" in out

    code, out = _check(capsys, "--config", site, "--job", JOB)
    assert code == 1
    assert ("  this site DECLINES the job; the coordinator is told:\n"
            "    dataset 'triage': it serves statistics jobs only at this site: its entry in site.yaml names no "
            "label column; to train on it, the site adds `label: COLUMN` to the dataset in site.yaml\n") in out


def test_a_statistics_job_is_checked_as_the_site_half_reads_it(tmp_path, capsys):
    # With a label too: a statistics job reads the raw columns, it declares no training schema.
    code, out = _check(capsys, "--config", _site(tmp_path, ", label: outcome"), "--job", tmp_path / "stats.yaml")
    assert code == 0, out
    assert "  this site accepts the job: its sums over 12 rows (every row)" in out

    (tmp_path / "stats.yaml").write_text(STATISTICS.replace("{name: bmi}", "{name: weight}"))
    code, out = _check(capsys, "--config", tmp_path / "site.yaml", "--job", tmp_path / "stats.yaml")
    assert code == 1
    assert ("  this site DECLINES the job; the coordinator is told:\n"
            "    dataset 'triage' does not match the job's statistics columns: missing column(s) 'weight'\n") in out

    code, out = _check(capsys, "--config", _site(tmp_path, "", "policy: {min_cell_count: 2}\n"),
                       "--job", tmp_path / "stats.yaml")
    assert code == 1
    assert ("    dataset 'triage': 4 cell(s) would hold 1 to 1 rows, fewer than this site's min_cell_count 2 (empty "
            "cells are fine): min and max of the numeric columns") in out
    assert "; sex=F / age / histogram [25, 50); sex=F / bmi / missing; sex=M / bmi / missing\n" in out
