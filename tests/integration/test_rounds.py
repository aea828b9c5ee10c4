"""Rounds over real gRPC + mTLS: honest sites train, faulty or malicious ones are refused and recorded."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from plexus.cli import main as cli
from plexus.proto.plexus.v1 import federation_pb2 as fpb

import state_db
from integration.harness import expected_mean, heart_job, scaled, wait_until


def _contributors(fed, job_id, round_=1):
    return next(r for r in fed.admin().job(job_id).rounds if r.round == round_).contributors


def _bad_shape(layout, state):
    state = dict(state)
    state["linear.weight"] = np.zeros((3, 13), np.float32)
    return {"state": state}


def _nan(layout, state):
    state = {k: v.copy() for k, v in state.items()}
    state["linear.weight"][1, 12] = np.nan
    return {"state": state}


def _oversize(layout, state):
    return {"state": state, "extra": b"\0" * 8}


def _wrong_manifest_dtype(layout, state):
    manifest = layout.to_proto()
    manifest.tensors[0].dtype = "C64"
    return {"state": state, "manifest": manifest}


@pytest.mark.parametrize("attack", [_bad_shape, _nan, _oversize, _wrong_manifest_dtype])
def test_invalid_update_is_refused_and_the_round_completes_with_honest_sites(federation, attack):
    federation.start_site("a")
    federation.start_site("b")
    attacker = federation.raw_site("c")
    attacker.join()
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(heart_job(rounds=1, min=2)).job_id
    task = attacker.next_task()
    layout, state = attacker.fetch(task)
    with pytest.raises(grpc.RpcError) as err:
        attacker.submit(task, **attack(layout, state))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stop = threading.Event()
    attacker.answer_everything_with_failure(stop)
    try:
        assert federation.wait_job(job_id) == "completed"
    finally:
        stop.set()
    assert list(_contributors(federation, job_id)) == ["a", "b"]
    rejected = [e for e in federation.admin().job(job_id).site_events if e.site == "c" and e.round == 1]
    assert rejected[0].status == "rejected" and rejected[0].reason == err.value.details()


def test_replay_other_site_task_and_closed_round_are_refused(federation):
    federation.start_site("a")
    holder, attacker = federation.raw_site("b"), federation.raw_site("c")
    holder.join()
    attacker.join()
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(heart_job(rounds=1, min=2)).job_id
    held = holder.next_task()  # b keeps the round open until it answers
    task = attacker.next_task()
    _, state = attacker.fetch(task)

    other = wait_until(lambda: state_db.query(federation.store.state_dir,
                                              "SELECT task_id FROM tasks WHERE site = 'a' AND job_id = ?", (job_id,)),
                       what="a's task")[0][0]
    with pytest.raises(grpc.RpcError) as err:
        attacker.submit(task, state, task_id=other)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    with pytest.raises(grpc.RpcError) as err:
        attacker.submit(task, state, nonce=b"\0" * 16)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    assert attacker.submit(task, state, num_samples=7).accepted
    with pytest.raises(grpc.RpcError) as err:
        attacker.submit(task, state, num_samples=7)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "replays are refused" in err.value.details()
    assert federation.coordinator.engine.driver.round.contributors.count("c") == 1  # the replay changed nothing

    holder.report(held, fpb.RESULT_FAILED, "holding test site")
    stop = threading.Event()
    attacker.answer_everything_with_failure(stop)
    holder.answer_everything_with_failure(stop)
    try:
        assert federation.wait_job(job_id) == "completed"
    finally:
        stop.set()
    info = next(r for r in federation.admin().job(job_id).rounds if r.round == 1)
    assert list(info.contributors) == ["a", "c"]
    assert info.total_samples == 7 + 199  # c counted once; a is cleveland's 199 training rows

    with pytest.raises(grpc.RpcError) as err:
        attacker.submit(task, state)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "closed" in err.value.details()


def test_policy_decline_is_recorded_and_shown(federation, capsys):
    federation.start_site("a")
    federation.start_site("b")
    federation.start_site("c", allowed_models=("logistic",))
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(heart_job(model="mlp", rounds=2, min=2)).job_id
    assert federation.wait_job(job_id) == "completed"
    detail = federation.admin().job(job_id)
    assert all(list(r.contributors) == ["a", "b"] for r in detail.rounds if r.status == "closed")
    declined = [e for e in detail.site_events if e.status == "declined"]
    assert [(e.site, e.round) for e in declined] == [("c", 1)]
    assert "allowed_models" in declined[0].reason
    # c's data was never used: it reported no metric for this job
    assert not [m for m in detail.metrics if m.site == "c"]
    code = cli(["job", "show", job_id, "--kit", str(federation.root / "admins" / "viewer"),
                "--coordinator", federation.address])
    out = capsys.readouterr().out
    assert code == 0 and "declined" in out and "allowed_models" in out


def test_round_fails_clearly_without_quorum_and_the_model_is_unchanged(federation):
    federation.start_site("a")
    silent = federation.raw_site("b")
    silent.join()
    federation.wait_online("a", "b")
    job_id = federation.admin().submit(heart_job(rounds=3, min=2, deadline=1.5)).job_id
    silent.next_task()  # takes the task and never answers
    assert federation.wait_job(job_id) == "failed"
    detail = federation.admin().job(job_id)
    summary = detail.summary
    assert "below sites.min=2" in summary.message and "b: late" in summary.message
    assert "`plexus job resume`" in summary.message   # the way out, once b is back
    assert [(e.site, e.status, e.reason) for e in detail.site_events if e.status == "late"] == [
        ("b", "late", "no update by the round deadline (1.5 s)")]
    assert summary.current_round == 0
    assert federation.store.checkpoint_path(job_id, 0).exists()
    assert not federation.store.checkpoint_path(job_id, 1).exists()


def test_metrics_are_stored_per_site_and_round(federation):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    job_id = federation.admin().submit(heart_job(rounds=2, min=2)).job_id
    assert federation.wait_job(job_id) == "completed"
    metrics = {(m.round, m.site, m.kind, m.name): m.value for m in federation.admin().job(job_id).metrics}
    for site in "ab":
        for model_round in (0, 1, 2):  # every global model, incl. the final one, evaluated at every site
            assert 0.0 <= metrics[(model_round, site, "eval", "accuracy")] <= 1.0
            assert 0.0 <= metrics[(model_round, site, "eval", "auc")] <= 1.0
            assert metrics[(model_round, site, "eval", "loss")] > 0
        assert metrics[(1, site, "train", "num_samples")] > 0
    assert metrics[(2, "a", "eval", "loss")] < metrics[(0, "a", "eval", "loss")]


def test_seeded_runs_give_the_same_model_bit_for_bit(federation, tmp_path):
    for name in "abc":
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    ops = federation.admin()
    models = []
    for seed in (5, 5, 6):
        job_id = ops.submit(heart_job(rounds=3, min=3, seed=seed)).job_id
        assert federation.wait_job(job_id) == "completed"
        path = tmp_path / f"{job_id}.safetensors"
        assert ops.download_to(job_id, path) == 3
        models.append(path.read_bytes().split(b"}", 1)[1])  # tensor bytes after the JSON header
    assert models[0] == models[1]
    assert models[0] != models[2]


def test_site_failure_is_recorded_with_its_reason(federation):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    wrong = heart_job(rounds=2, min=2).replace("in_features: 13", "in_features: 12")
    job_id = federation.admin().submit(wrong).job_id
    assert federation.wait_job(job_id) == "failed"
    detail = federation.admin().job(job_id)
    failed = {e.site: e.reason for e in detail.site_events if e.status == "failed"}
    assert set(failed) == {"a", "b"} and all("shape" in r for r in failed.values())
    assert "below sites.min=2" in detail.summary.message and "a: failed" in detail.summary.message


def test_coordinator_refuses_to_start_without_a_crl(pki_root, tmp_path):
    from coordinator.server import Coordinator
    from plexus.config import CoordinatorConfig
    from plexus.errors import ConfigError

    with pytest.raises(ConfigError, match="crl"):
        Coordinator(CoordinatorConfig(listen="127.0.0.1:0", kit=pki_root / "coordinator", state_dir=tmp_path,
                                      crl=tmp_path / "missing-crl.pem"))


def test_flow_control_windows_and_transfer_slots_do_not_change_the_model(pki_root, tmp_path):
    """stream_window_bytes and max_transfers trade throughput for memory; the result must not depend on
    them: gRPC's adaptive windows and unlimited transfers against a 64 KiB window, one transfer at a time."""
    from integration.harness import Federation

    job = heart_job(model="mlp", rounds=2, min=2).replace("num_classes: 2", "hidden: [512, 256], num_classes: 2")
    models = []
    federation = Federation(pki_root, tmp_path / "adaptive", stream_window_bytes=0, max_transfers=1024)
    fixed = Federation(pki_root, tmp_path / "fixed-window", stream_window_bytes=65536, max_transfers=1)
    try:
        for fed in (federation, fixed):
            fed.start_site("a")
            fed.start_site("b")
            fed.wait_online("a", "b")
            job_id = fed.admin().submit(job).job_id
            assert fed.wait_job(job_id) == "completed"
            _, state = fed.admin().download(job_id)
            assert sum(v.nbytes for v in state.values()) > 8 * 65536   # the model spans many windows
            models.append({k: v.tobytes() for k, v in state.items()})
    finally:
        fixed.close()
        federation.close()
    assert models[0] == models[1]


def _honest_raw_round(federation, *, deadline: float):
    """Sites a and b (raw) send known updates; c is left to the test. Returns (sites, tasks, layout, sent)."""
    sites = {name: federation.raw_site(name) for name in ("a", "b", "c")}
    for site in sites.values():
        site.join()
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(heart_job(rounds=1, min=2, deadline=deadline)).job_id
    tasks = {name: site.next_task() for name, site in sites.items()}
    layout, state = sites["a"].fetch(tasks["a"])
    sent = {"a": ({k: v + 0.25 for k, v in state.items()}, 10), "b": ({k: v * -0.5 for k, v in state.items()}, 30)}
    return job_id, sites, tasks, layout, state, sent


def _finish(federation, job_id, sites):
    stop = threading.Event()
    for site in sites.values():
        site.answer_everything_with_failure(stop)   # the final evaluation round
    try:
        assert federation.wait_job(job_id) == "completed"
    finally:
        stop.set()


def test_an_update_refused_part_way_is_taken_back_out_of_the_sum_exactly(federation):
    """c's update is folded chunk by chunk as it arrives, then its last element is NaN: everything of it
    already in the running sum comes out again, and round 1 is exactly the mean of a and b."""
    job_id, sites, tasks, layout, state, sent = _honest_raw_round(federation, deadline=30)
    poisoned = {k: v.copy() for k, v in state.items()}
    last = layout.tensors[-1]
    poisoned[last.name].reshape(-1)[-1] = np.nan
    with pytest.raises(grpc.RpcError) as err:
        sites["c"].submit(tasks["c"], poisoned, num_samples=1000, chunk=24)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.value.details()
    for name, (update, samples) in sent.items():
        sites[name].submit(tasks[name], update, num_samples=samples)
    _finish(federation, job_id, sites)

    got = federation.store.load_checkpoint(job_id, 1)
    assert list(_contributors(federation, job_id)) == ["a", "b"]
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in expected_mean(layout, sent).items()}


def test_an_update_still_arriving_at_the_deadline_is_taken_out_before_the_mean(federation):
    # The round runs its whole deadline out (c never finishes); what must happen within it (three task polls, a
    # fetch, c's first half, a's and b's updates) takes a few hundred ms at most.
    job_id, sites, tasks, layout, state, sent = _honest_raw_round(federation, deadline=scaled(1))
    release, outcome = threading.Event(), {}

    def stalled():   # half of c's update is in the sum when its stream stops moving
        try:
            sites["c"].submit(tasks["c"], {k: v * 100 for k, v in state.items()}, num_samples=1000, chunk=24,
                              pause=(layout.total_bytes // 2, release), timeout=30)
        except grpc.RpcError as exc:
            outcome["code"], outcome["details"] = exc.code(), exc.details()
    thread = threading.Thread(target=stalled, daemon=True)
    thread.start()
    wait_until(lambda: "c" in federation.coordinator.engine.driver.round.folding, 10, "c's update to be arriving")
    for name, (update, samples) in sent.items():
        sites[name].submit(tasks[name], update, num_samples=samples)
    wait_until(lambda: federation.store.job(job_id).current_round == 1, 20, "round 1 to close at its deadline")
    thread.join(scaled(10))   # the closing round cut the stream: its thread and transfer slot are free
    assert not thread.is_alive()
    release.set()
    _finish(federation, job_id, sites)

    assert outcome["code"] == grpc.StatusCode.FAILED_PRECONDITION   # the round had closed under it
    assert "reached its deadline before the update was complete" in outcome["details"]
    assert list(_contributors(federation, job_id)) == ["a", "b"]
    got = federation.store.load_checkpoint(job_id, 1)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in expected_mean(layout, sent).items()}
