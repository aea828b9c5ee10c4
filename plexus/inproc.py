"""Calls to a gRPC servicer in this process: no socket and no TLS, but the servicer's own code throughout.

`plexus simulate` runs the coordinator's Federation and Admin servicers this way, and the admin commands read
a simulation's state dir through them (`--state DIR`). A call carries the caller's certificate as a TLS
connection would, so the servicer authenticates it exactly as it authenticates a real peer (plexus.rpc).
Errors reach the caller as `grpc.RpcError`s with the status code and details the servicer gave.
"""

from __future__ import annotations

import grpc
from google.protobuf.descriptor import ServiceDescriptor


class LocalRpcError(grpc.RpcError):
    """A servicer's `context.abort(code, details)`, as the caller of a real channel would see it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LocalContext:
    """What Plexus's servicers read of a call's context: the peer's certificate, liveness, and abort."""

    def __init__(self, cert_pem: bytes, peer: str):
        self._cert_pem, self._peer = cert_pem, peer
        self._active = True
        self._code: grpc.StatusCode | None = None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self._cert_pem]}

    def peer(self) -> str:
        return self._peer

    def is_active(self) -> bool:
        return self._active

    def cancel(self) -> None:
        self._active = False

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def abort(self, code: grpc.StatusCode, details: str):
        self._code, self._active = code, False
        raise LocalRpcError(code, details)

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> None:
        return None


class LocalStub:
    """A stub whose methods call `servicer` directly, as `cert_pem`'s holder: `stub.Method(request, timeout=...)`
    like a generated stub's (the timeout is not enforced: nothing waits on a network). A server-streaming
    method returns an iterator, a client-streaming one takes one."""

    def __init__(self, servicer, service: ServiceDescriptor, cert_pem: bytes, *, peer: str = "local"):
        self._servicer, self._cert_pem, self._peer = servicer, cert_pem, peer
        for method in service.methods:
            call = self._streaming if method.server_streaming else self._unary
            setattr(self, method.name, _bound(call, getattr(servicer, method.name)))

    def _unary(self, handler, request):
        return handler(request, LocalContext(self._cert_pem, self._peer))

    def _streaming(self, handler, request):
        context = LocalContext(self._cert_pem, self._peer)
        stream = handler(request, context)
        try:
            yield from stream
        finally:
            context.cancel()
            stream.close()


def _bound(call, handler):
    def method(request, timeout: float | None = None, metadata=None):
        return call(handler, request)
    return method
