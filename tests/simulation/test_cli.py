"""`plexus simulate` from the command line: site files or a partitioned dataset, and the state dir the admin
commands then read with --state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from plexus.cli import main
from plexus.config import DatasetSpec, PolicySpec, SiteConfig, dump_site_config
from simulation.simulator import final_model

JOB = """\
name: cli-{name}
model: {{name: logistic, args: {{in_features: {features}, num_classes: 2}}}}
data: {data}
rounds: {rounds}
sites: {{min: {sites}, deadline_s: 60}}
train: {{epochs: 1, batch_size: 8, optimizer: {{name: sgd, lr: 0.1}}}}
seed: 5
"""
HEART = JOB.format(name="heart", features=13, data="{dataset: heart-disease}", sites=2, rounds=2)
TOY = JOB.format(name="toy", features=3, sites=200, rounds=1, data="""
  dataset: toy
  label: {column: y, classes: ["0", "1"]}
  features: [{name: x1}, {name: x2}, {name: x3}]""")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def site_file(folder: Path, name: str, hospital: str) -> Path:
    config = SiteConfig(site=name, coordinator="hospital.example.org:8443", kit=Path("kits") / name,
                        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=hospital)},
                        policy=PolicySpec(allowed_models=("logistic",)))
    return write(folder / f"{name}.yaml", dump_site_config(config))


def toy_csv(path: Path, rows: int = 1200) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3)).round(4)
    y = (x @ [1.0, -2.0, 0.5] > 0).astype(int)
    return write(path, "x1,x2,x3,y\n" + "".join(f"{a},{b},{c},{t}\n" for (a, b, c), t in zip(x, y)))


def test_site_files_simulate_and_the_admin_commands_read_the_state_dir(tmp_path, capsys):
    job = write(tmp_path / "job.yaml", HEART)
    sites = [site_file(tmp_path, "north", "cleveland"), site_file(tmp_path, "south", "hungary")]
    state = tmp_path / "state"
    code = main(["simulate", str(job), "--state", str(state), "--workers", "2",
                 *[arg for site in sites for arg in ("--site", str(site))]])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "round 2 round_closed: 2 update(s)" in out   # the job's events, as `job watch` prints them
    assert "2 virtual sites in 2 workers" in out
    job_id = next(line.split()[1] for line in out.splitlines() if line.startswith("job cli-heart-"))

    assert main(["job", "show", "--state", str(state), job_id]) == 0
    shown = capsys.readouterr().out
    assert "status: completed" in shown and "round 2/2" in shown
    assert main(["job", "download", "--state", str(state), job_id, "-o", str(tmp_path / "model.safetensors")]) == 0
    downloaded = load_file(str(tmp_path / "model.safetensors"))
    stored = final_model(state, job_id)
    assert {k: v.tobytes() for k, v in downloaded.items()} == {k: v.tobytes() for k, v in stored.items()}


def test_two_hundred_virtual_sites_of_a_partitioned_csv(tmp_path, capsys):
    job = write(tmp_path / "job.yaml", TOY)
    state = tmp_path / "state"
    code = main(["simulate", str(job), "--state", str(state), "--data", f"csv:{toy_csv(tmp_path / 'toy.csv')}",
                 "--label", "y", "--partition", "iid", "--sites", "200", "--workers", "2"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert "round 1 round_closed: 200 update(s), " in out
    assert "job_completed: final model evaluated by 200 site(s)" in out
    assert "200 virtual sites in 2 workers" in out
    assert len(list((state / "sites").iterdir())) == 200


@pytest.mark.parametrize("args, message", [
    ([], "no sites: give --site"),
    (["--data", "heart-disease", "--site", "x.yaml"], "either --site files or --data"),
    (["--data", "heart-disease", "--ray-address", "10.0.0.1:6379"], "--ray-address needs --backend ray"),
    (["--data", "heart-disease", "--workers", "0"], "--workers must be at least 1"),
    (["--data", "fashion-mnist", "--partition", "dirichlet:-1", "--sites", "4"], "dirichlet"),
    (["--data", "heart-disease", "--sites", "3"], "leave out --partition and --sites"),
])
def test_mistakes_are_named_and_leave_the_state_dir_empty(tmp_path, capsys, args, message):
    job = write(tmp_path / "job.yaml", HEART)
    state = tmp_path / "state"
    state.mkdir()
    code = _exit_code(["simulate", str(job), "--state", str(state), *args])
    assert code in (1, 2)
    assert message in capsys.readouterr().err
    assert not any(state.iterdir())


def test_a_state_dir_in_use_is_refused(tmp_path, capsys):
    job = write(tmp_path / "job.yaml", HEART)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "plexus.db").write_text("")
    assert _exit_code(["simulate", str(job), "--state", str(tmp_path / "state"), "--data", "heart-disease"]) == 2
    assert "is not empty; give a new folder" in capsys.readouterr().err


def test_a_job_that_needs_more_sites_than_simulated_is_refused_before_it_starts(tmp_path, capsys):
    job = write(tmp_path / "job.yaml", HEART.replace("min: 2,", "min: 5,"))
    code = _exit_code(["simulate", str(job), "--state", str(tmp_path / "state"), "--data", "heart-disease"])
    assert code == 1
    assert "needs sites.min = 5 sites and the simulation has 4" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:   # argparse's usage errors
        return exc.code


def test_a_split_learning_job_is_refused_with_where_to_run_it(tmp_path, capsys):
    split = HEART.replace("name: logistic, args: {in_features: 13,", "name: mlp, args: {in_features: 13, hidden: [8],")
    split = split.replace("train: {epochs: 1, ", "train: {")
    split += "mode: split\nsplit: {variant: vanilla, cuts: [hidden1]}\n"
    job = write(tmp_path / "job.yaml", split)
    assert _exit_code(["simulate", str(job), "--state", str(tmp_path / "state"), "--data", "heart-disease"]) == 1
    assert "is split learning (mode: split), which `plexus simulate` does not run yet" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()
