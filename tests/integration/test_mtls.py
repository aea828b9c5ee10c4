"""Who may talk to the coordinator: only certificates from this federation's CA, unrevoked, in role."""

from __future__ import annotations

import dataclasses
import json
import threading

import grpc
import pytest

from coordinator.server import Coordinator
from plexus import identity, pki
from plexus.config import CoordinatorConfig, SiteConfig
from plexus.errors import ConfigError
from plexus.proto.plexus.v1 import admin_pb2, admin_pb2_grpc, federation_pb2 as fpb, federation_pb2_grpc
from site_agent.agent import SiteAgent

from integration.harness import Federation, expected_mean, heart_job, long_poll, wait_until


def _admin_stub(channel):
    return admin_pb2_grpc.AdminStub(channel)


def test_no_client_certificate_is_refused(federation):
    ca = (federation.root / "ca" / "ca.pem").read_bytes()
    with grpc.secure_channel(federation.address, grpc.ssl_channel_credentials(root_certificates=ca)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _admin_stub(channel).ListJobs(admin_pb2.ListJobsRequest(), timeout=5)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


def test_plaintext_is_refused(federation):
    with grpc.insecure_channel(federation.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _admin_stub(channel).ListJobs(admin_pb2.ListJobsRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_certificate_from_another_ca_is_refused(federation, tmp_path):
    other = tmp_path / "other"
    pki.init_federation(other, "other-federation", hosts=["127.0.0.1"])
    foreign = identity.load_kit(pki.add_admin(other, "mallory", role="admin"))
    ca = (federation.root / "ca" / "ca.pem").read_bytes()  # the attacker even trusts the right server
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=foreign.key_pem,
                                               certificate_chain=foreign.cert_pem)
    with grpc.secure_channel(federation.address, credentials) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _admin_stub(channel).ListJobs(admin_pb2.ListJobsRequest(), timeout=5)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


def test_revoked_site_is_refused_on_its_next_call(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "revocation-test", hosts=["127.0.0.1"])
    pki.add_site(root, "a")
    pki.add_site(root, "b")
    fed = Federation(root, tmp_path / "state")
    try:
        a, b = fed.raw_site("a"), fed.raw_site("b")
        assert b.join().site == "b"
        pki.revoke(root, "b")
        with pytest.raises(grpc.RpcError) as err:
            b.join()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in err.value.details()
        assert a.join().site == "a"  # others are untouched
    finally:
        fed.close()


def test_a_site_revoked_while_it_long_polls_is_refused_at_once_and_counts_offline(tmp_path):
    """Its poll, 30 s long, ends with the refusal within a couple of the coordinator's CRL looks (1 s apart), and
    the site is out of the online set a round's quorum counts, though its last call was a moment ago."""
    root = tmp_path / "pki"
    pki.init_federation(root, "revocation-test", hosts=["127.0.0.1"])
    pki.add_site(root, "a")
    pki.add_site(root, "b")
    fed = Federation(root, tmp_path / "state", poll_timeout_s=30.0)
    try:
        a, b = fed.raw_site("a"), fed.raw_site("b")
        a.join()
        b.join()
        engine = fed.coordinator.engine
        polling, outcome = long_poll(b, engine)
        assert engine.online_sites() == {"a", "b"}
        pki.revoke(root, "b")
        polling.join(timeout=20)
        assert not polling.is_alive() and "task" not in outcome, outcome
        assert outcome["error"].code() == grpc.StatusCode.UNAUTHENTICATED
        assert "certificate of site 'b'" in outcome["error"].details() and "revoked" in outcome["error"].details()
        assert outcome["after_s"] < 10, outcome   # the poll would have waited 30 s
        assert engine.online_sites() == {"a"}
        assert a.join().site == "a"   # others are untouched
    finally:
        fed.close()


def test_an_update_streaming_when_its_site_is_revoked_is_cut_and_never_counts(tmp_path):
    """b's update is half in the round's sum when b is revoked: b's task is failed at once, the rest of its stream
    is refused, its half comes out of the sum again, and the round closes with a's and c's updates (without
    waiting for its 60 s deadline), their mean alone."""
    root = tmp_path / "pki"
    pki.init_federation(root, "revocation-test", hosts=["127.0.0.1"])
    for name in ("a", "b", "c"):
        pki.add_site(root, name)
    pki.add_admin(root, "ops", role="operator")
    fed = Federation(root, tmp_path / "state")
    try:
        sites = {name: fed.raw_site(name) for name in ("a", "b", "c")}
        for site in sites.values():
            site.join()
        fed.wait_online("a", "b", "c")
        job_id = fed.admin().submit(heart_job(rounds=1, min=2, deadline=60)).job_id
        tasks = {name: site.next_task() for name, site in sites.items()}
        layout, state = sites["a"].fetch(tasks["a"])
        release, outcome = threading.Event(), {}

        def revoked_midway():
            try:
                sites["b"].submit(tasks["b"], {k: v * 100 for k, v in state.items()}, num_samples=1000, chunk=24,
                                  pause=(layout.total_bytes // 2, release), timeout=30)
            except grpc.RpcError as exc:
                outcome["error"] = exc
        streaming = threading.Thread(target=revoked_midway)
        streaming.start()
        wait_until(lambda: "b" in fed.coordinator.engine.driver.round.folding, 10, "b's update to be arriving")
        pki.revoke(root, "b")
        release.set()
        streaming.join(timeout=20)
        assert outcome["error"].code() == grpc.StatusCode.UNAUTHENTICATED, outcome
        assert "certificate of site 'b'" in outcome["error"].details()
        sent = {"a": ({k: v + 0.25 for k, v in state.items()}, 10), "c": ({k: v * -0.5 for k, v in state.items()}, 30)}
        for name, (update, samples) in sent.items():
            sites[name].submit(tasks[name], update, num_samples=samples)
        wait_until(lambda: fed.store.job(job_id).current_round == 1, 20, "round 1 to close")
        failed = next(e for e in fed.store.site_events(job_id) if e.site == "b")
        assert "revoked" in failed.reason, failed
        closed = next(r for r in fed.store.rounds(job_id) if r.round == 1)
        assert sorted(json.loads(closed.contributors)) == ["a", "c"]
        got, want = fed.store.load_checkpoint(job_id, 1), expected_mean(layout, sent)
        assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
    finally:
        fed.close()


def test_an_admin_revoked_while_it_watches_a_job_gets_no_further_event(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "revocation-test", hosts=["127.0.0.1"])
    pki.add_admin(root, "ops", role="operator")
    pki.add_admin(root, "watcher", role="viewer")
    fed = Federation(root, tmp_path / "state")
    try:
        job_id = fed.admin("ops").submit(heart_job()).job_id   # waits for sites that never come
        events = fed.admin("watcher").watch(job_id)
        assert next(events).kind == "job_submitted"
        pki.revoke(root, "watcher")
        fed.admin("ops").abort(job_id)   # an event the watch would send next
        seen = []
        with pytest.raises(grpc.RpcError) as err:
            seen.extend(event.kind for event in events)   # what was on its way before the revocation, then the end
        assert "job_aborted" not in seen, seen
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "certificate of admin 'watcher'" in err.value.details()
    finally:
        fed.close()


# A model far larger than what gRPC's flow control lets the coordinator send ahead of a reader that has stopped.
BIG_JOB = """\
name: big
model: {name: vector, args: {size: 8000000}}
data: {dataset: heart-disease}
rounds: 1
sites: {min: 1, deadline_s: 60}
train: {epochs: 1, batch_size: 32, optimizer: {name: sgd, lr: 0.1}}
"""


def _cut_when_revoked(stream, revoke, revoked) -> tuple[int, str]:
    """Read `stream`'s header, revoke its caller (revoke()), wait until the coordinator has heard (revoked()),
    then read on: the stream must end with the refusal, not with the model. Returns the chunk bytes that came and
    the refusal's details."""
    assert next(stream).WhichOneof("body") == "header"
    revoke()
    wait_until(revoked, 10, "the coordinator to hear of the revocation")
    got = 0
    with pytest.raises(grpc.RpcError) as err:
        for message in stream:
            got += len(message.chunk.data)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    return got, err.value.details()


def test_a_model_download_under_way_when_its_caller_is_revoked_is_cut(tmp_path):
    """A site's FetchModel and an admin's DownloadModel, each stopped by its reader after the header, are refused
    once their caller is revoked: the rest of the 32 MB model never goes out."""
    root = tmp_path / "pki"
    pki.init_federation(root, "revocation-test", hosts=["127.0.0.1"])
    pki.add_site(root, "b")
    pki.add_admin(root, "ops", role="operator")
    pki.add_admin(root, "reader", role="operator")   # downloading a model takes an operator
    fed = Federation(root, tmp_path / "state")
    try:
        b = fed.raw_site("b")
        b.join({"heart-disease": 100})
        job_id = fed.admin().submit(BIG_JOB).job_id
        task = b.next_task()
        total = 8_000_000 * 4

        download = fed.admin("reader").stub.DownloadModel(admin_pb2.DownloadRequest(job_id=job_id, round=0),
                                                          timeout=30)
        got, details = _cut_when_revoked(download, lambda: pki.revoke(root, "reader"), lambda: any(
            e.action == "certificate_revoked" for e in fed.coordinator.audit_log.entries()))
        assert got < total // 2, got
        assert "certificate of admin 'reader'" in details

        fetch = b.stub.FetchModel(fpb.FetchModelRequest(task_id=task.task_id), timeout=30)
        got, details = _cut_when_revoked(fetch, lambda: pki.revoke(root, "b"),
                                         lambda: "b" not in fed.coordinator.engine.online_sites())
        assert got < total // 2, got
        assert "certificate of site 'b'" in details
    finally:
        fed.close()


def test_viewer_cannot_submit_or_abort_but_can_read(federation):
    viewer, ops = federation.admin("viewer"), federation.admin("ops")
    with pytest.raises(grpc.RpcError) as err:
        viewer.submit(heart_job())
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "viewer" in err.value.details() and "operator" in err.value.details()
    job_id = ops.submit(heart_job()).job_id
    with pytest.raises(grpc.RpcError) as err:
        viewer.abort(job_id)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [j.job_id for j in viewer.jobs()] == [job_id]
    assert viewer.job(job_id).summary.status in ("queued", "running")


def test_site_and_admin_certificates_cannot_cross_services(federation):
    site = federation.raw_site("a")
    with pytest.raises(grpc.RpcError) as err:
        _admin_stub(site.channel).ListJobs(admin_pb2.ListJobsRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    ops = federation.admin("ops")
    with pytest.raises(grpc.RpcError) as err:
        federation_pb2_grpc.FederationStub(ops.channel).Join(fpb.JoinRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_identity_comes_from_the_certificate(federation):
    reply = federation.raw_site("c").join()
    assert reply.site == "c" and reply.federation == "test-federation"
    assert [s.site for s in federation.admin().sites()] == ["c"]


def test_bad_round_config_is_rejected_with_key_and_line(federation):
    ops = federation.admin()
    with pytest.raises(grpc.RpcError) as err:
        ops.submit(heart_job().replace("rounds: 2", "rounds: 2\nbogus_key: 1"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bogus_key" in err.value.details() and ":5:" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        ops.submit(heart_job(model="resnet9000"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resnet9000" in err.value.details() and "logistic" in err.value.details()
    assert ops.jobs() == []


def test_a_coordinator_or_site_given_someone_else_s_kit_refuses_to_start(tmp_path):
    """Caught at start, with the fix, not at the first peer as a TLS error or a refusal retried forever."""
    root = tmp_path / "pki"
    pki.init_federation(root, "kits", hosts=["127.0.0.1"])
    pki.add_site(root, "cleveland")
    pki.add_admin(root, "ops", role="operator")
    config = CoordinatorConfig(listen="127.0.0.1:0", kit=root / "admins" / "ops", state_dir=tmp_path / "state",
                               crl=root / "coordinator" / "crl.pem")
    with pytest.raises(ConfigError, match=r"the kit's certificate is admin 'ops''s; this needs a coordinator's kit"):
        Coordinator(config)
    site = SiteConfig(site="hungary", coordinator="127.0.0.1:1", kit=root / "sites" / "cleveland",
                      state_dir=tmp_path / "site", datasets={})
    with pytest.raises(ConfigError, match=r"the kit is site 'cleveland''s, but the config says `site: hungary`"):
        SiteAgent(site)
    with pytest.raises(ConfigError, match=r"is admin 'ops''s; this needs a site's kit"):
        SiteAgent(dataclasses.replace(site, site="ops", kit=root / "admins" / "ops"))
