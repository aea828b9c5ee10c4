"""Client side of the standard gRPC health service, for probes, HEALTHCHECK and operators."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plexus import transport
from plexus.identity import load_kit

log = logging.getLogger("plexus.health")


def check(address: str, *, kit: Path | None = None, plaintext: bool = False, service: str = "",
          timeout: float = 5.0) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...) of `service` at address.

    With a kit the call is mTLS, as on the coordinator's main port. Plaintext must be asked
    for explicitly (plaintext=True): only the health-only port (`health_listen`) accepts it,
    and it carries nothing but the health status.
    """
    if kit is None and not plaintext:
        raise ValueError("no kit: pass a kit for mTLS, or ask for plaintext explicitly to probe a health_listen port")
    if kit is not None:
        channel = transport.channel(load_kit(kit), address)
    else:
        log.warning("plaintext gRPC to %s: acceptable only for a health-only port", address)
        channel = grpc.insecure_channel(address)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
