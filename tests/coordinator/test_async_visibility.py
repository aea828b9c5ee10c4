"""What an operator sees of an asynchronous job: `plexus job show` and `job watch` rendered from the rows the
real AsyncRounds writes (a Store in tmp_path, the admin service's JobDetail, no gRPC), and the Prometheus
staleness histogram fed by the same store's events."""

from __future__ import annotations

import json

import numpy as np
import pytest
from driver_rig import DriverRig, rigs
from prometheus_client import generate_latest

from coordinator.drivers.async_ import AsyncRounds
from coordinator.metrics import CoordinatorMetrics
from coordinator.service import job_detail, job_summary
from coordinator.tasks import Binding, TaskResult
from plexus.cli.admin import follow, print_job
from plexus.config import parse_round_config
from plexus.errors import Stale
from plexus.proto.plexus.v1 import admin_pb2
from plexus.vocab import TaskStatus

JOB = """\
name: fedbuff
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: {versions}
sites: {{min: 1, deadline_s: 60}}
strategy: {{name: fedavg}}
asynchronous: {{buffer: 2, max_staleness: 1, staleness: {{fn: polynomial, a: 0.5}}}}
seed: 0
"""


class Rig(DriverRig):
    """The asynchronous driver over a real store, a clock that moves only when told, metrics subscribed."""

    driver_class = AsyncRounds

    def __init__(self, path, *, versions: int = 3, job: str = JOB):
        self.metrics = None
        self.asynchronous = parse_round_config(job.format(versions=versions)).asynchronous is not None
        super().__init__(path, job.format(versions=versions), store_clock=True)

    def take_up(self):
        if self.metrics is None:   # subscribed before the driver's first event
            self.metrics = CoordinatorMetrics(store=self.store, online_sites=set, monotonic=lambda: self.now)
            self.store.subscribe(self.metrics.on_event)
        return super().take_up() if self.asynchronous else None

    def start(self, *sites: str) -> dict:
        self.join(*sites)
        self.driver.tick(self.now)
        return {s: self.driver.grant(s) for s in sites}

    def send(self, site: str, grant, value: float, num_samples: int = 100) -> str:
        """An update of `value` everywhere, a second after the last."""
        self.now += 1.0
        return super().send(site, grant, np.full(4, value), num_samples=num_samples, metrics={"train_loss": 0.5})

    def evaluate(self, site: str, accuracy: float) -> None:
        grant = self.driver.grant(site)
        self.driver.answered(site, grant, TaskResult(Binding(grant.task_id, self.job_id, grant.round, grant.nonce),
                                                     TaskStatus.EVALUATED,
                                                     eval_metrics={"accuracy": accuracy, "num_samples": 10}))

    def detail(self) -> admin_pb2.JobDetail:
        return job_detail(self.store, self.job_id)

    def staleness_text(self) -> list[str]:
        return [line for line in generate_latest(self.metrics.registry).decode().splitlines()
                if line.startswith("plexus_async_update_staleness") and f'job="{self.job_id}"' in line]


@pytest.fixture
def rig(tmp_path):
    yield from rigs(tmp_path, Rig)


def three_versions(r: Rig, *, finish: bool = True) -> None:
    """v1 from a, b (τ 0, 0); v2 from a (τ 0) and c (τ 1); d (τ 2) refused as stale; v3 from a (τ 0), b (τ 1);
    then every site evaluates version 3 and the job completes."""
    g = r.start("a", "b", "c", "d")
    r.send("a", g["a"], 1.0)
    r.send("b", g["b"], 1.0)
    b1 = r.driver.grant("b")
    r.send("a", r.driver.grant("a"), 2.0)
    r.send("c", g["c"], 2.0)
    with pytest.raises(Stale):
        r.send("d", g["d"], 9.0)
    r.send("a", r.driver.grant("a"), 3.0)
    if finish:
        r.send("b", b1, 3.0)
        for site, accuracy in (("a", 0.75), ("b", 0.8), ("c", 0.85), ("d", 0.9)):
            r.evaluate(site, accuracy)
        r.driver.tick(r.now)


# job show ------------------------------------------------------------------------------------
def _section(out: str, heading: str) -> list[list[str]]:
    """The whitespace-split lines of the block under the line starting with `heading`, up to a blank line."""
    lines = out[out.index(heading):].split("\n\n")[0].splitlines()[1:]
    return [line.split() for line in lines]


def test_job_show_of_an_asynchronous_job_has_its_mode_versions_sites_and_staleness_histogram(rig, capsys):
    r = rig()
    three_versions(r)
    print_job(r.detail())
    out = capsys.readouterr().out
    assert out.startswith(f"job {r.job_id}  (fedbuff, fedavg)  status: completed  version 3 of 3\n"
                          "  asynchronous: buffer 2, max staleness 1, staleness polynomial (a=0.5)\n")
    assert _section(out, "versions (") == [
        ["version", "status", "updates", "sites", "samples", "staleness_mean", "refused_stale", "secs",
         "eval_accuracy"],
        ["1", "closed", "2", "2", "200", "0.00", "0", "2.00"],
        ["2", "closed", "2", "2", "200", "0.50", "0", "2.00"],
        ["3", "closed", "2", "2", "200", "0.50", "1", "3.00"],
        ["4", "closed", "(evaluation)", "0.00", "0.8250"]]   # the final evaluation, of version 3
    assert _section(out, "sites (") == [["site", "contributions", "refused_stale"], ["a", "3", "0"],
                                        ["b", "2", "0"], ["c", "1", "0"], ["d", "0", "1"]]
    assert "\nstaleness of the updates in versions 1-3 (versions behind the newest when taken in):\n" \
           f"  0  {'#' * 40}  4\n" \
           f"  1  {'#' * 20 + ' ' * 20}  2\n" in out
    assert _section(out, "sites that did not contribute:")[1][:3] == ["0", "d", "rejected"]
    assert "buffer of version" not in out and "round 3/3" not in out


def test_job_show_json_adds_the_asynchronous_view_to_the_detail(rig, capsys):
    r = rig()
    three_versions(r)
    print_job(r.detail(), as_json=True)
    out = json.loads(capsys.readouterr().out)
    view = out.pop("asynchronous")
    assert set(out) == {"summary", "config_yaml", "rounds", "site_events", "metrics"}   # the detail, as before
    assert view["mode"]["buffer"] == 2 and view["mode"]["max_staleness"] == 1
    assert view["mode"]["staleness"] == {"fn": "polynomial", "a": 0.5, "b": 4.0}
    assert (view["version"], view["versions"], view["refused_stale"]) == (3, 3, 1)
    assert view["sites"] == [{"site": "a", "contributions": 3, "refused_stale": 0},
                             {"site": "b", "contributions": 2, "refused_stale": 0},
                             {"site": "c", "contributions": 1, "refused_stale": 0},
                             {"site": "d", "contributions": 0, "refused_stale": 1}]
    assert view["staleness"] == [{"staleness": 0, "updates": 4}, {"staleness": 1, "updates": 2}]
    assert view["buffer"] == {"version": 4, "updates": []}


def test_a_running_jobs_buffered_update_is_waiting_not_missing(rig, capsys):
    r = rig()
    three_versions(r, finish=False)   # a's update from version 2 sits in the buffer of version 3
    print_job(r.detail())
    out = capsys.readouterr().out
    assert "status: running  version 2 of 3\n" in out
    assert "\nbuffer of version 3: 1 of 2 updates (a from version 2)\n" in out
    assert ["3", "open"] in _section(out, "versions (")              # no figures before its flush
    assert [row[1:3] for row in _section(out, "sites that did not contribute:")[1:]] == [["d", "rejected"]]
    print_job(r.detail(), as_json=True)
    assert json.loads(capsys.readouterr().out)["asynchronous"]["buffer"] == {
        "version": 3, "updates": [{"site": "a", "from_version": 2}]}


def test_a_synchronous_job_is_shown_by_rounds_as_before(rig, capsys):
    r = rig(job="\n".join(line for line in JOB.splitlines() if not line.startswith("asynchronous")) + "\n")
    r.store.set_job(r.job_id, status="running")
    r.store.open_round(r.job_id, 1, "train")
    r.store.record_metrics(r.job_id, {(0, "a", "eval", "accuracy"): 0.5})
    r.store.close_round(r.job_id, 1, status="closed", contributors=["a", "b"], total_samples=200, message="",
                        job_update={"current_round": 1})
    print_job(r.detail())
    assert capsys.readouterr().out == (
        f"job {r.job_id}  (fedbuff, fedavg)  status: running  round 1/3\n"
        "\nrounds (eval_* = the incoming global model on the sites' held-out rows):\n"
        "round  status  sites  samples  secs  eval_accuracy\n"
        "1      closed  2      200      0.00  0.5000\n")
    print_job(r.detail(), as_json=True)
    assert "asynchronous" not in json.loads(capsys.readouterr().out)


# job watch -----------------------------------------------------------------------------------
class Watching:
    """An AdminClient as `follow` uses it, answered from the store."""

    def __init__(self, r: Rig):
        self.r = r

    def job(self, job_id: str) -> admin_pb2.JobDetail:
        return job_detail(self.r.store, job_id)

    def watch(self, job_id: str):
        summary = job_summary(self.r.store.job(job_id))
        for e in self.r.store.events_after(job_id, 0):
            yield admin_pb2.JobEvent(unix_s=e.at, kind=e.kind, round=e.round, site=e.site, message=e.message,
                                     summary=summary)


def _lines(out: str) -> list[str]:
    return [line.split("] ", 1)[1] if line.startswith("[") else line for line in out.splitlines()]


def test_job_watch_of_an_asynchronous_job_reads_in_versions(rig, capsys):
    r = rig()
    three_versions(r)
    assert follow(Watching(r), r.job_id, as_json=False) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    assert "job_started: 3 versions of fedavg, asynchronously (buffer 2, max staleness 1, staleness polynomial)" \
        in lines
    assert "a: update from version 0 buffered: in the buffer of version 1: staleness 0, weight 100" in lines
    assert "c: update from version 0 buffered: in the buffer of version 2: staleness 1, weight 70.7092" in lines
    first = lines.index("version 1 made: 2 update(s), 200 samples, staleness a=0, b=0")
    assert lines[first + 1:first + 3] == ["    staleness 0:2 (mean 0.00)",
                                          "    sites' local models in version 1: train_loss=0.5000"]
    assert ("d: update from version 0 rejected: the update was computed from version 0, 2 versions old; "
            "asynchronous.max_staleness is 1; the site is given version 2") in lines
    third = lines.index("version 3 made: 2 update(s), 200 samples, staleness a=0, b=1")
    assert lines[third + 1] == "    staleness 0:1 1:1 (mean 0.50); refused as stale while it filled: 1 (d=1)"
    assert "round 4 opened: every online site evaluates the final model" in lines
    assert "round 4 site_evaluated d: " in lines   # the final evaluation's tasks: round V + 1
    assert lines[-2:] == ["job_completed: 3 versions made; final model (version 3) evaluated by 4 site(s)",
                          "    version 3 on the sites' held-out rows: accuracy=0.8250"]


def test_job_watch_json_carries_each_flush(rig, capsys):
    r = rig()
    three_versions(r)
    assert follow(Watching(r), r.job_id, as_json=True) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    flushes = [e["flush"] for e in events if e["kind"] == "round_closed"]
    assert [f["version"] for f in flushes] == [1, 2, 3]
    assert flushes[2] == {"version": 3, "updates": 2, "staleness_mean": 0.5,
                          "staleness": [{"staleness": 0, "updates": 1}, {"staleness": 1, "updates": 1}],
                          "contributions": {"a": 1, "b": 1}, "refused_stale": {"d": 1}}
    assert flushes[0]["staleness"] == [{"staleness": 0, "updates": 2}]


# Prometheus ----------------------------------------------------------------------------------
def test_a_real_asynchronous_job_feeds_the_histogram_and_its_version_gauge(rig):
    r = rig()
    three_versions(r)
    registry = r.metrics.registry
    # τ of the six updates taken in: a 0, b 0, a 0, c 1, a 0, b 1 (d's, τ 2, was refused, never buffered)
    assert [registry.get_sample_value("plexus_async_update_staleness_bucket", {"job": r.job_id, "le": le})
            for le in ("0.0", "1.0", "2.0", "+Inf")] == [4, 6, 6, 6]
    assert registry.get_sample_value("plexus_async_update_staleness_sum", {"job": r.job_id}) == 2
    assert registry.get_sample_value("plexus_updates_rejected_total", {"reason": "stale"}) == 1
    assert registry.get_sample_value("plexus_job_round", {"job": r.job_id, "status": "completed"}) == 3
    assert registry.get_sample_value("plexus_job_rounds", {"job": r.job_id}) == 3
