"""Authentication, authorisation and error mapping for every gRPC method, in one place.

Identity comes from the verified peer certificate only. The TLS layer has
checked that it chains to the federation CA, through any intermediates; this
layer accepts only leaves the CA issued directly, adds the CRL check and the
role check, and turns Plexus errors into status codes with the error's own
message (bounded).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading

import grpc

from plexus import errors
from plexus.pki import Identity, RevocationList, check_leaf, identity_from_cert
from plexus.text import bounded

log = logging.getLogger("plexus.rpc")

# Most specific first: the first isinstance match wins.
STATUS_OF = (
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.PolicyViolation, grpc.StatusCode.PERMISSION_DENIED),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.RoundClosed, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # ConfigError, IntegrityError
)

# Which certificate kinds/roles may call what. Admin roles are ordered: admin ⊇ operator ⊇ viewer.
ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


class Authenticator:
    """Turns a call's peer certificate into an Identity, checking the CRL on every call.

    A certificate is checked as a leaf of the federation CA once, then its Identity is cached."""

    def __init__(self, crl: RevocationList):
        self._crl = crl
        self._cache: dict[bytes, Identity] = {}
        self._lock = threading.Lock()

    def identify(self, context: grpc.ServicerContext) -> Identity:
        certs = context.auth_context().get("x509_pem_cert")
        if not certs:
            raise errors.Unauthenticated("no client certificate was presented; connect with your kit's cert.pem/key.pem")
        pem = certs[0]
        self._crl.check(pem)
        with self._lock:
            ident = self._cache.get(pem)
        if ident is None:
            check_leaf(pem, self._crl.ca_pem)
            ident = identity_from_cert(pem)
            with self._lock:
                self._cache[pem] = ident
        return ident


def authorize(ident: Identity, *, kind: str, min_role: str | None = None) -> None:
    if ident.kind != kind:
        raise errors.PermissionDenied(
            f"{ident.kind} certificate {ident.name!r} cannot call this method; it needs a {kind} certificate")
    if min_role is not None and ROLE_RANK.get(ident.role or "", -1) < ROLE_RANK[min_role]:
        raise errors.PermissionDenied(
            f"admin {ident.name!r} has role {ident.role!r}; this call needs role {min_role!r} or higher "
            f"(issue a certificate with `plexus pki add-admin DIR NAME --role {min_role}`)")


def guarded(*, kind: str, min_role: str | None = None):
    """Decorate a servicer method: authenticate, authorise, map errors to status codes.

    The method receives the caller's Identity as a keyword argument `who`.
    Works for unary and server-streaming (generator) methods.
    """

    def decorate(method):
        def _prologue(self, context):
            ident = self.auth.identify(context)
            authorize(ident, kind=kind, min_role=min_role)
            return ident

        def _abort(context, exc):
            code = status_for(exc)
            if code is grpc.StatusCode.UNAUTHENTICATED:   # e.g. a revoked site still dialling in: tell the operator
                log.warning("refused %s from %s: %s", method.__name__, context.peer(), exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("unexpected error in %s", method.__name__)
                context.abort(code, "internal error at the coordinator; the operator can find details in its log")
            context.abort(code, bounded(str(exc)))   # a site's 2,000,000 column names need not all travel back

        if inspect.isgeneratorfunction(method):
            @functools.wraps(method)
            def stream(self, request, context):
                try:
                    who = _prologue(self, context)
                    yield from method(self, request, context, who=who)
                except Exception as exc:
                    if isinstance(exc, grpc.RpcError) or context.code() is not None:
                        raise
                    _abort(context, exc)
            return stream

        @functools.wraps(method)
        def unary(self, request, context):
            try:
                who = _prologue(self, context)
                return method(self, request, context, who=who)
            except Exception as exc:
                if isinstance(exc, grpc.RpcError) or context.code() is not None:
                    raise
                _abort(context, exc)
        return unary

    return decorate
