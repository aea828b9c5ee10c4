"""The client side of the Admin service, used by the `plexus` CLI and the demo."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from plexus import transport
from plexus.pki import load_kit
from plexus.proto.plexus.v1 import admin_pb2, admin_pb2_grpc
from plexus.wire import Layout, assemble, decode

SUBMIT_TIMEOUT_S = 660.0   # two builds of the default model_build_timeout_s, and some


class AdminClient:
    def __init__(self, address: str, kit_dir: Path, *, timeout_s: float = 30.0):
        self.address = address
        self.channel = transport.channel(load_kit(Path(kit_dir)), address)
        self.stub = admin_pb2_grpc.AdminStub(self.channel)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, config_yaml: str) -> admin_pb2.JobSummary:
        # The coordinator builds the job's initial model before it answers: up to its model_build_timeout_s
        # (default 300 s), after any build ahead of it. Giving up sooner would leave a job the caller thinks failed.
        return self.stub.SubmitJob(admin_pb2.SubmitJobRequest(config_yaml=config_yaml),
                                   timeout=max(self.timeout_s, SUBMIT_TIMEOUT_S))

    def jobs(self) -> list[admin_pb2.JobSummary]:
        return list(self.stub.ListJobs(admin_pb2.ListJobsRequest(), timeout=self.timeout_s).jobs)

    def job(self, job_id: str) -> admin_pb2.JobDetail:
        return self.stub.GetJob(admin_pb2.JobRef(job_id=job_id), timeout=self.timeout_s)

    def watch(self, job_id: str, timeout_s: float | None = None):
        return self.stub.WatchJob(admin_pb2.JobRef(job_id=job_id), timeout=timeout_s)

    def abort(self, job_id: str) -> admin_pb2.JobSummary:
        return self.stub.AbortJob(admin_pb2.JobRef(job_id=job_id), timeout=self.timeout_s)

    def audit(self, *, verify: bool = False, limit: int = 0, sign_head: bool = False) -> admin_pb2.AuditReply:
        return self.stub.GetAudit(admin_pb2.AuditRequest(verify=verify, limit=limit, sign_head=sign_head),
                                  timeout=max(self.timeout_s, 120))

    def sites(self) -> list[admin_pb2.SiteInfo]:
        return list(self.stub.ListSites(admin_pb2.ListSitesRequest(), timeout=self.timeout_s).sites)

    def download(self, job_id: str, round_: int = -1) -> tuple[int, dict[str, np.ndarray]]:
        """The global model of a closed round (-1: the latest), validated chunk by chunk."""
        stream = self.stub.DownloadModel(admin_pb2.DownloadRequest(job_id=job_id, round=round_),
                                         timeout=max(self.timeout_s, 600))
        header = next(stream).header
        layout = Layout.from_proto(header.manifest)
        return header.round, decode(layout, assemble(layout, (message.chunk for message in stream)))

    def download_to(self, job_id: str, path: Path, round_: int = -1) -> int:
        got, state = self.download(job_id, round_)
        tmp = Path(f"{path}.tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(tmp),
                  metadata={"job": job_id, "round": str(got)})
        os.replace(tmp, path)
        return got


def epsilon_by_round(detail: admin_pb2.JobDetail) -> dict[int, float]:
    """The privacy ledger's ε after each closed round (empty without differential privacy)."""
    return {m.round: m.value for m in detail.metrics if m.kind == "privacy" and m.name == "epsilon"}


def noise_reproducible(detail: admin_pb2.JobDetail) -> bool:
    """Whether the coordinator flagged the job's central DP noise as derivable from its config (not private)."""
    return any(m.kind == "privacy" and m.name == "noise_reproducible" for m in detail.metrics)


def mean_eval(detail: admin_pb2.JobDetail) -> dict[int, dict[str, float]]:
    """Per model version: each eval metric averaged over sites, weighted by their held-out row counts."""
    per = defaultdict(lambda: defaultdict(dict))
    for m in detail.metrics:
        if m.kind == "eval":
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
