"""`plexus coordinator run`: wire the store, the engine and the services to an mTLS server."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from coordinator.engine import Engine
from coordinator.service import AdminService, FederationService
from coordinator.store import Store
from plexus import transport
from plexus.config import CoordinatorConfig
from plexus.pki import RevocationList, federation_of, load_kit
from plexus.proto.plexus.v1 import admin_pb2_grpc, federation_pb2_grpc
from plexus.rpc import Authenticator

log = logging.getLogger("plexus.coordinator")


class Coordinator:
    """A running coordinator; `port` is the bound port (useful with listen port 0)."""

    def __init__(self, config: CoordinatorConfig):
        kit = load_kit(config.kit)
        # Revocation is not optional: without crl: in the config, the kit's own crl.pem is used.
        crl = RevocationList(config.crl or Path(config.kit) / "crl.pem", kit.ca_pem)
        self.store = Store(config.state_dir)
        self.engine = Engine(self.store, federation=federation_of(kit.cert_pem), poll_timeout_s=config.poll_timeout_s)
        auth = Authenticator(crl)
        self.server, self.port = transport.server(kit, config.listen, max_workers=config.max_workers)
        federation_pb2_grpc.add_FederationServicer_to_server(
            FederationService(self.engine, auth, chunk_bytes=config.chunk_bytes), self.server)
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminService(self.engine, auth, chunk_bytes=config.chunk_bytes), self.server)
        self.address_file = Path(config.state_dir) / "coordinator.addr"

    def start(self) -> None:
        self.engine.start()
        self.server.start()
        host = "127.0.0.1"
        tmp = self.address_file.with_suffix(".tmp")
        tmp.write_text(f"{host}:{self.port}\n")
        os.replace(tmp, self.address_file)
        log.info("coordinator listening on port %d", self.port)

    def stop(self, grace: float = 2.0) -> None:
        self.server.stop(grace).wait()
        self.engine.stop()
        self.store.close()


def run(config: CoordinatorConfig) -> int:
    coordinator = Coordinator(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    coordinator.start()
    print(f"plexus coordinator listening on port {coordinator.port} (mTLS); state in {config.state_dir}", flush=True)
    stop.wait()
    coordinator.stop()
    return 0
