"""A site's weight is bounded by the rows it reported at Join and by sites.max_weight_share, over real gRPC:
a liar's num_samples can neither fail the honest sites' round nor take the global model over."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from coordinator.aggregate import WeightedSum
from plexus.admin_client import mean_eval
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import encode

from integration.harness import heart_job, wait_until

HONEST_ROWS = 100


def _round(federation, liar_rows: int, *, rounds: int = 1):
    """Raw sites a and b report HONEST_ROWS rows at Join, the liar c reports liar_rows; round 1 is open."""
    sites = {name: federation.raw_site(name) for name in ("a", "b", "c")}
    for name, site in sites.items():
        site.join({"heart-disease": liar_rows if name == "c" else HONEST_ROWS})
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(heart_job(rounds=rounds, min=2)).job_id
    tasks = {name: site.next_task() for name, site in sites.items()}
    _, state = sites["a"].fetch(tasks["a"])
    return job_id, sites, tasks, state


def _mean(sent: dict) -> dict:
    """The exact weighted mean of {site: (update, weight)}, as the coordinator computes it."""
    first = next(iter(sent.values()))[0]
    total = WeightedSum(encode(first)[0])
    for update, weight in sent.values():
        blob = encode(update)[1]
        total.fold([blob], weight, max(float(np.abs(v).max()) for v in update.values()), nbytes=len(blob))
    return total.mean()


def _finish(federation, job_id, sites):
    stop = threading.Event()
    for site in sites.values():
        site.answer_everything_with_failure(stop)
    try:
        assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    finally:
        stop.set()


def _round_info(federation, job_id, round_=1):
    return next(r for r in federation.admin().job(job_id).rounds if r.round == round_)


def test_num_samples_beyond_the_rows_reported_at_join_is_refused_and_the_honest_round_completes(federation):
    job_id, sites, tasks, state = _round(federation, HONEST_ROWS)
    with pytest.raises(grpc.RpcError) as err:
        sites["c"].submit(tasks["c"], {k: v + 0.4 for k, v in state.items()}, num_samples=2 ** 31 - 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"exceeds the {HONEST_ROWS} training rows this site reported" in err.value.details()
    for name, shift in (("a", 1.0), ("b", -1.0)):
        assert sites[name].submit(tasks[name], {k: v + shift for k, v in state.items()},
                                  num_samples=HONEST_ROWS).accepted
    _finish(federation, job_id, sites)

    info = _round_info(federation, job_id)
    assert list(info.contributors) == ["a", "b"] and info.total_samples == 2 * HONEST_ROWS
    liar = [e for e in federation.admin().job(job_id).site_events if e.site == "c" and e.round == 1]
    assert liar[0].status == "rejected" and liar[0].reason == err.value.details()


@pytest.mark.parametrize("num_samples", [2 ** 31 - 1, 2 ** 31])
def test_a_site_claiming_2_31_samples_can_neither_exhaust_the_range_nor_take_the_model_over(federation,
                                                                                            num_samples):
    """c also claims 2**31 rows at Join. Before: with 2**31-1 and values just under 0.5, c's update used up
    the fixed-point range and every honest update after it was refused; with 2**31 the global model became
    c's own update. Now c weighs at most 3× the others' rows (max_weight_share 0.75) and holds only its
    third of the range."""
    job_id, sites, tasks, state = _round(federation, 2 ** 31)
    lie = {k: np.full_like(v, np.nextafter(np.float32(0.5), np.float32(0))) for k, v in state.items()}
    reply = sites["c"].submit(tasks["c"], lie, num_samples=num_samples)   # first, to take the range before a and b
    assert reply.accepted and f"weighted as {3 * 2 * HONEST_ROWS}" in reply.message
    sent = {"c": (lie, 3 * 2 * HONEST_ROWS)}
    for name, shift in (("a", 1.0), ("b", -1.0)):
        update = {k: v + shift for k, v in state.items()}
        assert sites[name].submit(tasks[name], update, num_samples=HONEST_ROWS).accepted
        sent[name] = (update, HONEST_ROWS)
    _finish(federation, job_id, sites)

    info = _round_info(federation, job_id)
    assert list(info.contributors) == ["a", "b", "c"] and info.total_samples == 8 * HONEST_ROWS
    got = federation.store.load_checkpoint(job_id, 1)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in _mean(sent).items()}
    assert not all(np.array_equal(got[k], lie[k]) for k in got)


def test_evaluation_results_are_weighted_with_the_bounded_weights(federation):
    """Before: c's accuracy 1.0 with num_samples 1e300 made the round's mean accuracy 1.0."""
    job_id, sites, tasks, state = _round(federation, HONEST_ROWS)
    for name in ("a", "b", "c"):
        sites[name].submit(tasks[name], state, num_samples=HONEST_ROWS)
    wait_until(lambda: federation.store.job(job_id).current_round == 1, 30, "round 1 to close")
    for name, site in sites.items():   # the final evaluation round
        task = site.next_task()
        assert task.kind == fpb.TASK_EVALUATE
        claims = {"accuracy": 1.0, "num_samples": 1e300} if name == "c" else {"accuracy": 0.5, "num_samples": 50.0}
        site.stub.ReportResult(fpb.TaskResult(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                              nonce=task.nonce, status=fpb.RESULT_EVALUATED, eval_metrics=claims),
                               timeout=10)
    assert federation.wait_job(job_id) == "completed"

    accuracy = mean_eval(federation.admin().job(job_id))[1]["accuracy"]
    assert accuracy == pytest.approx((0.5 * 50 + 0.5 * 50 + 1.0 * HONEST_ROWS) / (50 + 50 + HONEST_ROWS))
