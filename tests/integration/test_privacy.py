"""Differential privacy, site policy and the audit trail, over real gRPC + mTLS."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from plexus.accounting import client_epsilon, epsilon_after
from plexus.audit import AuditLog
from plexus.cli import main as cli

from integration.harness import Federation, heart_job, wait_until

Z, S, DELTA = 1.1, 0.5, 1e-5


def dp_job(*, mode="central", target=None, rounds=3, min=2, seed=0, extra="") -> str:
    target_text = f", target_epsilon: {target}" if target else ""
    secure = "true" if mode == "distributed" else "false"
    return heart_job(rounds=rounds, min=min, seed=seed) + (
        f"privacy: {{secure_aggregation: {secure}, dp: {{mode: {mode}, noise_multiplier: {Z}, clip_norm: {S}, "
        f"delta: {DELTA}{target_text}}}{extra}}}\n")


def _opacus_epsilon(rounds: int) -> float:
    accountant = RDPAccountant()
    for _ in range(rounds):
        accountant.step(noise_multiplier=Z, sample_rate=1.0)
    return accountant.get_epsilon(DELTA)


def test_central_dp_records_opacus_epsilon_every_round(federation, capsys):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    job_id = federation.admin().submit(dp_job(rounds=3)).job_id
    assert federation.wait_job(job_id) == "completed"
    detail = federation.admin().job(job_id)
    eps = {m.round: m.value for m in detail.metrics if m.kind == "privacy" and m.name == "epsilon"}
    assert sorted(eps) == [1, 2, 3]
    for r, value in eps.items():
        assert value == pytest.approx(_opacus_epsilon(r), rel=1e-12)
    assert eps[1] < eps[2] < eps[3]
    assert cli(["job", "show", job_id, "--kit", str(federation.root / "admins" / "viewer"),
                "--coordinator", federation.address]) == 0
    assert f"{eps[3]:.3f}" in capsys.readouterr().out


def test_target_epsilon_stops_the_job_cleanly_before_exceeding_it(federation):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    target = (epsilon_after(2, Z, 1.0, DELTA) + epsilon_after(3, Z, 1.0, DELTA)) / 2
    job_id = federation.admin().submit(dp_job(rounds=10, target=target)).job_id
    assert federation.wait_job(job_id) == "budget_reached"
    summary = federation.admin().job(job_id).summary
    assert summary.current_round == 2 and "privacy budget reached" in summary.message
    detail = federation.admin().job(job_id)
    assert max(m.value for m in detail.metrics if m.name == "epsilon") <= target
    # the final model was evaluated; under DP the sites keep their metrics to themselves (docs/privacy.md)
    assert {e.status for e in detail.site_events if e.round == 3} == {"evaluated"}
    assert not [m for m in detail.metrics if m.site]


def _sampled(job: str, count: int) -> str:
    return job.replace("sites: {min: 2,", f"sites: {{min: 2, count: {count},")


def _ledger(detail) -> tuple[dict[int, float], dict[int, float]]:
    privacy = [m for m in detail.metrics if m.kind == "privacy" and not m.site]
    return ({m.round: m.value for m in privacy if m.name == "epsilon"},
            {m.round: m.value for m in privacy if m.name == "sampling_rate"})


def test_sampled_sites_account_each_rounds_q_and_stop_at_the_target_later(federation):
    """2 of 4 sites a round: q = 1/2, recorded next to ε, and ε composes it; the target that q = 1 would
    reach after one round is reached only after three."""
    for name in "abcd":
        federation.start_site(name)
    federation.wait_online("a", "b", "c", "d")
    target = 6.0
    assert client_epsilon(Z, [1.0] * 2, DELTA) > target > client_epsilon(Z, [0.5] * 3, DELTA)
    assert client_epsilon(Z, [0.5] * 4, DELTA) > target
    job_id = federation.admin().submit(_sampled(dp_job(rounds=10, target=target), 2)).job_id
    assert federation.wait_job(job_id) == "budget_reached", federation.store.job(job_id).message
    detail = federation.admin().job(job_id)
    assert detail.summary.current_round == 3 and "privacy budget reached" in detail.summary.message
    eps, rates = _ledger(detail)
    assert rates == {1: 0.5, 2: 0.5, 3: 0.5}
    for r, value in eps.items():
        assert abs(value - client_epsilon(Z, [0.5] * r, DELTA)) < 1e-12
    assert [r.total_samples for r in detail.rounds if r.round <= 3] == [2, 2, 2]   # a DP round counts updates


def test_a_resumed_sampled_job_composes_the_rates_of_the_rounds_before_the_restart(pki_root, tmp_path):
    state, rounds = tmp_path / "state", 12
    first = Federation(pki_root, state)
    try:
        for name in "abc":
            first.start_site(name)
        first.wait_online("a", "b", "c")
        job_id = first.admin().submit(_sampled(dp_job(rounds=rounds), 2)).job_id
        wait_until(lambda: first.store.job(job_id).current_round >= 2, 60, "round 2 to close")
    finally:
        first.close()
    second = Federation(pki_root, state)
    try:
        before = second.store.job(job_id).current_round
        assert 2 <= before < rounds, "the job finished before the restart; the test did not test resuming"
        for name in "abc":
            second.start_site(name)
        assert second.wait_job(job_id, timeout=120) == "completed", second.store.job(job_id).message
        eps, rates = _ledger(second.admin().job(job_id))
        assert sorted(eps) == sorted(rates) == list(range(1, rounds + 1))
        assert {rates[r] for r in range(1, before + 1)} == {2 / 3}   # all three sites were online then
        assert set(rates.values()) <= {2 / 3, 1.0}   # 1.0 if a site was not back yet when a round opened
        for r in range(1, rounds + 1):   # after the restart too: the rounds before it keep their q
            assert abs(eps[r] - client_epsilon(Z, [rates[i] for i in range(1, r + 1)], DELTA)) < 1e-12
    finally:
        second.close()


def test_unclipped_update_is_refused_in_a_dp_job(federation):
    federation.start_site("a")
    federation.start_site("b")
    raw = federation.raw_site("c")
    raw.join()
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(dp_job(rounds=1)).job_id
    task = raw.next_task()
    _, state = raw.fetch(task)
    state["linear.weight"] = state["linear.weight"] + 1.0   # ‖Δ‖ = √26 ≫ S
    with pytest.raises(grpc.RpcError) as err:
        raw.submit(task, state)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "clip_norm" in err.value.details()
    stop = threading.Event()
    raw.answer_everything_with_failure(stop)
    try:
        assert federation.wait_job(job_id) == "completed"
    finally:
        stop.set()


def test_seeded_central_dp_is_reproducible_and_noise_moves_the_model(federation, tmp_path):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    ops = federation.admin()
    models = []
    reproducible = dp_job(rounds=2, seed=4).replace(f"delta: {DELTA}", f"delta: {DELTA}, reproducible_noise: true")
    for job in (reproducible, reproducible, heart_job(rounds=2, seed=4)):
        job_id = ops.submit(job).job_id
        assert federation.wait_job(job_id) == "completed"
        models.append(federation.store.load_checkpoint(job_id, 2))
    assert all(np.array_equal(models[0][k], models[1][k]) for k in models[0])
    assert not all(np.array_equal(models[0][k], models[2][k]) for k in models[0])


def test_central_dp_under_secure_aggregation_adds_its_noise_to_the_unmasked_mean(federation):
    """The coordinator's N(0, (zS)²) on the sum goes on the survivors' unmasked mean too (it once did not, while
    the ledger recorded ε): the same seeded job with z = 0 differs from it by exactly that draw."""
    from plexus.config import parse_round_config
    from plexus.dp import add_noise, central_std, noise_key

    for name in "abc":
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    models = {}
    for z in (Z, 0.0):
        job = heart_job(rounds=1, min=3, seed=5) + (
            f"privacy: {{secure_aggregation: true, dp: {{mode: central, noise_multiplier: {z}, clip_norm: {S}, "
            f"reproducible_noise: true}}, secagg: {{phase_timeout_s: 10}}}}\n")
        job_id = federation.admin().submit(job).job_id
        assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
        models[z] = federation.store.load_checkpoint(job_id, 1)
    cfg = parse_round_config(job)
    zeros = {k: np.zeros(v.shape, np.float64) for k, v in models[Z].items()}
    noise = add_noise(zeros, central_std(Z, S, 3), noise_key(cfg.seed, cfg.name, 1, "coordinator"))
    for k in models[Z]:
        assert np.abs(noise[k]).max() > 0.01
        np.testing.assert_allclose(models[Z][k].astype(np.float64) - models[0.0][k], noise[k], rtol=0, atol=1e-5)


def test_site_stops_taking_part_when_epsilon_would_pass_its_cap(federation):
    from plexus.config import DatasetSpec, PolicySpec, SiteConfig
    from site_agent.agent import SiteAgent

    for name in "ab":
        federation.start_site(name)
    cap = (epsilon_after(1, Z, 1.0, DELTA) + epsilon_after(2, Z, 1.0, DELTA)) / 2
    config = SiteConfig(site="c", coordinator=federation.address, kit=federation.root / "sites" / "c",
                        state_dir=federation.root / "sites" / "c" / "state-cap",
                        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital="va")},
                        policy=PolicySpec(allowed_models=("logistic",), max_epsilon=cap))
    agent = SiteAgent(config, backoff_cap_s=0.5)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    federation.agents.append((agent, thread))
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(dp_job(rounds=3)).job_id
    assert federation.wait_job(job_id) == "completed"
    detail = federation.admin().job(job_id)
    assert [list(r.contributors) for r in detail.rounds if r.round <= 3] == [["a", "b", "c"], ["a", "b"], ["a", "b"]]
    declined = [e for e in detail.site_events if e.status == "declined"]
    assert [(e.site, e.round) for e in declined] == [("c", 2)] and "max_epsilon" in declined[0].reason


def test_distributed_dp_with_secure_aggregation_completes(federation):
    for name in "abc":
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    job = dp_job(mode="distributed", rounds=2, min=3, extra=", secagg: {phase_timeout_s: 10}")
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    detail = federation.admin().job(job_id)
    assert all(list(r.contributors) == ["a", "b", "c"] for r in detail.rounds if r.round <= 2)
    assert {m.round for m in detail.metrics if m.name == "epsilon"} == {1, 2}


def test_dp_sgd_job_trains_with_opacus_and_keeps_each_sites_ledger(federation):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    job = heart_job(rounds=2) + "privacy: {dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0, delta: 1e-5}}\n"
    job_id = federation.admin().submit(job).job_id
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    eps = {(m.round, m.site): m.value for m in federation.admin().job(job_id).metrics
           if m.kind == "train" and m.name == "epsilon"}
    assert set(eps) == {(1, "a"), (1, "b"), (2, "a"), (2, "b")}
    assert eps[(2, "a")] > eps[(1, "a")] > 0       # the site's ledger accumulates across rounds
    for site in "ab":
        assert (federation.root / "sites" / site / "state" / "dp_sgd" / f"{job_id}.json").exists()


def test_audit_trails_record_who_did_what_and_verify(federation, capsys):
    for name in "ab":
        federation.start_site(name)
    federation.wait_online("a", "b")
    job_id = federation.admin().submit(heart_job(rounds=1)).job_id
    assert federation.wait_job(job_id) == "completed"
    admin = ["--kit", str(federation.root / "admins" / "viewer"), "--coordinator", federation.address]
    assert cli(["audit", "--verify", "--json", *admin]) == 0
    out = capsys.readouterr().out
    assert "admin:ops" in out and "job_submitted" in out and "round_closed" in out and "site_joined" in out
    site_log = AuditLog(federation.root / "sites" / "a" / "state" / "audit.db")
    try:
        actions = [e.action for e in site_log.entries()]
        assert site_log.verify() == len(actions)
    finally:
        site_log.close()
    assert "ran" in actions and "sent" in actions
