"""plexus.rpc's authorisation: which certificate kinds may call a method, checked over real gRPC with mTLS."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plexus import errors, pki, transport
from plexus.identity import Identity, RevocationList, load_kit
from plexus.rpc import Authenticator, SendWatchdog, authorize, guarded

SITE = Identity("cleveland", "site", None, 1)
RELAY = Identity("north", "relay", None, 2)
ADMIN = Identity("alice", "admin", "operator", 3)


def test_authorize_takes_one_kind_or_a_tuple_and_names_them_all():
    authorize(SITE, kind="site")
    for who in (SITE, RELAY):
        authorize(who, kind=("site", "relay"))
    with pytest.raises(errors.PermissionDenied, match="admin certificate 'alice' cannot call this method; "
                                                      "it needs a site or relay certificate"):
        authorize(ADMIN, kind=("site", "relay"))
    with pytest.raises(errors.PermissionDenied, match="relay certificate 'north'.*needs an admin certificate"):
        authorize(RELAY, kind="admin", min_role="viewer")
    authorize(ADMIN, kind="admin", min_role="operator")
    with pytest.raises(errors.PermissionDenied, match="role 'operator'; this call needs role 'admin'"):
        authorize(ADMIN, kind="admin", min_role="admin")


@pytest.mark.parametrize("kw, error, match", [
    ({"kind": "hospital"}, ValueError, r"unknown certificate kind 'hospital'; expected one of \['admin', "),
    ({"kind": ("site", "relays")}, ValueError, "unknown certificate kind 'relays'"),
    ({"kind": ()}, TypeError, "non-empty tuple"), ({"kind": ["site"]}, TypeError, "non-empty tuple"),
    ({"kind": ("site", "relay"), "min_role": "viewer"}, ValueError, "only admin certificates carry a role"),
    ({"kind": "admin", "min_role": "root"}, ValueError, "one of"),
])
def test_guarded_refuses_a_kind_or_role_that_cannot_be_met_when_the_method_is_defined(kw, error, match):
    with pytest.raises(error, match=match):
        guarded(**kw)


class _Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1's Check, open to the kinds that call the Federation service."""

    def __init__(self, auth: Authenticator):
        self.auth = auth
        self.callers: list[Identity] = []
        self.fail: BaseException | None = None

    @guarded(kind=("site", "relay"))
    def Check(self, request, context, *, who):
        if self.fail is not None:
            raise self.fail
        self.callers.append(who)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _check(kit_dir, port: int) -> None:
    with transport.channel(load_kit(kit_dir), f"127.0.0.1:{port}") as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)


def test_sites_and_relays_pass_a_guard_for_both_and_admins_do_not(tmp_path, caplog):
    root = pki.init_federation(tmp_path / "pki", "Rpc Fed", hosts=["127.0.0.1"])
    site, relay = pki.add_site(root, "cleveland"), pki.add_relay(root, "north", hosts=["127.0.0.1"])
    admin = pki.add_admin(root, "alice", role="admin")
    kit = load_kit(root / "coordinator")
    servicer = _Health(Authenticator(RevocationList(root / "coordinator" / "crl.pem", kit.ca_pem)))
    executor = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-rpc")
    srv, port = transport.server(kit, "127.0.0.1:0", executor=executor)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    srv.start()
    try:
        _check(site, port)
        _check(relay, port)
        assert [(who.name, who.kind) for who in servicer.callers] == [("cleveland", "site"), ("north", "relay")]
        with pytest.raises(grpc.RpcError) as err:
            _check(admin, port)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "needs a site or relay certificate" in err.value.details()
        pki.revoke(root, "north")
        with pytest.raises(grpc.RpcError) as err:
            _check(relay, port)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "relay 'north'" in err.value.details() and "revoked" in err.value.details()
        assert len(servicer.callers) == 2
        # The coordinator's own disk is full: the caller is told to come back later, the log says it once.
        servicer.fail = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/state/plexus.db")
        with caplog.at_level(logging.ERROR, logger="plexus.rpc"):
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as err:
                    _check(site, port)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert err.value.details() == ("the coordinator cannot write its state dir now (the operator has the "
                                               "details in its log); try again later")
        (record,) = [r for r in caplog.records if r.name == "plexus.rpc" and r.levelno == logging.ERROR]
        assert "Check: cannot use the state dir (OSError: [Errno 28] No space left on device: '/state/plexus.db')" \
            in record.getMessage() and record.exc_info is None
    finally:
        srv.stop(None).wait()
        executor.shutdown()


class _Context:
    def __init__(self):
        self.cancelled = threading.Event()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def cancel(self) -> None:
        self.cancelled.set()


def test_the_send_watchdog_cancels_a_stalled_stream_and_ends_soon_after_its_streams():
    """Before: after its last stream ended the watchdog's thread slept out that stream's idle_s (30 s by default)
    before it could end; a test waiting for the threads it started waited that long (a 29.6 s teardown)."""
    watchdog = SendWatchdog(idle_s=30.0)
    context = _Context()
    stream = watchdog.paced((m for m in (b"a", b"b")), context)
    assert next(stream) == b"a" and next(stream) == b"b"
    thread = watchdog._thread
    time.sleep(0.2)   # the thread waits for b's deadline, 30 s on
    assert list(stream) == []   # the stream ends
    thread.join(3 * SendWatchdog.LINGER_S + 1)
    assert not thread.is_alive() and not context.cancelled.is_set()

    quick = SendWatchdog(idle_s=0.2)
    stalled = quick.paced((m for m in (b"a", b"b")), context)
    assert next(stalled) == b"a"   # handed to gRPC, which the client never drains
    assert context.cancelled.wait(5), "the stalled stream was not cancelled"
    stalled.close()
    quick.stop()
