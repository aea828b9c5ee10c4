"""The client side of the Admin service, used by the `plexus` CLI and the demo."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
from safetensors.numpy import save_file

from plexus import transport
from plexus.errors import PlexusError
from plexus.files import temp_beside
from plexus.identity import load_kit
from plexus.proto.plexus.v1 import admin_pb2, admin_pb2_grpc
from plexus.wire import Layout, assemble, decode

log = logging.getLogger("plexus.admin")

# Deadlines when the caller sets none (`--timeout`): most calls, the audit log, model downloads.
CALL_TIMEOUT_S, AUDIT_TIMEOUT_S, DOWNLOAD_TIMEOUT_S = 30.0, 120.0, 600.0
# A submit: the coordinator builds the job's initial model before it answers, up to its model_build_timeout_s
# (default 300 s) after any build ahead of it; two such builds, and some.
SUBMIT_TIMEOUT_S = 660.0
SUBMIT_ATTEMPTS = 5                 # a submit answered DEADLINE_EXCEEDED or UNAVAILABLE is sent again, this often
_RETRYABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


class AdminClient:
    """timeout_s, when set, is the deadline of every call but watch (which follows a job for as long as it
    runs); unset, calls get CALL_TIMEOUT_S, submits SUBMIT_TIMEOUT_S, the audit log AUDIT_TIMEOUT_S, downloads
    DOWNLOAD_TIMEOUT_S."""

    def __init__(self, address: str, kit_dir: Path, *, timeout_s: float | None = None, sleep=time.sleep):
        self.address = address
        self.channel = transport.channel(load_kit(Path(kit_dir)), address)
        self.stub = admin_pb2_grpc.AdminStub(self.channel)
        self.timeout_s = timeout_s
        self._sleep = sleep
        self._close = self.channel.close

    @classmethod
    def over(cls, stub, *, close, address: str, timeout_s: float | None = None) -> AdminClient:
        """A client whose calls go to `stub` (an Admin stub, e.g. a plexus.inproc.LocalStub) rather than over a
        channel; `close()` calls `close`; `address` says where the calls go (`job export` records it)."""
        client = cls.__new__(cls)
        client.address, client.channel, client.stub = address, None, stub
        client.timeout_s, client._sleep, client._close = timeout_s, time.sleep, close
        return client

    def _deadline(self, default: float) -> float:
        return default if self.timeout_s is None else self.timeout_s

    def close(self) -> None:
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, config_yaml: str, *, request_id: str | None = None,
               attempts: int = SUBMIT_ATTEMPTS) -> admin_pb2.JobSummary:
        """Submit a round config under a request id (a random one unless given). A submit whose deadline
        passed may still have created the job, so DEADLINE_EXCEEDED and UNAVAILABLE are retried with the
        same id, up to `attempts` calls in all: the coordinator answers a repeat with the job the first
        one created, never a second job."""
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1; got {attempts}")
        request = admin_pb2.SubmitJobRequest(config_yaml=config_yaml, request_id=request_id or new_request_id())
        for attempt in range(1, attempts):
            try:
                return self.stub.SubmitJob(request, timeout=self._deadline(SUBMIT_TIMEOUT_S))
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                pause = min(0.5 * 2 ** (attempt - 1), 8.0)
                log.warning("submit attempt %d of %d: %s (deadline %g s); sending it again in %.1f s with the same "
                            "request id %s (a job it created is returned, not made twice)", attempt, attempts,
                            exc.code().name, self._deadline(SUBMIT_TIMEOUT_S), pause, request.request_id)
                self._sleep(pause)
        return self.stub.SubmitJob(request, timeout=self._deadline(SUBMIT_TIMEOUT_S))

    def jobs(self) -> list[admin_pb2.JobSummary]:
        return list(self.stub.ListJobs(admin_pb2.ListJobsRequest(), timeout=self._deadline(CALL_TIMEOUT_S)).jobs)

    def job(self, job_id: str) -> admin_pb2.JobDetail:
        return self.stub.GetJob(admin_pb2.JobRef(job_id=job_id), timeout=self._deadline(CALL_TIMEOUT_S))

    def watch(self, job_id: str, timeout_s: float | None = None):
        return self.stub.WatchJob(admin_pb2.JobRef(job_id=job_id), timeout=timeout_s)

    def abort(self, job_id: str) -> admin_pb2.JobSummary:
        return self.stub.AbortJob(admin_pb2.JobRef(job_id=job_id), timeout=self._deadline(CALL_TIMEOUT_S))

    def resume(self, job_id: str) -> admin_pb2.JobSummary:
        return self.stub.ResumeJob(admin_pb2.JobRef(job_id=job_id), timeout=self._deadline(CALL_TIMEOUT_S))

    def audit(self, *, verify: bool = False, limit: int = 0, sign_head: bool = False) -> admin_pb2.AuditReply:
        return self.stub.GetAudit(admin_pb2.AuditRequest(verify=verify, limit=limit, sign_head=sign_head),
                                  timeout=self._deadline(AUDIT_TIMEOUT_S))

    def sites(self) -> list[admin_pb2.SiteInfo]:
        return list(self.stub.ListSites(admin_pb2.ListSitesRequest(), timeout=self._deadline(CALL_TIMEOUT_S)).sites)

    def download(self, job_id: str, round_: int = -1) -> tuple[int, dict[str, np.ndarray]]:
        """The global model of a closed round (-1: the latest), validated chunk by chunk."""
        stream = self.stub.DownloadModel(admin_pb2.DownloadRequest(job_id=job_id, round=round_),
                                         timeout=self._deadline(DOWNLOAD_TIMEOUT_S))
        header = next(stream).header
        layout = Layout.from_proto(header.manifest)
        return header.round, decode(layout, assemble(layout, (message.chunk for message in stream)))

    def download_to(self, job_id: str, path: Path, round_: int = -1) -> int:
        """Download into `path` as safetensors: written beside it under a name of its own, then renamed over it, so
        `path` is either what it was or the whole model."""
        got, state = self.download(job_id, round_)
        path = Path(path)
        tmp = temp_beside(path)
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(tmp),
                      metadata={"job": job_id, "round": str(got)})
            os.replace(tmp, path)
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise
            raise PlexusError(f"cannot write {path}: {exc}") from None
        return got


def new_request_id() -> str:
    """A fresh random request id for one submission (and its retries)."""
    return uuid.uuid4().hex


def epsilon_by_round(detail: admin_pb2.JobDetail) -> dict[int, float]:
    """The privacy ledger's ε after each closed round (empty without differential privacy)."""
    return {m.round: m.value for m in detail.metrics if m.kind == "privacy" and m.name == "epsilon"}


def noise_reproducible(detail: admin_pb2.JobDetail) -> bool:
    """Whether the coordinator flagged the job's central DP noise as derivable from its config (not private)."""
    return any(m.kind == "privacy" and m.name == "noise_reproducible" for m in detail.metrics)


def mean_eval(detail: admin_pb2.JobDetail) -> dict[int, dict[str, float]]:
    """Per model version: each eval metric averaged over sites, weighted by their held-out row counts."""
    return mean_metrics(detail, "eval")


def mean_metrics(detail: admin_pb2.JobDetail, kind: str) -> dict[int, dict[str, float]]:
    """Per round: each metric of `kind` ("eval": of the global model of that round, on the sites' held-out
    rows; "train": of the sites' local models trained in that round) averaged over sites, weighted by
    their row counts (num_samples)."""
    per = defaultdict(lambda: defaultdict(dict))
    for m in detail.metrics:
        if m.kind == kind:
            per[m.round][m.site][m.name] = m.value
    out = {}
    for round_, sites in per.items():
        weights = {s: v.get("num_samples", 1.0) for s, v in sites.items()}
        names = {n for v in sites.values() for n in v if n != "num_samples"}
        out[round_] = {}
        for name in sorted(names):
            have = [s for s in sites if name in sites[s]]
            total = sum(weights[s] for s in have)
            out[round_][name] = sum(sites[s][name] * weights[s] for s in have) / total if total else float("nan")
    return out


def job_config(detail: admin_pb2.JobDetail):
    """The job's round config, or None for a config this CLI cannot read (one written by a coordinator of another
    version): the job is then shown as any job is, its rounds and metrics as they are."""
    from plexus.config import parse_round_config
    from plexus.errors import ConfigError

    try:
        return parse_round_config(detail.config_yaml, source=f"job {detail.summary.job_id}")
    except ConfigError:
        return None


def statistics_spec(detail: admin_pb2.JobDetail):
    """A statistics job's `statistics:` block (plexus.config.StatisticsSpec), or None for a training job (or one
    whose config this CLI cannot read)."""
    cfg = job_config(detail)
    return None if cfg is None or cfg.kind != "statistics" else cfg.statistics


def job_statistics(client: AdminClient, detail: admin_pb2.JobDetail, round_: int = -1):
    """(round, figures, DP ledger) of a statistics job: the plexus.statistics figures of the pooled sums of its
    closed round (-1: the latest), and the ledger of statistics.dp (None without). PlexusError for a training job
    or one not pooled yet."""
    from plexus import statistics as stats

    s = detail.summary
    spec = statistics_spec(detail)
    if spec is None:
        raise PlexusError(f"job {s.job_id} is a training job, whose result is a model, not statistics; download "
                          "it as safetensors (-o FILE.safetensors)")
    if s.current_round < 1 or round_ == 0:
        raise PlexusError(f"job {s.job_id} has not pooled its sites' sums yet (status {s.status}); follow it with "
                          f"`plexus job watch {s.job_id}`")
    got, sums = client.download(s.job_id, round_)
    return got, stats.figures(spec, sums), None if spec.dp is None else stats.dp_ledger(spec)


def async_spec(detail: admin_pb2.JobDetail):
    """The job's `asynchronous:` block (plexus.config.AsyncSpec), or None for a synchronous job (or one whose
    config this CLI cannot read)."""
    cfg = job_config(detail)
    return None if cfg is None else cfg.asynchronous


def compression_summary(detail: admin_pb2.JobDetail) -> str | None:
    """How the job's updates and models travel, for `job show` ("uplink topk (fraction 0.01, error feedback),
    downlink delta8"); None without a compression block (or a config this CLI cannot read)."""
    cfg = job_config(detail)
    if cfg is None:
        return None
    if cfg.compression is None:
        return None
    up, down = cfg.compression.uplink, cfg.compression.downlink
    given = [f"{key} {getattr(up, key):g}" for key in ("fraction", "k", "block", "bin_conv", "bin_dense")
             if getattr(up, key) is not None]
    if up.codec in ("topk", "randk"):   # on unless turned off; randk under secure aggregation keeps none
        default = not (up.codec == "randk" and cfg.privacy.secure_aggregation)
        feedback = default if up.error_feedback is None else up.error_feedback
        given.append("error feedback" if feedback else "no error feedback")
    uplink = f"uplink {up.codec}" + (f" ({', '.join(given)})" if given else "")
    downlink = f"downlink {down.codec}" + (f" (block {down.block})" if down.block is not None else "")
    return f"{uplink}, {downlink}"


def async_ledger(detail: admin_pb2.JobDetail) -> dict[int, dict[str, dict[str, float]]]:
    """An asynchronous job's flush records (kind "async"): version -> site ("" for the version as a whole) ->
    name -> value (updates, staleness_mean, staleness_<τ>, contributions, refused_stale)."""
    out: dict[int, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for m in detail.metrics:
        if m.kind == "async":
            out[m.round][m.site][m.name] = m.value
    return out


def staleness_counts(ledger: dict[int, dict[str, dict[str, float]]]) -> dict[int, int]:
    """τ -> how many updates the versions in `ledger` took in at that staleness, every τ from 0 to the largest."""
    counts: dict[int, int] = defaultdict(int)
    for sites in ledger.values():
        for name, value in sites.get("", {}).items():
            tau = name.removeprefix("staleness_")
            if tau != name and tau.isdigit():
                counts[int(tau)] += int(value)
    return {tau: counts[tau] for tau in range(max(counts) + 1)} if counts else {}


def async_view(detail: admin_pb2.JobDetail) -> dict | None:
    """What `job show` tells of an asynchronous job (None for a synchronous one), JSON-ready: its settings, its
    version, each site's updates in the versions made and its updates refused as too stale, the staleness
    histogram of those updates, and the updates waiting in the buffer of the next version (under secure
    aggregation: kept at their sites for a cohort)."""
    from dataclasses import asdict

    spec = async_spec(detail)
    if spec is None:
        return None
    ledger = async_ledger(detail)
    sites: dict[str, dict[str, int]] = defaultdict(lambda: {"contributions": 0, "refused_stale": 0})
    for per_site in ledger.values():
        for site, values in per_site.items():
            for name in ("contributions", "refused_stale"):
                if site and name in values:
                    sites[site][name] += int(values[name])
    s = detail.summary
    return {"mode": asdict(spec), "version": s.current_round, "versions": s.rounds,
            "sites": [{"site": site, **sites[site]} for site in sorted(sites)],
            "refused_stale": sum(int(v.get("", {}).get("refused_stale", 0)) for v in ledger.values()),
            "staleness": [{"staleness": tau, "updates": n} for tau, n in staleness_counts(ledger).items()],
            "buffer": {"version": s.current_round + 1,
                       "updates": [{"site": e.site, "from_version": e.round} for e in detail.site_events
                                   if e.status in ("buffered", "trained")]}}
