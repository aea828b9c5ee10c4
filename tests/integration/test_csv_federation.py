"""CSV sites over real mTLS: a declared schema aligns classes and columns, a site that cannot meet it declines."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from plexus.config import DatasetSpec, PolicySpec, SiteConfig
from site_agent.agent import SiteAgent

TRIAGE = Path(__file__).resolve().parents[2] / "examples" / "triage"


def _start(federation, name: str, datasets: dict[str, DatasetSpec]) -> None:
    config = SiteConfig(site=name, coordinator=federation.address, kit=federation.root / "sites" / name,
                        state_dir=federation.root / "sites" / name / "state", datasets=datasets,
                        policy=PolicySpec(allowed_models=("logistic",)))
    agent = SiteAgent(config, backoff_cap_s=0.5)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    federation.agents.append((agent, thread))   # federation.close() stops and joins it


def test_csv_sites_train_on_the_declared_schema_and_a_mismatch_declines_without_data(federation, tmp_path):
    no_bmi = tmp_path / "ward-c.csv"
    no_bmi.write_text("\n".join(",".join(v for i, v in enumerate(line.split(",")) if i != 4)
                                for line in (TRIAGE / "ward-a.csv").read_text().splitlines()) + "\n")
    _start(federation, "a", {"triage": DatasetSpec(kind="csv", path=TRIAGE / "ward-a.csv", label="outcome")})
    _start(federation, "b", {"triage": DatasetSpec(kind="csv", path=TRIAGE / "ward-b.csv", label="outcome",
                                                   delimiter=";")})
    _start(federation, "c", {"triage": DatasetSpec(kind="csv", path=no_bmi, label="outcome"),
                             "old": DatasetSpec(kind="csv", path=tmp_path / "gone.csv", label="outcome")})
    federation.wait_online("a", "b", "c")

    advertised = {s.name: json.loads(s.datasets) for s in federation.store.sites()}
    assert advertised["c"] == ["triage"]   # "old" does not load, so it is not advertised
    assert advertised["b"] == ["triage"]

    job = (TRIAGE / "triage-fedavg.yaml").read_text().replace("rounds: 10", "rounds: 2").replace(
        "deadline_s: 60", "deadline_s: 30")
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id, timeout=120) == "completed"

    declines = federation.store.declines(job_id)
    assert declines == {"c": "dataset 'triage': missing column(s) ['bmi']; the file's columns the job does not "
                             "declare (left unused): ['patient_id']"}
    rounds = federation.admin().job(job_id).rounds
    assert {1, 2} <= {r.round for r in rounds}
    assert all(set(r.contributors) == {"a", "b"} for r in rounds)   # c never trained on its file
