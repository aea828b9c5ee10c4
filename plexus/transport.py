"""Mutual-TLS gRPC servers and channels. There is no insecure mode."""

from __future__ import annotations

import time
from concurrent import futures

import grpc

from plexus.identity import Kit

MAX_MESSAGE_BYTES = 16 << 20   # chunks are ≤ 4 MiB; anything bigger is refused by gRPC itself

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
# gRPC sets SO_REUSEPORT by default: a second server on a port in use would bind, and share its calls.
NO_PORT_SHARING = [("grpc.so_reuseport", 0)]
MAX_CALL_S = 2 * 86400.0   # past a round's longest deadline (a day); gRPC takes ~1e10 s as already expired


def seconds_left(deadline_unix_s: float) -> float:
    """Seconds until a deadline a peer sent, at most MAX_CALL_S whatever it was (inf, 1e300; NaN: 0): what a
    call timeout may be built from."""
    left = deadline_unix_s - time.time()
    return min(MAX_CALL_S, left) if left == left else 0.0


def server(kit: Kit, address: str, *, executor: futures.ThreadPoolExecutor,
           stream_window_bytes: int = 0) -> tuple[grpc.Server, int]:
    """A gRPC server bound to address with mTLS; client certificates are required.

    The caller owns executor and shuts it down after the server stops (grpc never does).

    stream_window_bytes fixes each stream's flow-control window (no BDP probing); 0 keeps gRPC's
    adaptive windows."""
    options = _OPTIONS + NO_PORT_SHARING + [("grpc.http2.min_ping_interval_without_data_ms", 10_000)]
    if stream_window_bytes:
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", stream_window_bytes)]
    srv = grpc.server(executor, options=options)
    credentials = grpc.ssl_server_credentials([(kit.key_pem, kit.cert_pem)], root_certificates=kit.ca_pem,
                                              require_client_auth=True)
    port = bind(lambda a: srv.add_secure_port(a, credentials), address)
    if port == 0:
        raise OSError(f"could not bind {address}; is another process listening there?")
    return srv, port


def bind(add_port, address: str) -> int:
    """The port add_port(address) bound, or 0 if it could not: grpcio raises where it once returned 0."""
    try:
        return add_port(address)
    except RuntimeError:
        return 0


def channel(kit: Kit, address: str) -> grpc.Channel:
    """A channel that presents the kit's certificate and trusts only the federation CA."""
    credentials = grpc.ssl_channel_credentials(root_certificates=kit.ca_pem, private_key=kit.key_pem,
                                               certificate_chain=kit.cert_pem)
    return grpc.secure_channel(address, credentials, options=_OPTIONS)
