"""Authentication, authorisation and error mapping for every gRPC method, in one place.

Identity comes from the verified peer certificate only. The TLS layer has
checked that it chains to the federation CA, through any intermediates; this
layer accepts only leaves the CA issued directly, adds the CRL check and the
role check, holds each identity to its share of the server's threads, and turns
Plexus errors into status codes with the error's own message (bounded).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from contextlib import contextmanager

import grpc

from plexus import errors
from plexus.identity import KINDS, Identity, RevocationList, check_leaf, identity_from_cert, revoked_error
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
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.TimedOut, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # ConfigError, IntegrityError
)

# Which certificate kinds/roles may call what. Admin roles are ordered: admin ⊇ operator ⊇ viewer.
ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


class CallLimit:
    """At most `limit` calls in progress per identity (a site, an admin), refused beyond it at once.

    Every call holds one of the server's worker threads until it ends, a streaming call for as long as
    its stream, so one certificate opening idle streams (or long polls) could otherwise take every
    thread and stall the whole federation. None: no limit."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._held: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, ident: Identity):
        key = (ident.kind, ident.name)
        with self._lock:
            held = self._held.get(key, 0)
            if self.limit is not None and held >= self.limit:
                raise errors.ResourceExhausted(
                    f"{ident.kind} {ident.name!r} already has {held} calls in progress, the most one identity "
                    f"may have at once (max_calls_per_identity: {self.limit} in the coordinator's config); "
                    "let earlier calls finish (close idle streams) before making more, or raise "
                    "max_calls_per_identity")
            self._held[key] = held + 1
        try:
            yield
        finally:
            with self._lock:
                if self._held[key] == 1:
                    del self._held[key]
                else:
                    self._held[key] -= 1

    def held(self, ident: Identity) -> int:
        """Calls in progress for this identity now."""
        with self._lock:
            return self._held.get((ident.kind, ident.name), 0)


class Authenticator:
    """Turns a call's peer certificate into an Identity, checking the CRL on every call, and holds the
    identity to `max_calls` calls at once (CallLimit).

    A certificate is checked as a leaf of the federation CA once, then its Identity is cached."""

    def __init__(self, crl: RevocationList, *, max_calls: int | None = None):
        self._crl = crl
        self._cache: dict[bytes, Identity] = {}
        self._lock = threading.Lock()
        self.calls = CallLimit(max_calls)

    def identify(self, context: grpc.ServicerContext) -> Identity:
        """The caller's identity, its certificate checked against the CRL on every call: by parsing it the first
        time, by its serial afterwards (the identity is kept by the certificate's exact bytes)."""
        pem = caller_certificate(context)
        with self._lock:
            ident = self._cache.get(pem)
        if ident is None:
            self._crl.check(pem)
            check_leaf(pem, self._crl.ca_pem)
            ident = identity_from_cert(pem)
            with self._lock:
                self._cache[pem] = ident
        elif self._crl.revoked(ident.serial):
            raise revoked_error(f"{ident.kind} {ident.name!r}", ident.serial)
        return ident

    def revoked(self, serial: int) -> bool:
        """Whether a certificate serial is on the CRL the calls are checked against (RevocationList.revoked)."""
        return self._crl.revoked(serial)

    def still_valid(self, who: Identity) -> None:
        """Raise errors.Unauthenticated if `who`'s certificate was revoked since its call began (a long poll)."""
        if self._crl.revoked(who.serial):
            raise revoked_error(f"{who.kind} {who.name!r}", who.serial)


def caller_certificate(context: grpc.ServicerContext) -> bytes:
    """The PEM certificate the caller presented (TLS verified it against the federation CA)."""
    certs = context.auth_context().get("x509_pem_cert")
    if not certs:
        raise errors.Unauthenticated("no client certificate was presented; connect with your kit's cert.pem/key.pem")
    return certs[0]


def authorize(ident: Identity, *, kind: str | tuple[str, ...], min_role: str | None = None) -> None:
    """Raise errors.PermissionDenied unless the caller's certificate is of `kind` (one, or any of a tuple)
    and, with `min_role`, an admin's of that role or higher."""
    kinds = _kinds(kind)
    if ident.kind not in kinds:
        raise errors.PermissionDenied(
            f"{ident.kind} certificate {ident.name!r} cannot call this method; it needs "
            f"{'an' if kinds[0][0] in 'aeiou' else 'a'} {' or '.join(kinds)} certificate")
    if min_role is not None and ROLE_RANK.get(ident.role or "", -1) < ROLE_RANK[min_role]:
        raise errors.PermissionDenied(
            f"admin {ident.name!r} has role {ident.role!r}; this call needs role {min_role!r} or higher "
            f"(issue a certificate with `plexus pki add-admin DIR NAME --role {min_role}`)")


_logged_trouble = ""


def _storage_trouble(method: str, exc: BaseException) -> None:
    """Log a storage failure met by a call once per distinct failure, not with a traceback per call."""
    global _logged_trouble
    text = f"{type(exc).__name__}: {exc}"
    if text != _logged_trouble:
        _logged_trouble = text
        log.error("%s: cannot use the state dir (%s); calls that write it are answered UNAVAILABLE until it can "
                  "(free space under it)", method, text)


def guarded(*, kind: str | tuple[str, ...], min_role: str | None = None):
    """Decorate a servicer method: authenticate, authorise (a certificate of `kind`, or of any kind in a
    tuple), count the call against its identity's limit (self.auth.calls) for as long as it runs, map errors
    to status codes.

    The method receives the caller's Identity as a keyword argument `who`.
    Works for unary and server-streaming (generator) methods; a stream holds its call slot until it ends.
    """
    kinds = _kinds(kind)   # checked once, when the method is defined
    if min_role is not None and (kinds != ("admin",) or min_role not in ROLE_RANK):
        raise ValueError(f"min_role={min_role!r} needs kind='admin' and one of {sorted(ROLE_RANK)}: only admin "
                         "certificates carry a role")

    def decorate(method):
        def _prologue(self, context):
            ident = self.auth.identify(context)
            authorize(ident, kind=kinds, min_role=min_role)
            return ident

        def _abort(context, exc):
            if errors.storage_failure(exc):   # the coordinator's disk, not the caller: it may try again later
                _storage_trouble(method.__name__, exc)
                exc = errors.Unavailable("the coordinator cannot write its state dir now (the operator has the "
                                         "details in its log); try again later")
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
                    with self.auth.calls.hold(who):
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
                with self.auth.calls.hold(who):
                    return method(self, request, context, who=who)
            except Exception as exc:
                if isinstance(exc, grpc.RpcError) or context.code() is not None:
                    raise
                _abort(context, exc)
        return unary

    return decorate


def _kinds(kind: str | tuple[str, ...]) -> tuple[str, ...]:
    """`kind` as a tuple of certificate kinds, each one of identity.KINDS."""
    kinds = (kind,) if isinstance(kind, str) else kind
    if not isinstance(kinds, tuple) or not kinds or not all(isinstance(k, str) for k in kinds):
        raise TypeError(f"kind must be a certificate kind or a non-empty tuple of them, not {kind!r}")
    if unknown := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"unknown certificate kind {unknown[0]!r}; expected one of {sorted(KINDS)}")
    return kinds


class SendWatchdog:
    """Cancels a server stream whose client stops taking its messages for `idle_s`: a stalled download
    would otherwise hold its worker thread and transfer slot for as long as the client keeps the
    connection open. One thread watches every stream; it runs while there are streams to watch."""

    LINGER_S = 1.0   # how long the thread waits for another stream before it ends

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._due: dict[object, tuple[float, grpc.ServicerContext]] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def paced(self, messages, context: grpc.ServicerContext):
        """Yield from `messages`, each within idle_s of being handed to gRPC (which blocks while the client's
        flow-control window is full), else the call is cancelled and the stream ends."""
        key = object()
        try:
            for message in messages:
                self._arm(key, context)
                yield message
                self._disarm(key)
        finally:
            self._disarm(key)
            messages.close()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _arm(self, key, context) -> None:
        with self._cv:
            # A new deadline is never earlier than those armed before it (the same idle_s from later), so the
            # thread, waiting for the earliest, needs a wake-up only when nothing was armed (it lingers then):
            # not one per message.
            first = not self._due
            self._due[key] = (time.monotonic() + self.idle_s, context)
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="plexus-send-watchdog", daemon=True)
                self._thread.start()
            elif first:
                self._cv.notify_all()

    def _disarm(self, key) -> None:
        with self._cv:
            self._due.pop(key, None)

    def _run(self) -> None:
        with self._cv:
            idle_since = None
            while not self._stopping:
                now = time.monotonic()
                for key, (at, context) in list(self._due.items()):
                    if at <= now:
                        del self._due[key]
                        log.warning("cancelled a stream to %s: it took no message for %g s "
                                    "(stream_idle_timeout_s)", context.peer(), self.idle_s)
                        context.cancel()
                if self._due:
                    idle_since = None
                    # At most LINGER_S: a disarm does not wake the thread, which would otherwise sleep out the
                    # idle_s of the last stream after it ended, and outlive its streams by that much.
                    self._cv.wait(min(self.LINGER_S, min(at for at, _ in self._due.values()) - now))
                    continue
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= self.LINGER_S:
                    break
                self._cv.wait(self.LINGER_S)
            self._thread = None
