"""A relay's kit on the wire, over real gRPC on 127.0.0.1: to its children it is their server (they verify its
certificate against the host they dial, as they do the coordinator's), and to its parent it is a client."""

from __future__ import annotations

from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from plexus import health as probe, pki, transport
from plexus.identity import load_kit


@pytest.fixture
def fed(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "Relay Fed", hosts=["fl.example.org"])
    return root


@contextmanager
def serving(kit_dir):
    """A gRPC server with mTLS on 127.0.0.1 (port 0) presenting the kit in `kit_dir`, carrying grpc.health.v1."""
    executor = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-relay-kit")
    srv, port = transport.server(load_kit(kit_dir), "127.0.0.1:0", executor=executor)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    srv.start()
    try:
        yield port
    finally:
        srv.stop(None).wait()
        executor.shutdown()


def _check_as(kit_dir, port: int, name: str) -> str:
    """Health-check 127.0.0.1:port with the kit's credentials, verifying the server's certificate for `name`."""
    kit = load_kit(kit_dir)
    credentials = grpc.ssl_channel_credentials(root_certificates=kit.ca_pem, private_key=kit.key_pem,
                                               certificate_chain=kit.cert_pem)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                             options=[("grpc.ssl_target_name_override", name)]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_a_site_completes_mutual_tls_with_its_relay(fed):
    relay = pki.add_relay(fed, "north", hosts=["relay.example.org", "10.1.2.3"])
    site = pki.add_site(fed, "cleveland")
    below = pki.add_relay(fed, "south", hosts=["south.example.org"])   # a relay one tier down dials it alike
    with serving(relay) as port:
        assert probe.check(f"127.0.0.1:{port}", kit=site) == "SERVING"   # plexus.transport.channel, as the agent
        assert probe.check(f"localhost:{port}", kit=below) == "SERVING"
        # Every name the relay was issued for verifies; a name it was not issued for does not.
        assert _check_as(site, port, "relay.example.org") == "SERVING"
        assert _check_as(site, port, "10.1.2.3") == "SERVING"
        with pytest.raises(grpc.RpcError) as err:
            _check_as(site, port, "other.example.org")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_site_certificate_cannot_stand_in_for_a_server(fed):
    """The control for the test above: a certificate that names no dialled host fails the handshake."""
    impostor, site = pki.add_site(fed, "impostor"), pki.add_site(fed, "cleveland")
    with serving(impostor) as port:
        with pytest.raises(grpc.RpcError) as err:
            probe.check(f"127.0.0.1:{port}", kit=site)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_relay_dials_its_parent_with_its_kit(fed):
    relay = pki.add_relay(fed, "north", hosts=["relay.example.org"])
    with serving(fed / "coordinator") as port:
        assert probe.check(f"127.0.0.1:{port}", kit=relay) == "SERVING"


def test_a_relay_of_another_federation_is_refused(fed, tmp_path):
    other = pki.init_federation(tmp_path / "other", "Other Fed", hosts=["fl.example.org"])
    foreign = pki.add_relay(other, "north", hosts=["relay.example.org"])
    site = pki.add_site(fed, "cleveland")
    with serving(foreign) as port:   # as a server to this federation's site
        with pytest.raises(grpc.RpcError) as err:
            probe.check(f"127.0.0.1:{port}", kit=site)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with serving(fed / "coordinator") as port:   # as a client of this federation's coordinator
        with pytest.raises(grpc.RpcError) as err:
            probe.check(f"127.0.0.1:{port}", kit=foreign)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


def test_a_site_issued_via_a_relay_dials_the_relay(tmp_path):
    from plexus.cli import main as cli
    from plexus.config import load_site_config
    from plexus.errors import ConfigError

    root = pki.init_federation(tmp_path / "fed", "via", hosts=["coord.example.org"])
    pki.add_relay(root, "north", hosts=["relay-north.example.org", "10.0.0.5"], port=9443)
    kit = pki.add_site(root, "clinic", via="north")
    assert load_site_config(kit / "site.yaml").coordinator == "relay-north.example.org:9443"
    assert load_site_config(pki.add_site(root, "direct") / "site.yaml").coordinator == "coord.example.org:8443"
    assert cli(["pki", "add-site", str(root), "lab", "--via", "north"]) == 0
    assert load_site_config(root / "sites" / "lab" / "site.yaml").coordinator == "relay-north.example.org:9443"
    with pytest.raises(ConfigError, match="no relay of that name in this federation \\(relays: north\\)"):
        pki.add_site(root, "nowhere", via="south")
    assert not (root / "sites" / "nowhere").exists()
