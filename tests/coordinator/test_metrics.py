"""Prometheus metrics: event bookkeeping by hand, then a real job scraped over HTTP."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.events import Event
from coordinator.metrics import RECENT_JOBS, CoordinatorMetrics, latest_global
from coordinator.server import Coordinator
from plexus.config import CoordinatorConfig
from plexus.errors import Reason
from plexus.health import check
from plexus.proto.plexus.v1 import admin_pb2, admin_pb2_grpc

from integration.harness import heart_job, wait_until


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the live /metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class _Store:
    def __init__(self, jobs=(), metrics=()):
        self._jobs, self._metrics = list(jobs), list(metrics)

    def sites(self):
        return [("a",), ("b",), ("c",)]

    def jobs(self):
        return self._jobs

    def metrics(self, job_id):
        return self._metrics


def _value(m: CoordinatorMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_round_counters_and_durations_follow_the_events():
    now = [100.0]
    m = CoordinatorMetrics(store=_Store(), online_sites=lambda: {"a", "b"}, monotonic=lambda: now[0])
    for event, advance in ((("j", "round_opened", 1, "", "train"), 2.0), (("j", "round_closed", 1, "", "ok"), 0),
                           (("j", "round_opened", 2, "", "train"), 0.5), (("j", "job_failed", 2, "", "quorum"), 0),
                           (("k", "round_opened", 3, "", "evaluate"), 1.0), (("k", "job_completed", 3, "", ""), 0)):
        m.on_event(Event(*event, round_kind=event[4]) if event[1] == "round_opened" else Event(*event))
        now[0] += advance
    assert _value(m, "plexus_rounds_opened_total", kind="train") == 2
    assert _value(m, "plexus_rounds_closed_total", kind="train") == 1
    assert _value(m, "plexus_rounds_failed_total", kind="train") == 1
    assert _value(m, "plexus_rounds_closed_total", kind="evaluate") == 1
    assert _value(m, "plexus_round_duration_seconds_sum", kind="train", outcome="closed") == 2.0
    assert _value(m, "plexus_round_duration_seconds_sum", kind="train", outcome="failed") == 0.5
    assert _value(m, "plexus_round_duration_seconds_count", kind="evaluate", outcome="closed") == 1
    assert _value(m, "plexus_jobs_total", event="failed") == 1
    assert _value(m, "plexus_sites_online") == 2 and _value(m, "plexus_sites_known") == 3
    # A job event with no round open (abort of a queued job) counts no round.
    m.on_event(Event("q", "job_aborted", 0, "", "by ops"))
    assert _value(m, "plexus_rounds_failed_total", kind="train") == 1
    # The round's kind is its field, never its message.
    m.on_event(Event("x", "round_opened", 4, "", "evaluate", round_kind="train"))
    assert _value(m, "plexus_rounds_opened_total", kind="train") == 3
    assert _value(m, "plexus_rounds_opened_total", kind="evaluate") == 1


@pytest.mark.parametrize(("message", "code", "reason"), [
    ("tensor 'linear.weight' contains NaN or Inf; refusing the update", Reason.NON_FINITE, "non_finite"),
    ("stream ended after 10 of 112 bytes; the update is incomplete", Reason.SIZE, "size"),
    ("update tensor 'linear.weight' is F32[3, 13]; the job's model has F32[2, 13]", Reason.LAYOUT, "layout"),
    ("num_samples must be between 1 and 2**31; got 0", Reason.NUM_SAMPLES, "num_samples"),
    ("eval_metrics['x'] must have a 1-64 character name and a finite value", Reason.METRICS, "metrics"),
    ("something new", None, "other"),
])
def test_rejections_are_labelled_by_their_reason_code(message, code, reason):
    m = CoordinatorMetrics(store=_Store(), online_sites=set)
    m.on_event(Event("j", "site_rejected", 1, "evil", message, reason=code))
    assert _value(m, "plexus_updates_rejected_total", reason=reason) == 1
    assert _value(m, "plexus_site_results_total", outcome="rejected") == 1


def test_the_staleness_histogram_counts_every_buffered_update_in_its_bucket():
    m = CoordinatorMetrics(store=_Store(), online_sites=set)
    for tau in (0, 0, 1, 2, 3, 5, 7, 9, 13, 20):   # the last one trained for a secure cohort
        kind = "site_trained" if tau == 20 else "site_buffered"
        m.on_event(Event("j", kind, 1, "a", "in the buffer", actor="site:a", staleness=tau))
    m.on_event(Event("j", "site_rejected", 1, "b", "too old", reason=Reason.STALE))
    text = generate_latest(m.registry).decode()
    buckets = [line for line in text.splitlines() if line.startswith("plexus_async_update_staleness_")
               and "_created" not in line]
    assert buckets == [
        'plexus_async_update_staleness_bucket{job="j",le="0.0"} 2.0',
        'plexus_async_update_staleness_bucket{job="j",le="1.0"} 3.0',
        'plexus_async_update_staleness_bucket{job="j",le="2.0"} 4.0',
        'plexus_async_update_staleness_bucket{job="j",le="3.0"} 5.0',
        'plexus_async_update_staleness_bucket{job="j",le="4.0"} 5.0',
        'plexus_async_update_staleness_bucket{job="j",le="6.0"} 6.0',
        'plexus_async_update_staleness_bucket{job="j",le="8.0"} 7.0',
        'plexus_async_update_staleness_bucket{job="j",le="12.0"} 8.0',
        'plexus_async_update_staleness_bucket{job="j",le="16.0"} 9.0',
        'plexus_async_update_staleness_bucket{job="j",le="+Inf"} 10.0',
        'plexus_async_update_staleness_count{job="j"} 10.0',
        'plexus_async_update_staleness_sum{job="j"} 60.0']
    assert "# TYPE plexus_async_update_staleness histogram" in text
    # A stale refusal is a rejected update with its reason code, on the counter every refusal is on.
    assert 'plexus_updates_rejected_total{reason="stale"} 1.0' in text
    assert 'plexus_site_results_total{outcome="buffered"} 9.0' in text
    assert 'plexus_site_results_total{outcome="trained"} 1.0' in text


def test_staleness_series_are_kept_for_running_jobs_and_the_recently_ended_ones():
    m = CoordinatorMetrics(store=_Store(), online_sites=set)

    def count(job: str):
        return m.registry.get_sample_value("plexus_async_update_staleness_count", {"job": job})

    jobs = [f"j{i}" for i in range(RECENT_JOBS + 2)]
    for job in jobs:
        m.on_event(Event(job, "site_buffered", 1, "a", "", staleness=1))
    m.on_event(Event("sync", "job_completed", 2, "", "done"))   # no series: ending it removes nothing
    for job in jobs[:-1]:
        m.on_event(Event(job, "job_completed", 2, "", "done"))
    assert count(jobs[0]) is None and count(jobs[1]) == 1 and count(jobs[-1]) == 1
    m.on_event(Event(jobs[1], "site_buffered", 2, "a", "", staleness=0))   # resumed: running again
    m.on_event(Event(jobs[-1], "job_failed", 2, "", "no site answered"))
    assert count(jobs[1]) == 2 and count(jobs[2]) == 1 and count(jobs[-1]) == 1


def test_latest_global_metric_is_the_newest_evaluated_round_weighted_by_rows():
    rows = [(0, "a", "eval", "accuracy", 0.5), (0, "a", "eval", "num_samples", 10.0),
            (1, "a", "eval", "accuracy", 0.9), (1, "a", "eval", "num_samples", 30.0),
            (1, "b", "eval", "accuracy", 0.5), (1, "b", "eval", "num_samples", 10.0),
            (1, "a", "train", "train_loss", 0.3)]
    assert latest_global(rows) == (1, {"accuracy": pytest.approx(0.8)})
    assert latest_global([(1, "a", "train", "train_loss", 0.3)]) is None


def test_a_real_job_scraped_over_http(federation):
    """Two honest sites and one sending NaN; then /metrics tells the story of the job."""
    server = federation.coordinator.metrics.serve("127.0.0.1:0")
    stop = threading.Event()
    try:
        federation.start_site("a")
        federation.start_site("b")
        attacker = federation.raw_site("c")
        attacker.join()
        federation.wait_online("a", "b", "c")
        job_id = federation.admin().submit(heart_job(rounds=2, min=2)).job_id
        task = attacker.next_task()
        _, state = attacker.fetch(task)
        state["linear.weight"][0, 0] = np.nan
        with pytest.raises(grpc.RpcError):
            attacker.submit(task, state)
        attacker.answer_everything_with_failure(stop)
        assert federation.wait_job(job_id) == "completed"
        # The metrics hear of an event just after the store commits it (Store.subscribe), so the job's status can
        # be read a moment before its last event is counted.
        got = wait_until(lambda: (m := scrape(server.port)).get(
            ("plexus_rounds_closed_total", (("kind", "evaluate"),))) == 1 and m, 10, "the final evaluation counted")
    finally:
        stop.set()
        server.stop()
    model_bytes = sum(v.nbytes for v in federation.store.load_checkpoint(job_id, 2).values())
    assert got[("plexus_rounds_opened_total", (("kind", "train"),))] == 2
    assert got[("plexus_rounds_closed_total", (("kind", "train"),))] == 2
    assert got[("plexus_rounds_closed_total", (("kind", "evaluate"),))] == 1
    assert got[("plexus_rounds_failed_total", (("kind", "train"),))] == 0
    assert got[("plexus_round_duration_seconds_count", (("kind", "train"), ("outcome", "closed")))] == 2
    assert got[("plexus_round_duration_seconds_sum", (("kind", "train"), ("outcome", "closed")))] > 0
    assert got[("plexus_updates_rejected_total", (("reason", "non_finite"),))] == 1
    assert got[("plexus_site_results_total", (("outcome", "submitted"),))] == 4
    # In: the four accepted updates plus the attacker's, which streamed in full before the NaN was found.
    assert got[("plexus_model_bytes_total", (("direction", "in"),))] == 5 * model_bytes
    # Out: every task fetched the model (2 train rounds + the final evaluation, for each participant).
    assert got[("plexus_model_bytes_total", (("direction", "out"),))] % model_bytes == 0
    assert got[("plexus_model_bytes_total", (("direction", "out"),))] >= 7 * model_bytes
    assert got[("plexus_sites_online", ())] == 3
    assert got[("plexus_job_round", (("job", job_id), ("status", "completed")))] == 2
    assert got[("plexus_job_global_metric_round", (("job", job_id),))] == 2
    assert 0.5 < got[("plexus_job_global_metric", (("job", job_id), ("name", "accuracy")))] <= 1.0


def test_config_turns_on_metrics_and_a_health_only_port(pki_root, tmp_path):
    coordinator = Coordinator(CoordinatorConfig(
        listen="127.0.0.1:0", kit=pki_root / "coordinator", state_dir=tmp_path / "state",
        metrics_listen="127.0.0.1:0", health_listen="127.0.0.1:0", poll_timeout_s=1.0, max_workers=8))
    not_yet = coordinator.health.Check(health_pb2.HealthCheckRequest(service=""), None).status
    assert not_yet == health_pb2.HealthCheckResponse.NOT_SERVING   # until the engine runs
    coordinator.start()
    try:
        health = f"127.0.0.1:{coordinator.health_port}"
        assert check(health, plaintext=True) == "SERVING"
        assert check(health, plaintext=True, service="plexus.v1.Federation") == "SERVING"
        with pytest.raises(ValueError, match="plaintext explicitly"):
            check(health)
        # The main port answers health too, but only over mTLS.
        assert check(f"127.0.0.1:{coordinator.port}", kit=pki_root / "sites" / "a") == "SERVING"
        # The plaintext port serves health and nothing else.
        with grpc.insecure_channel(health) as channel:
            with pytest.raises(grpc.RpcError) as err:
                admin_pb2_grpc.AdminStub(channel).ListJobs(admin_pb2.ListJobsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        got = scrape(coordinator.metrics_port)
        assert got[("plexus_sites_online", ())] == 0
        assert got[("plexus_rounds_opened_total", (("kind", "train"),))] == 0
    finally:
        coordinator.stop(grace=0.5)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{coordinator.metrics_port}/metrics", timeout=2)


def test_metrics_and_health_are_off_by_default(federation):
    assert federation.coordinator.metrics_port is None and federation.coordinator.health_port is None
