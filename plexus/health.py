"""Client side of the standard gRPC health service, for probes, HEALTHCHECK and operators."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plexus import transport
from plexus.pki import load_kit


def check(address: str, *, kit: Path | None = None, service: str = "", timeout: float = 5.0) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...) of `service` at address.

    With a kit the call is mTLS, as on the coordinator's main port; without one it is
    plaintext, which only the health-only port (`health_listen`) accepts.
    """
    channel = transport.channel(load_kit(kit), address) if kit is not None else grpc.insecure_channel(address)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
