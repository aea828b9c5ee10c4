"""Relays: a tier between sites and the coordinator, over mTLS on loopback. A FedAvg job through relays ends
with the model of a flat federation of the same sites, bit for bit; a relay killed mid-job comes back and
the job still ends with those bits."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import signal

import grpc
import numpy as np
import pytest

from coordinator.aggregate import MAX_WEIGHT
from coordinator.store import SiteRow
from coordinator.tasks import site_seed
from plexus import pki
from plexus.cli import main as cli
from plexus.config import DatasetSpec, RelayConfig, TierSpec, parse_round_config
from plexus.datasets import heart_disease
from plexus.models import build_model, load_numpy_state, state_to_numpy
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from relay.server import Relay
from relay.upstream import join_request
from site_agent.agent import SiteAgent
from site_agent.training import train_local

from integration.harness import DropsOut, Federation, RawSite, free_port, heart_job, long_poll, scaled, wait_until
from integration.test_secure_aggregation import DROPOUT_PHASE_S

RELAYS = ("relay-1", "relay-2")
TREE = {"relay-1": ("a", "b"), "relay-2": ("c",)}   # and d dials the coordinator itself


@pytest.fixture(scope="module")
def relay_kits(pki_root):
    for name in RELAYS:
        if not (pki_root / "relays" / name).exists():
            pki.add_relay(pki_root, name, hosts=["127.0.0.1"])
    return pki_root


def relay_config(root, name: str, parent: str, state_dir, *, sites_min: int = 1,
                 max_model_bytes: int | None = None) -> RelayConfig:
    return RelayConfig(parent=parent, listen="127.0.0.1:0", kit=root / "relays" / name, state_dir=state_dir,
                       crl=root / "crl.pem", tier=TierSpec(sites_min=sites_min, deadline_s=scaled(60),
                                                          max_model_bytes=max_model_bytes),
                       poll_timeout_s=1.0, rejoin_grace_s=2.0)


def final_model(fed: Federation, job_id: str) -> bytes:
    rounds = fed.store.job(job_id).current_round
    layout, blob = fed.store.checkpoint_blob(job_id, rounds)
    return bytes(blob)


class FailsRoundTwo(SiteAgent):
    """A site whose round-2 training fails (reported), in a flat federation and below a relay alike."""

    def handle(self, stub, task):
        if task.kind == fpb.TASK_TRAIN and task.round == 2:
            return self.report(stub, task, fpb.RESULT_FAILED, "the scanner's export broke (test)")
        return super().handle(stub, task)


def run_flat(root, tmp_path, job: str, failing: str = "") -> bytes:
    fed = Federation(root, tmp_path / "flat")
    try:
        for name in "abcd":
            fed.start_site(name, agent_cls=FailsRoundTwo if name == failing else SiteAgent)
        fed.wait_online(*"abcd")
        job_id = fed.admin().submit(job).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        return final_model(fed, job_id)
    finally:
        fed.close()


def start_tree(fed: Federation, root, tmp_path, failing: str = "") -> list[Relay]:
    relays = []
    for name, children in TREE.items():
        relay = Relay(relay_config(root, name, fed.address, tmp_path / name,
                                   sites_min=len(children) - (failing in children)))
        relay.start()
        relays.append(relay)
        for child in children:
            fed.start_site(child, coordinator=f"127.0.0.1:{relay.port}",
                           agent_cls=FailsRoundTwo if child == failing else SiteAgent)
    fed.start_site("d")
    for relay, children in zip(relays, TREE.values()):
        wait_until(lambda r=relay, c=children: set(c) <= r.tier.engine.online_sites(), scaled(30),
                   f"{children} online at their relay")
    fed.wait_online(*RELAYS, "d")
    return relays


JOB = heart_job(name="tiers", model="mlp", rounds=3, min=2, seed=11)


def test_fedavg_through_relays_is_bit_identical_to_a_flat_federation(relay_kits, tmp_path, capsys):
    flat = run_flat(relay_kits, tmp_path, JOB)
    fed = Federation(relay_kits, tmp_path / "tiered")
    relays = []
    try:
        relays = start_tree(fed, relay_kits, tmp_path)
        job_id = fed.admin().submit(JOB).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        assert final_model(fed, job_id) == flat
        # The coordinator saw three contributors a round: two relays (3 sites' updates) and d.
        rounds = [r for r in fed.store.rounds(job_id) if r.kind == "train"]
        assert [sorted(json.loads(r.contributors)) for r in rounds] == [["d", *RELAYS]] * 3
        # Each relay ran the same rounds at its tier, its children contributing.
        for relay, children in zip(relays, TREE.values()):
            tier = [r for r in relay.tier.store.rounds(job_id) if r.kind == "train"]
            assert [(r.round, r.status, sorted(json.loads(r.contributors))) for r in tier] == \
                [(n, "closed", sorted(children)) for n in (1, 2, 3)]
        # sites list: the relays, each with its children.
        listed = {s.site: s for s in fed.admin().sites()}
        assert listed["relay-1"].kind == "relay" and list(listed["relay-1"].children) == ["a", "b"]
        assert listed["relay-2"].kind == "relay" and list(listed["relay-2"].children) == ["c"]
        assert listed["d"].kind == "site" and not listed["d"].children
        capsys.readouterr()
        assert cli(["sites", "list", *fed.cli_args("viewer")]) == 0
        shown = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:]]
        assert [cells[:2] if cells[0] == "└" else cells[:1] for cells in shown] == \
            [["d"], ["relay-1"], ["└", "a"], ["└", "b"], ["relay-2"], ["└", "c"]]
        # A relay's weight is its children's rows.
        rows = {s: json.loads(r.dataset_rows) for s, r in ((r.name, r) for r in fed.store.sites())}
        child_rows = {r.name: json.loads(r.dataset_rows) for r in relays[0].tier.store.sites()}
        assert rows["relay-1"]["heart-disease"] == sum(child_rows[c]["heart-disease"] for c in ("a", "b"))
    finally:
        for relay in relays:
            relay.stop()
        fed.close()


def test_a_child_failing_at_a_relay_s_tier_leaves_the_flat_federation_s_model(relay_kits, tmp_path):
    """b fails round 2 both times: flat, the coordinator sums a, c, d; tiered, relay-1 sends a's update alone."""
    flat = run_flat(relay_kits, tmp_path, JOB, failing="b")
    fed = Federation(relay_kits, tmp_path / "tiered")
    relays = []
    try:
        relays = start_tree(fed, relay_kits, tmp_path, failing="b")
        job_id = fed.admin().submit(JOB).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        assert final_model(fed, job_id) == flat
        tier = {r.round: r for r in relays[0].tier.store.rounds(job_id) if r.kind == "train"}
        assert json.loads(tier[2].contributors) == ["a"] and json.loads(tier[1].contributors) == ["a", "b"]
        failed = [e for e in relays[0].tier.store.site_events(job_id) if e.site == "b" and e.round == 2]
        assert [e.status for e in failed] == ["failed"] and "scanner" in failed[0].reason
    finally:
        for relay in relays:
            relay.stop()
        fed.close()


def test_a_task_the_relay_fails_on_is_reported_and_the_relay_keeps_serving_its_parent(relay_kits, tmp_path,
                                                                                       monkeypatch):
    """Before: anything but a gRPC error (a parent's model too large to assemble: MemoryError) ended the relay's
    thread to its parent for good, while it still served its children and the parent still listed it online."""
    import relay.upstream

    real, calls = relay.upstream.Upstream._fetch, []

    def fetch(self, stub, task):
        calls.append(task.round)
        if len(calls) == 1:
            raise MemoryError("the parent's model does not fit (test)")
        return real(self, stub, task)

    monkeypatch.setattr(relay.upstream.Upstream, "_fetch", fetch)
    fed = Federation(relay_kits, tmp_path / "coordinator")
    tier = Relay(relay_config(relay_kits, "relay-1", fed.address, tmp_path / "relay-1"))
    tier.start()
    try:
        fed.start_site("a", coordinator=f"127.0.0.1:{tier.port}")
        fed.start_site("d")
        fed.wait_online("relay-1", "d")
        job_id = fed.admin().submit(heart_job(name="fails-once", rounds=2, min=1)).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        events = {(e.round, e.site): e for e in fed.store.site_events(job_id)}
        assert events[1, "relay-1"].status == "failed"
        assert events[1, "relay-1"].reason == "the relay failed: MemoryError: the parent's model does not fit (test)"
        assert events[2, "relay-1"].status == "submitted" and calls[:2] == [1, 2]
    finally:
        tier.stop()
        fed.close()


def test_a_model_over_the_relay_s_cap_is_refused_before_it_is_taken_in(relay_kits, tmp_path):
    """Before: a relay assembled whatever model its parent sent, whole, then copied it (2**38 float32s: a
    MemoryError that ended its thread to the parent)."""
    fed = Federation(relay_kits, tmp_path / "coordinator")
    tier = Relay(relay_config(relay_kits, "relay-1", fed.address, tmp_path / "relay-1", max_model_bytes=1 << 20))
    tier.start()
    try:
        fed.start_site("a", coordinator=f"127.0.0.1:{tier.port}")
        fed.start_site("d")
        fed.wait_online("relay-1", "d")
        job = heart_job(name="wide", model="mlp", rounds=1, min=1).replace(
            "{in_features: 13, num_classes: 2}", "{in_features: 13, hidden: [2048, 128], num_classes: 2}")
        job_id = fed.admin().submit(job).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        events = {(e.round, e.site): e for e in fed.store.site_events(job_id)}
        assert events[1, "relay-1"].status == "failed" and events[1, "d"].status == "submitted"
        assert events[1, "relay-1"].reason.startswith("the parent's model is unusable: it holds 1,164,808 bytes, "
                                                      "over this relay's tier.max_model_bytes (1,048,576 bytes)")
    finally:
        tier.stop()
        fed.close()


def test_a_child_s_own_policy_is_enforced_at_the_child_below_a_relay(relay_kits, tmp_path):
    """b allows only logistic models: below relay-1 it declines the mlp job itself, and relay-1 stands for a."""
    fed = Federation(relay_kits, tmp_path / "coordinator")
    relay = Relay(relay_config(relay_kits, "relay-1", fed.address, tmp_path / "relay-1"))
    relay.start()
    try:
        fed.start_site("a", coordinator=f"127.0.0.1:{relay.port}")
        fed.start_site("b", coordinator=f"127.0.0.1:{relay.port}", allowed_models=("logistic",))
        wait_until(lambda: {"a", "b"} <= relay.tier.engine.online_sites(), scaled(30), "a and b at relay-1")
        fed.wait_online("relay-1")
        job_id = fed.admin().submit(JOB.replace("rounds: 3", "rounds: 1").replace("min: 2", "min: 1")).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        declines = relay.tier.store.declines(job_id)
        assert list(declines) == ["b"] and "policy.allowed_models ['logistic']" in declines["b"]
        tier = next(r for r in relay.tier.store.rounds(job_id) if r.round == 1)
        assert json.loads(tier.contributors) == ["a"]
        assert json.loads(next(r for r in fed.store.rounds(job_id) if r.round == 1).contributors) == ["relay-1"]
    finally:
        relay.stop()
        fed.close()


def test_a_relay_refuses_jobs_submitted_to_it(relay_kits, tmp_path):
    fed = Federation(relay_kits, tmp_path / "coordinator")
    relay = Relay(relay_config(relay_kits, "relay-1", fed.address, tmp_path / "relay"))
    relay.start()
    try:
        from plexus.admin_client import AdminClient
        with AdminClient(f"127.0.0.1:{relay.port}", relay_kits / "admins" / "ops") as admin:
            with pytest.raises(grpc.RpcError) as refused:
                admin.submit(JOB)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this is a relay" in refused.value.details()
    finally:
        relay.stop()
        fed.close()


def test_a_relay_declines_what_it_cannot_run_and_the_job_goes_on(relay_kits, tmp_path):
    fed = Federation(relay_kits, tmp_path / "coordinator")
    relays = []
    try:
        relays = start_tree(fed, relay_kits, tmp_path)
        robust = JOB.replace("name: tiers", "name: robust") + "strategy: {name: median}\n"
        job_id = fed.admin().submit(robust.replace("min: 2", "min: 1")).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        declines = fed.store.declines(job_id)
        assert set(declines) == set(RELAYS)
        assert "strategy median does not run through relays yet" in declines["relay-1"]
        split = ("name: split\nmodel: {name: mlp, args: {in_features: 13, hidden: [8, 4]}}\n"
                 "data: {dataset: heart-disease}\nrounds: 1\nmode: split\n"
                 "split: {variant: u-shaped, cuts: [hidden1, hidden2], schedule: sequential}\nsites: {min: 1}\n")
        job_id = fed.admin().submit(split).job_id
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message
        declines = fed.store.declines(job_id)
        assert set(declines) == set(RELAYS)   # d, dialling the coordinator itself, trained
        assert "a relay cannot run a split-learning job" in declines["relay-2"]
        assert json.loads(fed.store.rounds(job_id)[0].contributors) == ["d"]
    finally:
        for relay in relays:
            relay.stop()
        fed.close()


@contextlib.contextmanager
def one_relay(tmp_path, federation: str, sites: tuple[str, ...], *, revoked: tuple[str, ...] = ()):
    """A federation of its own: relay-1 in front of the coordinator, and raw sites for `sites` dialling it (those
    in `revoked` revoked before anything starts). Yields (the federation, the relay, the raw sites)."""
    root = tmp_path / "pki"
    pki.init_federation(root, federation, hosts=["127.0.0.1"])
    for name in sites:
        pki.add_site(root, name)
    pki.add_relay(root, "relay-1", hosts=["127.0.0.1"])
    for name in revoked:
        pki.revoke(root, name)
    fed = Federation(root, tmp_path / "coordinator")
    relay = Relay(relay_config(root, "relay-1", fed.address, tmp_path / "relay"))
    relay.start()
    raw = {name: RawSite(root / "sites" / name, f"127.0.0.1:{relay.port}") for name in sites}
    try:
        yield fed, relay, raw
    finally:
        for site in raw.values():
            site.close()
        relay.stop()
        fed.close()


def test_a_child_revoked_by_the_federation_crl_is_refused_by_its_relay(tmp_path):
    with one_relay(tmp_path, "revoking", ("a", "b"), revoked=("b",)) as (fed, relay, raw):
        raw["a"].join()
        with pytest.raises(grpc.RpcError) as refused:
            raw["b"].join()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in refused.value.details()
        assert [row.name for row in relay.tier.store.sites()] == ["a"]


def test_one_child_s_rows_cannot_cut_its_relay_off_its_parent(tmp_path):
    """The relay reports its children's rows summed: before, a child claiming 2**31 rows made the parent refuse
    the relay's Join on every retry (its siblings lost every job), and the row stayed in the relay's store. Now
    the relay's tier refuses that child, and rows recorded before it did are capped in the relay's Join."""
    with one_relay(tmp_path, "rows", ("a", "h")) as (fed, relay, raw):
        raw["a"].join({"heart-disease": 200})
        with pytest.raises(grpc.RpcError) as refused:
            raw["h"].join({"heart-disease": MAX_WEIGHT})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"this relay's sites would report {MAX_WEIGHT + 200} in all" in refused.value.details()
        raw["h"].join({"heart-disease": 50})   # what it really has is taken
        wait_until(lambda: any(json.loads(r.dataset_rows) == {"heart-disease": 250} for r in fed.store.sites()
                               if r.name == "relay-1"), scaled(30), "the relay's Join with its children's 250 rows")
    recorded = [SiteRow(name, 0.0, "0.1.0", "", "[]", '["heart-disease"]', "", json.dumps({"heart-disease": n}))
                for name, n in (("a", 200), ("g", MAX_WEIGHT))]   # g's, recorded before the tier refused it
    assert dict(join_request(recorded).dataset_rows) == {"heart-disease": MAX_WEIGHT}


def test_a_child_revoked_while_it_long_polls_its_relay_is_refused_at_once(tmp_path):
    """The relay's tier watches the CRL as the coordinator does: b's 30 s poll at the relay ends with the refusal
    within a few of its looks, and b leaves the online set the relay's rounds count."""
    root = tmp_path / "pki"
    pki.init_federation(root, "revoking", hosts=["127.0.0.1"])
    pki.add_site(root, "a")
    pki.add_site(root, "b")
    pki.add_relay(root, "relay-1", hosts=["127.0.0.1"])
    fed = Federation(root, tmp_path / "coordinator")
    relay = Relay(dataclasses.replace(relay_config(root, "relay-1", fed.address, tmp_path / "relay"),
                                      poll_timeout_s=30.0))
    relay.start()
    address = f"127.0.0.1:{relay.port}"
    a, b = RawSite(root / "sites" / "a", address), RawSite(root / "sites" / "b", address)
    try:
        a.join()
        b.join()
        tier = relay.tier.engine
        wait_until(lambda: tier.online_sites() == {"a", "b"}, 10, "both children online at the relay")
        polling, outcome = long_poll(b, tier)
        pki.revoke(root, "b")
        polling.join(timeout=20)
        assert not polling.is_alive() and "task" not in outcome, outcome
        assert outcome["error"].code() == grpc.StatusCode.UNAUTHENTICATED
        assert "certificate of site 'b'" in outcome["error"].details()
        assert outcome["after_s"] < 10, outcome   # the poll would have waited 30 s
        assert tier.online_sites() == {"a"}
    finally:
        a.close()
        b.close()
        relay.stop()
        fed.close()


def test_a_relay_killed_mid_job_resumes_and_the_model_is_still_the_flat_one(relay_kits, tmp_path, procs):
    flat = run_flat(relay_kits, tmp_path, JOB.replace("rounds: 3", "rounds: 4"))
    fed = Federation(relay_kits, tmp_path / "tiered")
    relays = []
    try:
        # relay-1 runs as its own process (`plexus relay run`), to be SIGKILLed; relay-2 in process.
        config = tmp_path / "relay-1.yaml"
        port = free_port()
        config.write_text(f"parent: {fed.address}\nlisten: 127.0.0.1:{port}\nkit: {relay_kits / 'relays' / 'relay-1'}\n"
                          f"state_dir: {tmp_path / 'relay-1'}\ncrl: {relay_kits / 'crl.pem'}\n"
                          f"tier: {{sites_min: 2, deadline_s: {scaled(60)}}}\npoll_timeout_s: 1\nrejoin_grace_s: 0\n")
        first = procs.start("relay-1", "relay", "run", "--config", str(config))
        for child in TREE["relay-1"]:
            fed.start_site(child, coordinator=f"127.0.0.1:{port}")
        relay = Relay(relay_config(relay_kits, "relay-2", fed.address, tmp_path / "relay-2"))
        relay.start()
        relays.append(relay)
        fed.start_site("c", coordinator=f"127.0.0.1:{relay.port}")
        fed.start_site("d")
        fed.wait_online(*RELAYS, "d")
        job_id = fed.admin().submit(JOB.replace("rounds: 3", "rounds: 4")).job_id
        wait_until(lambda: fed.store.job(job_id).current_round >= 1, scaled(120), "round 1 to close")
        assert fed.store.job(job_id).current_round < 4   # mid-job
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=scaled(10))
        procs.start("relay-1-again", "relay", "run", "--config", str(config))
        assert fed.wait_job(job_id, scaled(180)) == "completed", fed.store.job(job_id).message
        assert final_model(fed, job_id) == flat
    finally:
        for relay in relays:
            relay.stop()
        fed.close()


# Secure aggregation across two tiers -------------------------------------------------------------------
CLIP = 4.0
SECURE_TREE = {"relay-1": ("a1", "a2", "a3", "a4"), "relay-2": ("b1", "b2", "b3")}   # and d1, d2 direct
HOSPITALS = dict(zip(("a1", "a2", "a3", "a4", "b1", "b2", "b3", "d1", "d2"),
                     ("cleveland", "hungary", "va", "switzerland", "cleveland", "hungary", "va", "switzerland",
                      "cleveland")))


def secure_site(fed: Federation, name: str, address: str, agent_cls=SiteAgent, **kwargs) -> SiteAgent:
    return fed.start_site(name, coordinator=address, agent_cls=functools.partial(agent_cls, **kwargs),
                          datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=HOSPITALS[name])},
                          allowed_models=("logistic",), require_secure_aggregation=True)


def clear_mean(job_yaml: str, sites) -> dict[str, np.ndarray]:
    """The survivors' weighted mean model after round 1, computed in the clear from their local training."""
    job = parse_round_config(job_yaml)
    initial = state_to_numpy(build_model(job.model.name, job.model.args, seed=job.seed))
    total, weights = {k: np.zeros(v.shape) for k, v in initial.items()}, 0
    for site in sites:
        data = heart_disease(HOSPITALS[site])
        model = build_model(job.model.name, job.model.args, seed=job.seed)
        load_numpy_state(model, initial)
        result = train_local(model, data.x_train, data.y_train, job.train, seed=site_seed(job.seed, 1, site))
        for k, v in state_to_numpy(model).items():
            total[k] += result.num_samples * (v.astype(np.float64) - initial[k])
        weights += result.num_samples
    return {k: initial[k] + total[k] / weights for k in initial}


def test_secure_aggregation_across_two_tiers_with_a_dropout_in_each(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "tiers", hosts=["127.0.0.1"])
    for name in HOSPITALS:
        pki.add_site(root, name)
    for name in SECURE_TREE:
        pki.add_relay(root, name, hosts=["127.0.0.1"])
    pki.add_admin(root, "ops", role="operator")
    fed = Federation(root, tmp_path / "coordinator")
    relays = []
    try:
        for name, children in SECURE_TREE.items():
            relay = Relay(relay_config(root, name, fed.address, tmp_path / name, sites_min=3))
            relay.start()
            relays.append(relay)
            for child in children:
                if child == "a4":   # shares its keys at relay-1's tier, never masks
                    secure_site(fed, child, f"127.0.0.1:{relay.port}", DropsOut,
                                vanish_at=fpb.TASK_SECAGG_MASKED_INPUT)
                else:
                    secure_site(fed, child, f"127.0.0.1:{relay.port}")
        secure_site(fed, "d1", fed.address)
        secure_site(fed, "d2", fed.address, DropsOut, vanish_at=fpb.TASK_SECAGG_MASKED_INPUT)   # the top tier's
        for relay, children in zip(relays, SECURE_TREE.values()):
            wait_until(lambda r=relay, c=children: set(c) <= r.tier.engine.online_sites(), scaled(30),
                       f"{children} online at their relay")
        fed.wait_online(*SECURE_TREE, "d1", "d2")
        job = heart_job(name="secure-tiers", rounds=1, min=3, seed=5, deadline=scaled(30)) + (
            f"privacy: {{secure_aggregation: true, secagg: {{clip: {CLIP}, phase_timeout_s: {DROPOUT_PHASE_S}}}}}\n")
        job_id = fed.admin().submit(job).job_id
        wait_until(lambda: fed.store.job(job_id).current_round == 1, scaled(120), "round 1 to close")
        secure_site(fed, "d2", fed.address)   # back for the final evaluation
        secure_site(fed, "a4", f"127.0.0.1:{relays[0].port}")
        assert fed.wait_job(job_id, scaled(120)) == "completed", fed.store.job(job_id).message

        # Each tier unmasked only its own survivors' sum: a4 and d2 dropped after sharing their keys.
        top = next(r for r in fed.store.rounds(job_id) if r.round == 1)
        assert sorted(json.loads(top.contributors)) == ["d1", "relay-1", "relay-2"]
        tier1 = next(r for r in relays[0].tier.store.rounds(job_id) if r.round == 1)
        assert sorted(json.loads(tier1.contributors)) == ["a1", "a2", "a3"]
        tier2 = next(r for r in relays[1].tier.store.rounds(job_id) if r.round == 1)
        assert sorted(json.loads(tier2.contributors)) == ["b1", "b2", "b3"]
        # The model is the survivors' weighted mean (to the fixed point's rounding at the two tiers).
        expected = clear_mean(job, ["a1", "a2", "a3", "b1", "b2", "b3", "d1"])
        got = fed.store.load_checkpoint(job_id, 1)
        for name, value in expected.items():
            assert np.abs(got[name].astype(np.float64) - value).max() < 1e-6 + np.abs(value).max() * 2.0 ** -23, name
    finally:
        for relay in relays:
            relay.stop()
        fed.close()
