"""AsyncRounds under secure aggregation: buffers as cohorts of real plexus.secagg SiteSessions, over a real Store
with an injected clock (no gRPC, no engine thread)."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from coordinator.drivers import Context
from coordinator.drivers.async_ import AsyncRounds
from coordinator.drivers.cohort import advert_samples, cohort_size
from coordinator.store import Store
from coordinator.tasks import Binding, Presence, SecaggAnswer, TaskGrant, TaskResult, UpdateHeader
from plexus import identity, pki, secagg, staleness
from plexus.accounting import client_epsilon
from plexus.config import StalenessSpec, dump_round_config, parse_round_config
from plexus.dp import add_noise, noise_key
from plexus.errors import IntegrityError, RoundClosed
from plexus.vocab import TaskKind, TaskStatus
from plexus.wire import encode

VERSIONS = 10
JOB = """\
name: job
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: {versions}
sites: {{min: 3, deadline_s: 600}}
strategy: {{name: fedavg}}
asynchronous: {asynchronous}
privacy: {{secure_aggregation: true, secagg: {{clip: 4.0, phase_timeout_s: 30}}{dp}}}
seed: 0
"""
NAMES = ("a", "b", "c", "d", "e")
CLIP = 4.0
S_HALF = StalenessSpec(fn="polynomial", a=0.5)
ROWS = 1000


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    root = tmp_path_factory.mktemp("cohort-pki") / "fed"
    pki.init_federation(root, "cohort-fed")
    return {name: identity.load_kit(pki.add_site(root, name)) for name in NAMES}


class Member:
    """A site as the honest agent plays it in an asynchronous secure job: it keeps Δ, and weighs it itself."""

    def __init__(self, rig: Rig, name: str):
        self.rig, self.name, self.kit = rig, name, rig.kits[name]
        self.delta: np.ndarray | None = None
        self.n = 0
        self.session: secagg.SiteSession | None = None

    def task(self) -> TaskGrant:
        grant = self.rig.driver.grant(self.name)
        assert grant is not None, f"{self.name} has no task"
        return grant

    def answer(self, grant: TaskGrant, body: str, value) -> str:
        binding = Binding(grant.task_id, grant.job_id, grant.round, grant.nonce)
        return self.rig.driver.answered(self.name, grant, SecaggAnswer(binding, body, value))

    def train(self, delta, n: int = 100) -> str:
        """Train on the granted version; only 'trained' goes to the coordinator."""
        grant = self.task()
        assert grant.kind == TaskKind.TRAIN
        self.delta, self.n, self.base = np.asarray(delta, np.float64), n, grant.model_round
        binding = Binding(grant.task_id, grant.job_id, grant.round, grant.nonce)
        return self.rig.driver.answered(self.name, grant, TaskResult(binding, TaskStatus.TRAINED))

    def advertise(self, weight: int | None = None) -> str:
        grant = self.task()
        assert grant.kind == TaskKind.SECAGG_ADVERTISE and grant.model_round == self.base
        tau = grant.payload["version"] - grant.model_round
        self.session = secagg.SiteSession(grant.job_id, grant.round, self.name, max_weight=staleness.MAX_FIXED_WEIGHT)
        if weight is None:
            weight = staleness.fixed_weight(self.rig.spec.staleness, tau, self.n)
        return self.answer(grant, "advert", self.session.advertise(weight, self.kit.key_pem, self.kit.cert_pem))

    def share(self) -> str:
        grant = self.task()
        p = grant.payload
        return self.answer(grant, "shares", self.session.share(p["adverts"], threshold=p["threshold"],
                                                                total_weight=p["total_weight"],
                                                                ca_pem=self.kit.ca_pem))

    def mask(self) -> str:
        grant = self.task()
        p = grant.payload
        self.session.receive_shares(p["shares_for_you"])
        y = np.concatenate(list(self.session.mask([self.delta], field=secagg.Field.fixed(p["clip"], p["frac_bits"]))))
        layout, blob = encode({"w": y.astype(np.uint32)})
        header = UpdateHeader(task=Binding(grant.task_id, grant.job_id, grant.round, grant.nonce), num_samples=0,
                              layout=layout)
        driver = self.rig.driver
        upload = driver.upload(self.name, grant, header, lambda exc: None)
        try:
            upload.receive([(0, bytes(blob))])
            return driver.accepted(self.name, grant, header, upload)
        finally:
            driver.ended_upload(self.name, upload)

    def unmask(self) -> str:
        grant = self.task()
        return self.answer(grant, "reveal", self.session.unmask(grant.payload["u3"]))


class Rig:
    """An asynchronous secure driver over a real store, with a clock that moves only when told."""

    def __init__(self, tmp_path, kits, *, asynchronous: str, dp: str = "", versions: int = VERSIONS):
        self.now = 1000.0
        self.kits = kits
        self.store = Store(tmp_path / "state")
        self.presence = Presence(threading.RLock(), online_window_s=500.0, monotonic=lambda: self.now)
        self.ctx = Context(store=self.store, presence=self.presence, clock=lambda: self.now, monotonic=lambda: self.now,
                           notify=lambda: None, models=None, model_limits=None)
        cfg = parse_round_config(JOB.format(versions=versions, asynchronous=asynchronous,
                                            dp=f", dp: {dp}" if dp else ""), source="test job")
        self.spec = cfg.asynchronous
        self.job_id = f"job-{uuid.uuid4().hex[:8]}"
        self.store.save_checkpoint(self.job_id, 0, {"w": np.zeros(4, np.float32)})
        self.store.add_job(self.job_id, cfg.name, dump_round_config(cfg), cfg.strategy.name, cfg.rounds, "test")
        self.driver = AsyncRounds.take_up(self.ctx, self.store.job(self.job_id))
        self.sites: dict[str, Member] = {}

    def start(self, *names: str) -> dict[str, Member]:
        for name in names:
            self.store.site_seen(name, agent_version="test", models=["vector"], datasets=["heart-disease"],
                                 policy_digest="")
            self.presence.joined(name, {"heart-disease": ROWS})
            self.sites[name] = Member(self, name)
        self.driver.tick(self.now)
        return self.sites

    def tick(self, after: float = 0.0) -> None:
        self.now += after
        self.driver.tick(self.now)

    def phases(self, members, *, skip: dict[str, set[str]] | None = None) -> None:
        """Run the running cohort's phases from where it is to its end; skip[phase] names members silent in it
        (the phase then ends at its deadline)."""
        skip, by_name = skip or {}, {m.name: m for m in members}
        cohort = self.driver.cohort
        while cohort is not None and self.driver.cohort is cohort:
            phase = cohort.secure.phase
            silent = skip.get(phase, set())
            for name in cohort.participants:
                if name not in silent and name not in cohort.outcomes:
                    getattr(by_name[name], phase)()
            self.tick(31.0 if silent else 0.0)

    def model(self, version: int) -> np.ndarray:
        return self.store.load_checkpoint(self.job_id, version)["w"]

    def task_status(self, task_id: str) -> str:
        return self.store.task(task_id).status

    def events(self, kind: str) -> list:
        return [e for e in self.store.events_after(self.job_id, 0) if e.kind == kind]


@pytest.fixture
def rig(tmp_path, kits):
    rigs = []

    def make(**kwargs) -> Rig:
        rigs.append(Rig(tmp_path / str(len(rigs)), kits, **kwargs))
        return rigs[-1]
    yield make
    for r in rigs:
        r.store.close()


def weighted(spec, parts) -> np.ndarray:
    """Σ s(τ)·n·Δ / Σ n by hand, over (τ, n, Δ)."""
    return sum(staleness.factor(spec, tau) * n * np.asarray(d, np.float64) for tau, n, d in parts) / \
        sum(n for _, n, _ in parts)


TOLERANCE = 1e-6   # fixed-point rounding (2^-28 per coordinate at clip 4) and float32 models


# forming ------------------------------------------------------------------------------------
def test_cohort_size_fills_at_k_or_waits_out_the_timeout_with_enough_sites():
    assert cohort_size([0.0, 1.0], 5.0, buffer=3, timeout_s=10, floor=3) == 0
    assert cohort_size([0.0, 1.0, 2.0], 2.0, buffer=3, timeout_s=10, floor=3) == 3
    assert cohort_size([0.0, 1.0, 2.0, 3.0, 4.0], 4.0, buffer=3, timeout_s=10, floor=3) == 3
    assert cohort_size([0.0, 1.0, 2.0], 9.9, buffer=5, timeout_s=10, floor=3) == 0
    assert cohort_size([0.0, 1.0, 2.0], 10.0, buffer=5, timeout_s=10, floor=3) == 3
    assert cohort_size([0.0, 1.0], 99.0, buffer=5, timeout_s=10, floor=3) == 0   # never below the floor


def test_a_cohort_forms_once_k_sites_have_trained_and_late_finishers_form_the_next(rig):
    r = rig(asynchronous="{buffer: 3, max_staleness: 4}")
    s = r.start("a", "b", "c", "d")
    s["a"].train([1] * 4)
    reply = s["b"].train([1] * 4)
    assert "2 of 3 waiting" in reply and r.driver.cohort is None
    assert r.driver.grant("a") is None and {"a", "b"} <= set(r.driver.busy())   # waiting counts as present
    s["c"].train([1] * 4)
    cohort = r.driver.cohort
    assert cohort is not None and sorted(cohort.members) == ["a", "b", "c"] and cohort.version == 0
    grants = {n: r.driver.grant(n) for n in "abc"}
    assert {g.kind for g in grants.values()} == {TaskKind.SECAGG_ADVERTISE}
    assert {(g.round, g.model_round, g.payload["version"]) for g in grants.values()} == {(VERSIONS + 2, 0, 0)}
    assert r.task_status(grants["a"].task_id) == "issued"
    assert [e.message for e in r.events("cohort_started")][0].startswith("cohort 12 for version 1 (full)")
    s["d"].train([1] * 4)                       # finished while cohort 12 runs: waits for the next one
    assert r.driver.grant("d") is None and [t.site for t in r.driver.forming] == ["d"]


def test_the_first_finishers_wait_out_cohort_timeout_s_then_start_with_enough_sites(rig):
    r = rig(asynchronous="{buffer: 5, cohort_timeout_s: 20}")
    s = r.start("a", "b", "c", "d")
    s["a"].train([1] * 4)
    r.tick(5)
    s["b"].train([1] * 4)
    s["c"].train([1] * 4)
    r.tick(14.9)                                 # a has waited 19.9 s
    assert r.driver.cohort is None
    r.tick(0.1)
    assert sorted(r.driver.cohort.members) == ["a", "b", "c"]
    assert "3 of 5 after asynchronous.cohort_timeout_s (20 s)" in r.events("cohort_started")[0].message

    q = rig(asynchronous="{buffer: 5, cohort_timeout_s: 20}")
    s = q.start("a", "b", "c")
    s["a"].train([1] * 4)
    s["b"].train([1] * 4)
    q.tick(25)                                   # past the timeout, but two sites are too few for a secure sum
    assert q.driver.cohort is None and q.driver.grant("a") is None
    s["c"].train([1] * 4)                        # the third starts it at once
    assert sorted(q.driver.cohort.members) == ["a", "b", "c"]


# the masked sum -------------------------------------------------------------------------------
def two_versions(r, s):
    """Version 1 from a, b, c (τ 0); d trains from version 0 meanwhile; version 2 from d (τ 1), a and b (τ 0)."""
    deltas1 = {"a": [0.5, -1, 2, 0.25], "b": [1, 1, 1, 1], "c": [-2, 0, 3.5, 1]}
    ns1 = {"a": 120, "b": 300, "c": 80}
    for name in "abc":
        s[name].train(deltas1[name], ns1[name])
    s["d"].train([3, -3, 0.75, 2], 250)          # from version 0, while cohort 1 runs
    r.phases([s[n] for n in "abc"])
    v1 = weighted(r.spec.staleness, [(0, ns1[n], deltas1[n]) for n in "abc"])
    return v1


def test_staleness_weights_are_applied_before_masking_and_the_flush_is_fedbuffs_mean(rig):
    r = rig(asynchronous="{buffer: 3, max_staleness: 4, staleness: {fn: polynomial, a: 0.5}}")
    s = r.start("a", "b", "c", "d")
    v1 = two_versions(r, s)
    assert r.store.job(r.job_id).current_round == 1
    np.testing.assert_allclose(r.model(1), v1, rtol=0, atol=TOLERANCE)
    s["a"].train([1, 2, 3, 4], 100)
    s["b"].train([-1, 0.5, 0, 0.1], 50)
    cohort = r.driver.cohort
    assert sorted(cohort.members) == ["a", "b", "d"] and cohort.tau("d") == 1
    r.phases([s[n] for n in "abd"])
    expected = v1 + weighted(S_HALF, [(1, 250, [3, -3, 0.75, 2]), (0, 100, [1, 2, 3, 4]), (0, 50, [-1, 0.5, 0, 0.1])])
    np.testing.assert_allclose(r.model(2), expected, rtol=0, atol=TOLERANCE)
    # d signed 250 · ⌊65536/√2⌋ itself; the coordinator read n = 250 back from it
    assert r.driver.buffer.version == 3 and r.store.job(r.job_id).current_round == 2
    metrics = {(m.round, m.site, m.name): m.value for m in r.store.metrics(r.job_id) if m.kind == "async"}
    assert metrics[(2, "", "staleness_1")] == 1 and metrics[(2, "", "staleness_0")] == 2
    assert metrics[(2, "", "cohort_round")] == VERSIONS + 3 and metrics[(2, "", "cohort_dropped")] == 0
    rounds = {row.round: row for row in r.store.rounds(r.job_id)}
    assert rounds[2].total_samples == 400 and "secure cohort 13 of 3" in rounds[2].message
    statuses = {(e.site, e.round, e.status) for e in r.store.site_events(r.job_id)}
    assert ("d", 0, "submitted") in statuses                       # its training task, trained → submitted
    assert not any(status in ("trained", "buffered") for _, _, status in statuses)


def test_an_advert_whose_weight_is_not_s_tau_times_n_is_refused(rig):
    assert advert_samples(S_HALF, 1, 46340 * 7, ROWS, dp=False) == 7
    with pytest.raises(IntegrityError, match="not s\\(τ\\)·n for this member's staleness τ = 1"):
        advert_samples(S_HALF, 1, 65536 * 7, ROWS, dp=False)       # claims τ = 0
    with pytest.raises(IntegrityError, match="beyond the 1000 training rows"):
        advert_samples(S_HALF, 0, 65536 * 1001, ROWS, dp=False)
    with pytest.raises(IntegrityError, match="under privacy.dp every update weighs"):
        advert_samples(S_HALF, 0, 65536 * 2, ROWS, dp=True)

    r = rig(asynchronous="{buffer: 4, max_staleness: 4, staleness: {fn: polynomial, a: 0.5}}")
    s = r.start("a", "b", "c", "d", "e")
    for name in "abcd":
        s[name].train([1] * 4, 100)
    s["e"].train([2] * 4, 250)                   # from version 0, while the first cohort runs
    r.phases([s[n] for n in "abcd"])
    for name in "abc":
        s[name].train([1] * 4, 100)
    assert sorted(r.driver.cohort.members) == ["a", "b", "c", "e"] and r.driver.cohort.tau("e") == 1
    for name in "abc":
        s[name].advertise()
    with pytest.raises(IntegrityError, match="τ = 1") as refused:
        s["e"].advertise(weight=staleness.fixed_weight(S_HALF, 0, 250))   # as if fresh: a weight it may not claim
    assert refused.value.reason == "num_samples"
    r.tick(0)                                    # the phase goes on with a, b and c
    assert r.driver.cohort.secure.u1 == ["a", "b", "c"]
    rejected = [e for e in r.store.site_events(r.job_id) if e.site == "e" and e.status == "rejected"]
    assert rejected and "not s(τ)·n" in rejected[0].reason
    r.phases([s[n] for n in "abc"])
    assert r.store.job(r.job_id).current_round == 2
    assert "dropped: e" in {row.round: row for row in r.store.rounds(r.job_id)}[2].message
    assert r.driver.grant("e").kind == TaskKind.TRAIN               # e trains again, on version 2


def test_a_member_that_drops_out_in_the_mask_phase_is_recovered_from_the_shares(rig):
    r = rig(asynchronous="{buffer: 4, max_staleness: 4}")
    s = r.start("a", "b", "c", "d")
    deltas = {"a": [1, 2, 3, 4], "b": [0, 0, 1, -1], "c": [-1, 0.5, 2, 0], "d": [100, 100, 100, 100]}
    ns = {"a": 10, "b": 20, "c": 30, "d": 40}
    for name in "abcd":
        s[name].train(deltas[name], ns[name])
    r.phases([s[n] for n in "abcd"], skip={"mask": {"d"}})
    np.testing.assert_allclose(r.model(1), weighted(r.spec.staleness, [(0, ns[n], deltas[n]) for n in "abc"]),
                               rtol=0, atol=TOLERANCE)           # d's 100s are in no model; its masks are gone
    events = {(e.site, e.status) for e in r.store.site_events(r.job_id)}
    assert ("d", "late") in events and ("d", "discarded") in events
    discarded = [e for e in r.store.site_events(r.job_id) if e.site == "d" and e.status == "discarded"]
    assert "dropped out of cohort 12 before its masked input was in" in discarded[0].reason
    metrics = {(m.round, m.name): m.value for m in r.store.metrics(r.job_id) if m.kind == "async" and not m.site}
    assert metrics[(1, "cohort_dropped")] == 1 and metrics[(1, "updates")] == 3


def test_a_failed_cohort_discards_its_updates_and_asks_its_members_to_train_again(rig):
    r = rig(asynchronous="{buffer: 3, max_staleness: 4}")
    s = r.start("a", "b", "c")
    for name in "abc":
        s[name].train([5] * 4)
    first = r.driver.cohort.round
    r.phases([s[n] for n in "abc"], skip={"share": {"c"}})   # 2 of 3 shared: below the floor of 3
    assert r.driver.cohort is None and r.store.job(r.job_id).current_round == 0
    assert not r.store.checkpoint_path(r.job_id, 1).exists()
    failed = r.events("cohort_failed")
    assert failed and "share phase: 2 of 3 sites answered" in failed[0].message
    discarded = [e for e in r.store.site_events(r.job_id) if e.status == "discarded"]
    assert {e.site for e in discarded if e.round == 0} == {"a", "b", "c"}   # each member's kept update
    assert all("failed" in e.reason and "is in no model" in e.reason for e in discarded)
    for name in "abc":                            # new training tasks, on the same version
        s[name].train([1] * 4)
    again = r.driver.cohort
    assert again.round == first + 1               # never the failed cohort's round id again
    r.phases([s[n] for n in "abc"])
    np.testing.assert_allclose(r.model(1), np.float32(1), rtol=0, atol=TOLERANCE)   # the 5s are in no model


def test_a_restart_discards_the_cohort_in_progress_and_never_reuses_its_round(rig):
    r = rig(asynchronous="{buffer: 3, max_staleness: 4}")
    s = r.start("a", "b", "c", "d")
    for name in "abc":
        s[name].train([9] * 4)
    s["d"].train([9] * 4)
    for name in "abc":
        s[name].advertise()
    r.tick(0)
    old = r.driver.cohort.round
    share = r.driver.grant("a")
    r.driver = AsyncRounds.take_up(r.ctx, r.store.job(r.job_id))    # SIGKILL, then the job taken up again
    resumed = r.events("job_resumed")[0].message
    assert "4 update(s) waiting for or in an unflushed cohort discarded" in resumed
    statuses = {(e.site, e.round): (e.status, e.reason) for e in r.store.site_events(r.job_id)}
    assert all(statuses[(n, 0)][0] == "discarded" for n in "abcd")     # the kept updates: in no model
    assert "waiting for or in a cohort that had not made a version" in statuses[("a", 0)][1]
    assert statuses[("a", old)][0] == "submitted"                       # its advert was accepted, as in a round
    assert r.task_status(share.task_id) == "stale"                      # the cohort's open tasks are void
    with pytest.raises(RoundClosed):
        r.driver.current("a", share.task_id, share.round, "stale")
    r.driver.tick(r.now)
    for name in "abc":
        s[name].train([1] * 4)
    assert r.driver.cohort.round == old + 1
    r.phases([s[n] for n in "abc"])
    np.testing.assert_allclose(r.model(1), np.float32(1), rtol=0, atol=TOLERANCE)


def test_central_dp_noise_is_added_to_the_cohorts_mean_and_each_flush_is_accounted_at_q_1(rig):
    dp = "{mode: central, noise_multiplier: 0.5, clip_norm: 10.0, reproducible_noise: true}"
    r = rig(asynchronous="{buffer: 3, max_staleness: 4}", dp=dp)
    s = r.start("a", "b", "c")
    deltas = {"a": [1, 2, 3, 4], "b": [0, 0, 1, -1], "c": [-1, 0.5, 2, 0]}
    for name in "abc":
        s[name].train(deltas[name], 1)           # n = 1 under DP
    r.phases([s[n] for n in "abc"])
    mean = {"w": weighted(r.spec.staleness, [(0, 1, deltas[n]) for n in "abc"])}
    noisy = add_noise(mean, 0.5 * 10.0 / 3, noise_key(0, "job", 1, "coordinator"))["w"]
    np.testing.assert_allclose(r.model(1), noisy, rtol=0, atol=TOLERANCE)
    ledger = {(m.round, m.name): m.value for m in r.store.metrics(r.job_id) if m.kind == "privacy"}
    assert ledger[(1, "sampling_rate")] == 1.0
    assert ledger[(1, "epsilon")] == pytest.approx(client_epsilon(0.5, [1.0], 1e-5))


def test_job_show_lists_updates_kept_for_a_cohort_as_waiting_not_missing(rig, capsys):
    from coordinator.service import job_detail
    from plexus.cli.admin import print_job

    r = rig(asynchronous="{buffer: 3, max_staleness: 4}")
    s = r.start("a", "b", "c", "d")
    two_versions(r, s)                           # version 1 made; d's update from version 0 waits
    print_job(job_detail(r.store, r.job_id))
    out = capsys.readouterr().out
    assert "buffer of version 2: 1 of 3 updates (d from version 0)" in out
    assert "sites that did not contribute" not in out
