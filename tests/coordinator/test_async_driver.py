"""AsyncRounds on its own: a real Store in tmp_path, an injected clock, no gRPC and no engine thread."""

from __future__ import annotations

import numpy as np
import pytest
from driver_rig import DriverRig, rigs

from coordinator.drivers.async_ import FAIL_BACKOFF_S, AsyncRounds
from coordinator.tasks import Binding, TaskGrant, TaskResult
from plexus import staleness
from plexus.accounting import client_epsilon
from plexus.config import StalenessSpec
from plexus.errors import FailedPrecondition, IntegrityError, Reason, RoundClosed, Stale
from plexus.vocab import JobStatus, TaskKind, TaskStatus
from plexus.wire import iter_chunks

JOB = """\
name: job
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: {versions}
sites: {{min: 1, deadline_s: 60}}
strategy: {strategy}
asynchronous: {asynchronous}
seed: 0
"""
S_HALF = StalenessSpec(fn="polynomial", a=0.5)


class Rig(DriverRig):
    """AsyncRounds over a real store, with a clock that moves only when told."""

    driver_class = AsyncRounds

    def __init__(self, path, *, asynchronous: str, versions: int = 10, extra: str = "",
                 strategy: str = "{name: fedavg}"):
        super().__init__(path, JOB.format(versions=versions, asynchronous=asynchronous, strategy=strategy) + extra)

    def start(self, *sites: str) -> dict[str, TaskGrant]:
        self.join(*sites)
        self.driver.tick(self.now)
        return {s: self.driver.grant(s) for s in sites}

    def model(self, version: int) -> np.ndarray:
        return self.store.load_checkpoint(self.job_id, version)["w"]

    def tasks(self, status: str) -> list:
        return [e for e in self.store.site_events(self.job_id) if e.status == status]


@pytest.fixture
def rig(tmp_path):
    yield from rigs(tmp_path, Rig)


# staleness functions ----------------------------------------------------------------------
def test_staleness_functions_match_hand_computed_values_on_the_2_to_the_minus_16_grid():
    assert staleness.factor(StalenessSpec(fn="constant"), 7) == 1.0
    assert staleness.factor(S_HALF, 0) == 1.0
    # 1/√2 = 0.70710678…; ⌊0.70710678 · 65536⌋ = 46340
    assert staleness.quanta(S_HALF, 1) == 46340 and staleness.factor(S_HALF, 1) == 46340 / 65536
    assert staleness.quanta(StalenessSpec(fn="polynomial", a=1.0), 3) == 16384   # 1/4 exactly
    hinge = StalenessSpec(fn="hinge", a=0.5, b=2)
    assert staleness.factor(hinge, 2) == 1.0
    assert staleness.factor(hinge, 4) == 0.5                                      # 1/(0.5·2 + 1)
    assert staleness.quanta(hinge, 5) == 26214                                    # ⌊65536/2.5⌋
    assert staleness.weight(S_HALF, 1, 200) == 200 * 46340 / 65536
    assert staleness.fixed_weight(S_HALF, 1, 200) == 200 * 46340
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness.factor(S_HALF, -1)


def test_staleness_weights_sum_exactly_in_any_order():
    weights = [staleness.weight(StalenessSpec(fn="hinge", a=0.3, b=1), tau, n)
               for tau, n in [(0, 7919), (3, 104729), (9, 1), (17, 65521), (2, 3)]]
    sums = {sum(order) for order in (weights, weights[::-1], sorted(weights), weights[2:] + weights[:2])}
    assert len(sums) == 1
    assert sum(weights) * 65536 == sum(round(w * 65536) for w in weights)   # every weight is on the grid


# buffers -------------------------------------------------------------------------------------
def test_a_full_buffer_makes_the_next_version_from_the_staleness_weighted_mean_delta(rig):
    r = rig(asynchronous="{buffer: 2, max_staleness: 4, staleness: {fn: polynomial, a: 0.5}}")
    g = r.start("a", "b", "c")
    assert {x.model_round for x in g.values()} == {0} and all(x.kind == TaskKind.TRAIN for x in g.values())
    assert "1 of 2" in r.send("a", g["a"], [1, 1, 1, 1], num_samples=100)
    assert r.store.job(r.job_id).current_round == 0
    r.send("b", g["b"], [3, 3, 3, 3], num_samples=300)
    assert r.store.job(r.job_id).current_round == 1
    np.testing.assert_array_equal(r.model(1), np.float32(2.5))                 # (100·1 + 300·3) / 400
    a2 = r.driver.grant("a")
    assert a2.model_round == 1 and a2 is not g["a"]
    r.send("a", a2, [3.5] * 4, num_samples=100)                                # τ = 0: Δ = 1, weight 100
    reply = r.send("c", g["c"], [5.0] * 4, num_samples=200)                    # τ = 1: Δ = 5, weight 200·s(1)
    assert "staleness 1" in reply
    w = 200 * 46340 / 65536
    expected = np.float32(2.5 + (100 * 1.0 + w * 5.0) / 300)
    np.testing.assert_array_equal(r.model(2), expected)
    metrics = {(m.round, m.site, m.name): m.value for m in r.store.metrics(r.job_id) if m.kind == "async"}
    assert metrics[(2, "", "staleness_0")] == 1 and metrics[(2, "", "staleness_1")] == 1
    assert metrics[(2, "c", "contributions")] == 1 and metrics[(1, "", "updates")] == 2
    assert [e.status for e in r.store.site_events(r.job_id)].count("submitted") == 4   # buffered → submitted


def test_a_versions_ledger_is_committed_with_its_close(rig):
    r = rig(asynchronous="{buffer: 1}")
    seen = []
    r.store.subscribe(lambda event: seen.append(
        {m.name for m in r.store.metrics(r.job_id) if m.kind == "async" and m.round == event.round})
        if event.kind == "round_closed" else None)
    r.send("a", r.start("a")["a"], [1] * 4)
    assert seen == [{"updates", "staleness_mean", "staleness_0", "refused_stale", "contributions"}]


def test_the_flush_is_the_same_bits_whatever_order_the_updates_arrive_in(rig):
    models = set()
    for flip in (False, True):
        r = rig(asynchronous="{buffer: 2, max_staleness: 4, staleness: {fn: hinge, a: 0.7, b: 0}}")
        g = r.start("a", "b", "c")
        r.send("a", g["a"], [1.3, -2.7, 0.11, 9.0], num_samples=98)      # v1 from a and b
        r.send("b", g["b"], [0.7, 0.01, -5.5, 3.3], num_samples=61)
        v2 = [("a", r.driver.grant("a"), [0.3, 0.31, 0.32, 0.33], 98),  # τ 0
              ("c", g["c"], [2.2, 2.2, -0.3, 1e-3], 131)]               # τ 1
        for site, grant, values, n in (v2[::-1] if flip else v2):
            r.send(site, grant, values, num_samples=n)
        models.add(r.model(2).tobytes())
    assert len(models) == 1


def test_an_update_older_than_max_staleness_is_refused_and_its_site_gets_the_new_model(rig):
    r = rig(asynchronous="{buffer: 1, max_staleness: 1}")
    g = r.start("a", "b")
    r.send("a", g["a"], [1] * 4)
    r.send("a", r.driver.grant("a"), [2] * 4)
    assert r.store.job(r.job_id).current_round == 2
    with pytest.raises(Stale, match="computed from version 0, 2 versions old; asynchronous.max_staleness is 1"):
        r.send("b", g["b"], [9] * 4)
    rejected = r.tasks("rejected")
    assert [(e.site, e.round) for e in rejected] == [("b", 0)]
    fresh = r.driver.grant("b")
    assert fresh.model_round == 2 and fresh.task_id != g["b"].task_id
    r.send("b", fresh, [3] * 4)
    metrics = {(m.round, m.site, m.name): m.value for m in r.store.metrics(r.job_id) if m.kind == "async"}
    assert metrics[(3, "", "refused_stale")] == 1 and metrics[(3, "b", "refused_stale")] == 1
    events = [e for e in r.store.events_after(r.job_id, 0) if e.kind == "site_rejected"]
    assert events and "max_staleness" in events[0].message


def test_an_upload_cut_part_way_leaves_the_buffer_exactly_as_without_it(rig):
    r = rig(asynchronous="{buffer: 2, max_staleness: 4}")
    g = r.start("a", "b")

    def broken(blob, cuts):
        yield 0, blob[:8]
        raise ConnectionError("the site went away")
    with pytest.raises(ConnectionError):
        r.send("b", g["b"], [1e3, 1e3, 7, 7], num_samples=100, chunks=broken)
    assert r.driver.buffer.total.acc.tolist() == [0, 0, 0, 0]
    r.send("a", g["a"], [1, 2, 3, 4], num_samples=100)
    r.send("b", g["b"], [3, 2, 1, 0], num_samples=300)   # the same task, sent again whole
    np.testing.assert_array_equal(r.model(1), np.float32([2.5, 2.0, 1.5, 1.0]))


def test_an_update_streaming_across_a_flush_moves_into_the_next_buffer_at_its_new_staleness(rig):
    r = rig(asynchronous="{buffer: 1, max_staleness: 3, staleness: {fn: polynomial, a: 1}}")
    g = r.start("a", "b")
    header, blob = r.header(g["b"], [8, 8, 8, 8], 100)
    upload = r.driver.upload("b", g["b"], header, lambda exc: None)
    chunks = [(o, bytes(d)) for o, d in iter_chunks(blob, 4)]

    def first_half_then_flush():
        yield from chunks[:2]
        r.send("a", g["a"], [2] * 4, num_samples=100)     # v1 = 2, while b streams
        yield from chunks[2:]
    upload.receive(first_half_then_flush())
    assert "staleness 1, weight 50" in r.driver.accepted("b", g["b"], header, upload)   # s(1) = 1/2
    r.driver.ended_upload("b", upload)
    np.testing.assert_array_equal(r.model(1), np.float32(2))
    np.testing.assert_array_equal(r.model(2), np.float32(2 + 0.5 * 8))   # v1 + s(1)·(8 − v0)


def test_a_fast_site_fills_buffers_unless_capped_per_buffer(rig):
    r = rig(asynchronous="{buffer: 3, max_staleness: 4, max_per_buffer: 2}")
    g = r.start("fast", "slow")
    r.send("fast", g["fast"], [1] * 4)
    r.send("fast", r.driver.grant("fast"), [1] * 4)
    assert r.driver.grant("fast") is None                   # its share of this buffer is in
    r.send("slow", g["slow"], [4] * 4)
    assert r.store.job(r.job_id).current_round == 1
    assert r.driver.grant("fast").model_round == 1          # the flush opened a new window


def test_the_job_ends_after_its_versions_with_a_final_evaluation(rig):
    r = rig(asynchronous="{buffer: 1}", versions=2)
    g = r.start("a", "b")
    r.send("a", g["a"], [1] * 4)
    r.send("a", r.driver.grant("a"), [2] * 4)
    assert r.driver.finishing == "2 versions made"
    assert r.store.task(g["b"].task_id).status == "stale"          # b's training task ended with training
    ev = {s: r.driver.grant(s) for s in ("a", "b")}
    assert all(x.kind == TaskKind.EVALUATE and x.model_round == 2 and x.round == 3 for x in ev.values())
    for site, grant in ev.items():
        r.driver.answered(site, grant, TaskResult(Binding(grant.task_id, r.job_id, grant.round, grant.nonce),
                                                  TaskStatus.EVALUATED, eval_metrics={"accuracy": 0.9,
                                                                                      "num_samples": 10}))
    r.driver.tick(r.now)
    job = r.store.job(r.job_id)
    assert r.driver.ended and job.status == JobStatus.COMPLETED and job.current_round == 2
    assert "final model (version 2) evaluated by 2 site(s)" in job.message


def test_a_target_metric_ends_training_at_the_version_that_reached_it(rig):
    r = rig(asynchronous="{buffer: 1, evaluate_every: 2, target: {metric: accuracy, value: 0.8}}", versions=50)
    g = r.start("a")
    r.send("a", g["a"], [1] * 4)
    r.send("a", r.driver.grant("a"), [2] * 4)
    ev = r.driver.grant("a")                                  # idle after version 2: evaluate it first
    assert ev.kind == TaskKind.EVALUATE and ev.model_round == 2
    r.driver.answered("a", ev, TaskResult(Binding(ev.task_id, r.job_id, ev.round, ev.nonce), TaskStatus.EVALUATED,
                                          eval_metrics={"accuracy": 0.85, "num_samples": 10}))
    assert r.driver.finishing.startswith("target reached: accuracy 0.8500 at version 2")


def test_no_answer_for_idle_timeout_fails_the_job_clearly(rig):
    r = rig(asynchronous="{buffer: 2, idle_timeout_s: 30}")
    r.start("a")
    r.now += 29
    r.driver.tick(r.now)
    assert not r.driver.ended
    r.now += 2
    r.driver.tick(r.now)
    job = r.store.job(r.job_id)
    assert r.driver.ended and job.status == JobStatus.FAILED
    assert "no site has answered for 31 s (asynchronous.idle_timeout_s = 30)" in job.message


def test_a_time_budget_counts_from_the_start_of_training_through_a_restart(rig):
    r = rig(asynchronous="{buffer: 1, time_budget_s: 100}", versions=1000)
    r.now += 500                                    # waiting for sites does not count
    g = r.start("a")
    r.send("a", g["a"], [1] * 4)
    r.now += 60
    r.driver = r.take_up()                          # a restart 60 s in: 40 s are left, not 100
    r.join("a")
    r.driver.tick(r.now)
    r.now += 39
    r.driver.tick(r.now)
    assert not r.driver.finishing
    r.now += 1
    r.driver.tick(r.now)
    assert r.driver.finishing == "time budget of 100 s reached at version 1"


def test_a_restart_discards_the_unflushed_buffer_and_never_counts_it_twice(rig):
    r = rig(asynchronous="{buffer: 2, max_staleness: 4}")
    g = r.start("a", "b", "c")
    r.send("a", g["a"], [100] * 4, num_samples=100)          # in the buffer, not in any model
    r.driver = r.take_up()                                   # the coordinator came back (SIGKILL in between)
    discarded = r.tasks("discarded")
    assert [(e.site, e.round) for e in discarded] == [("a", 0)]
    assert "unflushed buffer of version 1" in discarded[0].reason
    resumed = [e for e in r.store.events_after(r.job_id, 0) if e.kind == "job_resumed"]
    assert "1 buffered update(s) discarded" in resumed[0].message
    with pytest.raises(RoundClosed):                         # b's old task died with the old driver
        r.driver.current("b", g["b"].task_id, 0, "issued")
    r.join("a", "b")
    r.driver.tick(r.now)
    for site, values in (("a", [1] * 4), ("b", [3] * 4)):
        r.send(site, r.driver.grant(site), values, num_samples=100)
    np.testing.assert_array_equal(r.model(1), np.float32(2))   # the discarded 100s are in no model


def test_dp_counts_each_flush_at_sampling_rate_one(rig):
    r = rig(asynchronous="{buffer: 2, max_staleness: 4}",
            extra="privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: 10.0, reproducible_noise: true}}\n")
    g = r.start("a", "b", "c")
    r.send("a", g["a"], [1] * 4)
    assert r.driver.grant("a") is None                      # one update per site per buffer under DP
    r.send("b", g["b"], [1] * 4)
    r.send("c", g["c"], [1] * 4)                            # τ 1: trained from v0
    r.send("a", r.driver.grant("a"), r.model(1) + 0.001)    # clipped: within clip_norm of v1 (noisy)
    ledger = {(m.round, m.name): m.value for m in r.store.metrics(r.job_id) if m.kind == "privacy"}
    assert ledger[(1, "sampling_rate")] == 1.0 and ledger[(2, "sampling_rate")] == 1.0
    assert ledger[(2, "epsilon")] == pytest.approx(client_epsilon(1.0, [1.0, 1.0], 1e-5))
    assert ledger[(1, "epsilon")] < ledger[(2, "epsilon")]
    with pytest.raises(IntegrityError, match="beyond dp.clip_norm"):
        r.send("b", r.driver.grant("b"), r.model(2) + 50)
    assert r.tasks("rejected")[0].site == "b"


def test_dp_target_epsilon_stops_before_the_flush_that_would_exceed_it(rig):
    eps2 = client_epsilon(1.0, [1.0, 1.0], 1e-5)
    r = rig(asynchronous="{buffer: 1}",
            extra=f"privacy: {{dp: {{mode: central, noise_multiplier: 1.0, clip_norm: 10.0, target_epsilon: "
                  f"{eps2 * 1.01}}}}}\n")
    g = r.start("a")
    r.send("a", g["a"], [1] * 4)
    r.send("a", r.driver.grant("a"), r.model(1) + 0.001)
    assert r.driver.finishing.startswith("privacy budget reached: version 3 would bring")
    assert r.store.job(r.job_id).current_round == 2


def test_refusals_carry_their_reason_codes(rig):
    r = rig(asynchronous="{buffer: 2}")
    g = r.start("a")
    with pytest.raises(IntegrityError, match="exceeds the 1000 training rows"):
        r.send("a", g["a"], [1] * 4, num_samples=5000)
    events = [e for e in r.store.events_after(r.job_id, 0) if e.kind == "site_rejected"]
    assert events and r.driver.grant("a") is None   # a refused site waits FAIL_BACKOFF_S for its next task
    r.now += FAIL_BACKOFF_S
    assert r.driver.grant("a").task_id != g["a"].task_id
    assert Reason.STALE.value == "stale"


def test_a_plain_asynchronous_job_refuses_trained_and_takes_updates(rig):
    r = rig(asynchronous="{buffer: 2}")
    g = r.start("a")
    with pytest.raises(FailedPrecondition, match="under secure aggregation"):
        r.driver.answered("a", g["a"], TaskResult(Binding(g["a"].task_id, r.job_id, g["a"].round, g["a"].nonce),
                                                  TaskStatus.TRAINED))
    assert "1 of 2" in r.send("a", g["a"], [1] * 4)


def test_a_server_optimizer_steps_on_the_staleness_weighted_delta_downpour_adagrad(rig):
    r = rig(asynchronous="{buffer: 1, max_staleness: 4, staleness: {fn: polynomial, a: 1}}",
            strategy="{name: fedadagrad, args: {eta: 0.5, beta1: 0.0, tau: 0.001}}")
    g = r.start("a", "c")
    r.send("a", g["a"], [2] * 4)                    # Δ̄ = 2: v = 4, x = 0.5·2/(2 + 0.001)
    x1 = 0.5 * 2 / (2 + 0.001)
    np.testing.assert_allclose(r.model(1), x1, rtol=1e-6)
    r.send("c", g["c"], [4] * 4)                    # from v0, τ = 1: Δ̄ = s(1)·4 = 2; v = 8
    np.testing.assert_allclose(r.model(2), x1 + 0.5 * 2 / (8 ** 0.5 + 0.001), rtol=1e-6)
