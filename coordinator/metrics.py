"""Prometheus metrics for the coordinator, fed by store events and the model byte streams.

Each coordinator owns a private CollectorRegistry, so several coordinators in one
process (tests, hierarchical setups) never share or clash on counters. Labels are
bounded: no site names, no free text (a rejection is labelled with its Reason code,
a round with its kind, both set where they happened: never read from a message), and
per-job series only for the few jobs that matter now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from coordinator.events import Event
from plexus.config import split_address
from plexus.errors import Reason

ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)   # τ, in versions (+Inf is added)
RECENT_JOBS = 10   # finished jobs that keep their per-job series, newest first


class CoordinatorMetrics:
    """Counters fed by Store events (`on_event`), byte counters, and gauges read at scrape time."""

    def __init__(self, *, store, online_sites: Callable[[], set[str]], monotonic=time.monotonic):
        self.registry = CollectorRegistry(auto_describe=True)
        self._store, self._online_sites, self._mono = store, online_sites, monotonic
        self._open: dict[str, tuple[int, str, float]] = {}   # job -> (round, kind, opened at)
        self._lock = threading.Lock()
        self.rounds_opened = Counter("plexus_rounds_opened", "Rounds opened", ["kind"], registry=self.registry)
        self.rounds_closed = Counter("plexus_rounds_closed", "Rounds closed with a result", ["kind"],
                                     registry=self.registry)
        self.rounds_failed = Counter("plexus_rounds_failed", "Rounds that failed (quorum, deadline, error)",
                                     ["kind"], registry=self.registry)
        self.round_seconds = Histogram("plexus_round_duration_seconds", "Wall time from open to close of a round",
                                       ["kind", "outcome"], buckets=ROUND_BUCKETS, registry=self.registry)
        self.model_bytes = Counter("plexus_model_bytes", "Model and update payload bytes streamed",
                                   ["direction"], registry=self.registry)
        self.site_results = Counter("plexus_site_results", "Task outcomes reported or recorded for sites",
                                    ["outcome"], registry=self.registry)
        self.rejected = Counter("plexus_updates_rejected", "Site updates rejected, by reason category",
                                ["reason"], registry=self.registry)
        self.jobs = Counter("plexus_jobs", "Job lifecycle events", ["event"], registry=self.registry)
        # Per job, like the gauges: the series of the RECENT_JOBS jobs that ended last are kept, older ones go.
        self.staleness = Histogram("plexus_async_update_staleness",
                                   "Staleness (versions behind the newest) of asynchronous updates taken into a "
                                   "buffer", ["job"], buckets=STALENESS_BUCKETS, registry=self.registry)
        self._series: set[str] = set()   # jobs with a staleness series
        self._ended: list[str] = []      # those of them that ended, oldest first
        for kind in ("train", "evaluate"):
            for c in (self.rounds_opened, self.rounds_closed, self.rounds_failed):
                c.labels(kind)
        for direction in ("in", "out"):
            self.model_bytes.labels(direction)
        for reason in Reason:
            self.rejected.labels(reason.value)
        self.registry.register(_LiveCollector(self))

    # fed by Store.subscribe ---------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        job_id, kind, round_ = event.job_id, event.kind, event.round
        if kind == "round_opened":
            round_kind = event.round_kind or "train"
            with self._lock:
                self._open[job_id] = (round_, round_kind, self._mono())
            self.rounds_opened.labels(round_kind).inc()
        elif kind == "round_closed":
            self._finish(job_id, "closed")
        elif kind == "round_failed":
            self._finish(job_id, "failed")
        elif kind.startswith("job_"):
            self.jobs.labels(kind[4:]).inc()
            self._job_lifecycle(job_id, kind)
            # The engine closes an evaluation round with job_completed and fails a round with job_failed.
            outcome = {"job_completed": "closed", "job_failed": "failed"}.get(kind)
            if outcome:
                self._finish(job_id, outcome)
            else:
                with self._lock:
                    self._open.pop(job_id, None)
        elif kind.startswith("site_"):
            self.site_results.labels(kind[5:]).inc()
            if kind == "site_rejected":
                self.rejected.labels((event.reason or Reason.OTHER).value).inc()
            elif kind in ("site_buffered", "site_trained") and event.staleness is not None:   # trained: cohorts
                with self._lock:
                    self.staleness.labels(job_id).observe(event.staleness)
                    self._started(job_id)

    def _job_lifecycle(self, job_id: str, kind: str) -> None:
        """Keep a job's staleness series while it runs and for the RECENT_JOBS jobs that ended last."""
        with self._lock:
            if kind in ("job_completed", "job_failed", "job_aborted") and job_id in self._series:
                self._started(job_id)
                self._ended.append(job_id)
                while len(self._ended) > RECENT_JOBS:
                    gone = self._ended.pop(0)
                    self._series.discard(gone)
                    self.staleness.remove(gone)

    def _started(self, job_id: str) -> None:
        """The job has a series and is running (again, after a resume): not among the ended ones."""
        self._series.add(job_id)
        if job_id in self._ended:
            self._ended.remove(job_id)

    def _finish(self, job_id: str, outcome: str) -> None:
        with self._lock:
            opened = self._open.pop(job_id, None)
        if opened is None:
            return
        _, kind, at = opened
        (self.rounds_closed if outcome == "closed" else self.rounds_failed).labels(kind).inc()
        self.round_seconds.labels(kind, outcome).observe(max(0.0, self._mono() - at))

    # byte counters ------------------------------------------------------------------------
    def count_out(self, messages: Iterable) -> Iterator:
        """Pass a model stream through, counting its chunk payload bytes."""
        counter = self.model_bytes.labels("out")
        for message in messages:
            if message.WhichOneof("body") == "chunk":
                counter.inc(len(message.chunk.data))
            yield message

    def count_in(self, messages: Iterable) -> Iterator:
        """Pass an update stream through, counting its chunk payload bytes."""
        counter = self.model_bytes.labels("in")
        for message in messages:
            if message.WhichOneof("body") == "chunk":
                counter.inc(len(message.chunk.data))
            yield message

    # exposition ---------------------------------------------------------------------------
    def serve(self, address: str) -> MetricsServer:
        """Serve /metrics over HTTP on address ("host:port"; port 0 picks one)."""
        host, port = split_address(address)
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(httpd, thread)


class MetricsServer:
    """The running /metrics endpoint; `port` is the bound port."""

    def __init__(self, httpd, thread: threading.Thread):
        self._httpd, self._thread = httpd, thread
        self.port = httpd.server_port

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _LiveCollector:
    """Gauges read from the engine and the store when Prometheus scrapes, never stale."""

    def __init__(self, metrics: CoordinatorMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        online = GaugeMetricFamily("plexus_sites_online", "Sites that polled within the online window")
        online.add_metric([], len(self.m._online_sites()))
        yield online
        known = GaugeMetricFamily("plexus_sites_known", "Sites that ever joined this coordinator")
        known.add_metric([], len(self.m._store.sites()))
        yield known
        current = GaugeMetricFamily("plexus_job_round", "A job's latest closed round", labels=["job", "status"])
        target = GaugeMetricFamily("plexus_job_rounds", "A job's configured number of rounds", labels=["job"])
        latest = GaugeMetricFamily("plexus_job_global_metric",
                                   "Sites' held-out metric of the latest evaluated global model, "
                                   "weighted by their rows", labels=["job", "name"])
        evaluated = GaugeMetricFamily("plexus_job_global_metric_round",
                                      "Model round that plexus_job_global_metric describes", labels=["job"])
        for row in _relevant_jobs(self.m._store.jobs()):
            current.add_metric([row.id, row.status], row.current_round)
            target.add_metric([row.id], row.rounds)
            found = latest_global(self.m._store.metrics(row.id))
            if found:
                round_, values = found
                evaluated.add_metric([row.id], round_)
                for name, value in sorted(values.items()):
                    latest.add_metric([row.id, name], value)
        yield from (current, target, latest, evaluated)


def _relevant_jobs(rows: list) -> list:
    """Queued and running jobs, plus the most recently updated finished ones."""
    active = [r for r in rows if r.status in ("queued", "running")]
    finished = sorted((r for r in rows if r.status not in ("queued", "running")), key=lambda r: r.updated,
                      reverse=True)
    return active + finished[:RECENT_JOBS]


def latest_global(rows: Iterable[tuple]) -> tuple[int, dict[str, float]] | None:
    """(model round, metrics) of the newest evaluated global model, each averaged over sites by their rows."""
    per: dict[int, dict[str, dict[str, float]]] = {}
    for round_, site, kind, name, value in rows:
        if kind == "eval":
            per.setdefault(round_, {}).setdefault(site, {})[name] = value
    if not per:
        return None
    round_ = max(per)
    sites = per[round_]
    names = sorted({n for v in sites.values() for n in v if n != "num_samples"})
    out = {}
    for name in names:
        have = {s: v.get("num_samples", 1.0) for s, v in sites.items() if name in v}
        total = sum(have.values())
        if total:
            out[name] = sum(sites[s][name] * w for s, w in have.items()) / total
    return round_, out
