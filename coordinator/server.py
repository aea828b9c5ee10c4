"""`plexus coordinator run`: wire the store, the engine and the services to an mTLS server."""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.aggregate import MAX_WEIGHT
from coordinator.audit import CoordinatorAudit
from coordinator.engine import Engine
from coordinator.metrics import CoordinatorMetrics
from coordinator.model_worker import ModelLimits, ModelWorker, wait_ended
from coordinator.service import AdminService, FederationService
from coordinator.store import Store
from plexus import transport
from plexus.audit import AuditLog
from plexus.config import CoordinatorConfig
from plexus.errors import FailedPrecondition, IntegrityError
from plexus.identity import RevocationList, federation_of, kit_identity, load_kit
from plexus.proto.plexus.v1 import admin_pb2_grpc, federation_pb2_grpc
from plexus.rpc import Authenticator, SendWatchdog
from plexus.shutdown import StopSignals

log = logging.getLogger("plexus.coordinator")


class Coordinator:
    """A running coordinator; `port` is the bound port (useful with listen port 0)."""

    def __init__(self, config: CoordinatorConfig, *, models: ModelWorker | None = None, take_up=None,
                 refuse_jobs: str = "", kit_kind: str = "coordinator"):
        """models: the model worker (default: the process's shared one); take_up, refuse_jobs: see Engine;
        kit_kind: whose kit serves (a relay's tier serves with the relay's)."""
        self._take_up, self._refuse_jobs = take_up, refuse_jobs
        kit = load_kit(config.kit)
        kit_identity(kit, kit_kind, f"the {kit_kind}'s kit is the one `plexus pki init` (or add-relay) wrote, "
                                    "with its key.pem, cert.pem and ca.pem")
        # Locks the state dir first: a second coordinator on it stops here, naming the first one's PID.
        self.store = Store(config.state_dir, retention=config.checkpoints)
        try:
            self._build(config, kit, models, kit_kind)
        except BaseException:
            self.store.close()   # and its lock, so a corrected retry in this process can take it
            raise

    def _build(self, config: CoordinatorConfig, kit, models: ModelWorker | None, kit_kind: str) -> None:
        # Revocation is not optional: without crl: in the config, the kit's own crl.pem is used. It is
        # checked before anything serves, so a rolled-back or expired CRL stops the start cleanly;
        # the highest CRL number seen is kept in the state dir, so a restart cannot roll it back.
        # A new crl.pem is noticed within a second (the watch, from start()): its revocations are audited, and the
        # long-polls of revoked sites are refused then, not when they next call.
        crl = RevocationList(config.crl or Path(config.kit) / "crl.pem", kit.ca_pem, on_revoked=self._revoked,
                             floor_file=Path(config.state_dir) / "crl-number")
        self._crl_stop = threading.Event()
        self._crl_watch = threading.Thread(target=crl.watch, args=(self._crl_stop,), name="crl-watch", daemon=True)
        # The audit trail: append-only, hash-chained, beside plexus.db (`plexus audit --verify`).
        # Its head is signed with the coordinator's key (`plexus audit --export-head`, `--against`).
        audit_path = Path(config.state_dir) / "audit.db"
        if not audit_path.exists() and (jobs := len(self.store.jobs())):
            raise IntegrityError(f"{audit_path} is missing, but the state dir holds {jobs} job(s): a new audit log "
                                 "would start its hash chain over and hide what the old one recorded; restore it "
                                 "from a backup (docs/backup-restore.md)")
        self.audit_log = AuditLog(audit_path, signer=(kit.key_pem, kit.cert_pem))
        self.audit = CoordinatorAudit(self.audit_log, self.store)
        self.engine = Engine(self.store, federation=federation_of(kit.cert_pem), poll_timeout_s=config.poll_timeout_s,
                             rejoin_grace_s=config.rejoin_grace_s, on_death=self._engine_died, models=models,
                             model_limits=ModelLimits(config.model_build_timeout_s, config.model_build_memory_bytes),
                             take_up=self._take_up, refuse_jobs=self._refuse_jobs)
        if kit_kind == "relay":   # its sites' rows are summed into one Join at the parent, which caps them
            self.engine.tier_rows_cap = MAX_WEIGHT
        # One certificate's calls never take the whole pool (max_calls_per_identity < max_workers), and a
        # stream that stops moving lets go of its thread and transfer slot (stream_idle_timeout_s).
        auth = Authenticator(crl, max_calls=config.max_calls_per_identity)
        self.watchdog = SendWatchdog(config.stream_idle_timeout_s)
        # grpc never shuts down a server's executor; stop() does, so no worker thread outlives it.
        self._executors = [futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="plexus-rpc")]
        try:
            self.server, self.port = transport.server(kit, config.listen, executor=self._executors[0],
                                                      stream_window_bytes=config.stream_window_bytes)
        except OSError as exc:   # e.g. the port is another coordinator's: a clear error, not a traceback
            raise FailedPrecondition(f"listen: {exc}") from None
        self.metrics = CoordinatorMetrics(store=self.store, online_sites=self.engine.online_sites)
        self.store.subscribe(self.metrics.on_event)
        federation_pb2_grpc.add_FederationServicer_to_server(
            _Metered(FederationService(self.engine, auth, chunk_bytes=config.chunk_bytes, audit=self.audit,
                                       max_transfers=config.max_transfers, idle_s=config.stream_idle_timeout_s,
                                       watchdog=self.watchdog),
                     self.metrics), self.server)
        admin_pb2_grpc.add_AdminServicer_to_server(
            _Metered(AdminService(self.engine, auth, chunk_bytes=config.chunk_bytes, audit=self.audit_log,
                                  watchdog=self.watchdog),
                     self.metrics), self.server)
        # Health: NOT_SERVING until the engine runs. On the mTLS port for peers with a kit, and
        # optionally on a plaintext port that serves nothing else, for probes without a certificate.
        self.health = health.HealthServicer()
        for service in _HEALTH_SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server, self.health_port = None, None
        if config.health_listen:
            self._executors.append(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="plexus-health"))
            self.health_server = grpc.server(self._executors[-1], options=transport.NO_PORT_SHARING)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            # Plaintext by explicit config only (off by default): Kubernetes' gRPC probes cannot present a
            # client certificate. This server carries grpc.health.v1 and nothing else.
            self.health_port = transport.bind(self.health_server.add_insecure_port, config.health_listen)
            log.warning("health_listen %s: plaintext gRPC port serving only grpc.health.v1 (no job data)",
                        config.health_listen)
            if self.health_port == 0:
                raise FailedPrecondition(f"health_listen: could not bind {config.health_listen}; is another process "
                                         "listening there?")
        self._metrics_listen = config.metrics_listen
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.address_file = Path(config.state_dir) / "coordinator.addr"

    def _revoked(self, serials: list[int]) -> None:
        for n in serials:
            self.audit.certificate_revoked(f"serial {n}", serial=n, by="crl")
        gone = {str(n) for n in serials}
        try:   # called in whichever call reloaded the CRL: a failure here must not become that call's
            self.engine.revoked(row.name for row in self.store.sites() if row.serial in gone)
        except Exception:
            log.exception("failing the tasks of the sites just revoked (serials %s) failed; their calls are refused "
                          "all the same, and their rounds wait for them until their deadlines", serials)

    def start(self) -> None:
        self.engine.start()
        self.server.start()
        self._crl_watch.start()
        if self.health_server is not None:
            self.health_server.start()
        if self._metrics_listen:
            self.metrics_server = self.metrics.serve(self._metrics_listen)
            self.metrics_port = self.metrics_server.port
            log.info("Prometheus metrics on port %d (/metrics)", self.metrics_port)
        for service in _HEALTH_SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        host = "127.0.0.1"
        tmp = self.address_file.with_suffix(".tmp")
        tmp.write_text(f"{host}:{self.port}\n")
        os.replace(tmp, self.address_file)
        log.info("coordinator listening on port %d", self.port)

    def _engine_died(self) -> None:
        for service in _HEALTH_SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.health_server is not None:
            self.health_server.stop(0).wait()
        stopped = self.server.stop(grace)   # refuses new calls now; cancels those still running after `grace`
        # A long poll waits in the engine, not in gRPC: until its poll_timeout_s ran out it would hold the grace
        # period and then its worker thread (and so this shutdown). The engine's stop answers every one now.
        self.engine.stop()
        stopped.wait()
        wait_ended()   # compute workers of jobs that ended, still finishing their last operation
        self._crl_stop.set()
        if self._crl_watch.is_alive():
            self._crl_watch.join()
        self.watchdog.stop()
        for executor in self._executors:
            executor.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        self.audit_log.anchor()   # the head at shutdown, signed: a later truncation cannot hide below it
        self.audit_log.close()


_HEALTH_SERVICES = ("", "plexus.v1.Federation", "plexus.v1.Admin")
_STREAMS_OUT = ("FetchModel", "DownloadModel")


class _Metered:
    """A servicer seen through the metrics: model streams out and update streams in are byte-counted."""

    def __init__(self, servicer, metrics: CoordinatorMetrics):
        self._servicer, self._metrics = servicer, metrics

    def __getattr__(self, name: str):
        method = getattr(self._servicer, name)
        if name in _STREAMS_OUT:
            return lambda request, context: self._metrics.count_out(method(request, context))
        if name == "SubmitUpdate":
            return lambda requests, context: method(self._metrics.count_in(requests), context)
        return method


def run(config: CoordinatorConfig) -> int:
    coordinator = Coordinator(config)
    signals = StopSignals()
    coordinator.start()
    print(f"plexus coordinator listening on port {coordinator.port} (mTLS); state in {config.state_dir}", flush=True)
    if coordinator.health_port:
        print(f"gRPC health (plaintext, health only) on port {coordinator.health_port}", flush=True)
    if coordinator.metrics_port:
        print(f"Prometheus metrics on port {coordinator.metrics_port} (/metrics)", flush=True)
    signals.wait()
    coordinator.stop()
    return 0
