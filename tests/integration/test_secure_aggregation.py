"""Secure aggregation over real gRPC + mTLS: the coordinator learns only the survivors' sum."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from coordinator.tasks import site_seed
from plexus.config import parse_round_config
from plexus.datasets import heart_disease
from plexus.models import build_model, load_numpy_state, state_to_numpy
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg import frac_bits
from site_agent.agent import SiteAgent
from site_agent.training import train_local

from integration.harness import HOSPITAL_OF, DropsOut, heart_job, scaled, wait_until

CLIP = 4.0


# For a test whose dropouts must run phases out (each one costs the whole timeout): honest agents answer each
# phase in about 60 ms here, fifty times less; tests whose raw sites compute phases by hand keep scaled(2).
DROPOUT_PHASE_S = scaled(1)


def secure_job(**kw) -> str:
    timeout = kw.pop("phase_timeout", scaled(2))   # honest sites answer each phase within it (in ms), even when loaded
    return heart_job(**kw) + (f"privacy: {{secure_aggregation: true, secagg: {{clip: {CLIP}, "
                              f"phase_timeout_s: {timeout}}}}}\n")


def start_agent(federation, name, agent_cls=SiteAgent, **kwargs):
    from plexus.config import DatasetSpec, PolicySpec, SiteConfig

    config = SiteConfig(site=name, coordinator=federation.address, kit=federation.root / "sites" / name,
                        state_dir=federation.root / "sites" / name / "state",
                        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[name])},
                        policy=PolicySpec(allowed_models=("logistic",), require_secure_aggregation=True))
    agent = agent_cls(config, backoff_cap_s=0.5, **kwargs)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    federation.agents.append((agent, thread))
    return agent


def plain_fedavg(job_yaml: str, sites: list[str]) -> tuple[dict, dict]:
    """Round 1 recomputed in the clear from the sites' deterministic local training."""
    job = parse_round_config(job_yaml)
    initial = state_to_numpy(build_model(job.model.name, job.model.args, seed=job.seed))
    trained, weights = {}, {}
    for site in sites:
        data = heart_disease(HOSPITAL_OF[site])
        model = build_model(job.model.name, job.model.args, seed=job.seed)
        load_numpy_state(model, initial)
        result = train_local(model, data.x_train, data.y_train, job.train, seed=site_seed(job.seed, 1, site))
        trained[site], weights[site] = state_to_numpy(model), result.num_samples
    total = sum(weights.values())
    mean = {k: sum(weights[s] * trained[s][k].astype(np.float64) for s in sites) / total for k in initial}
    return mean, {s: {k: trained[s][k] - initial[k] for k in initial} for s in sites}


def u32(masked_blobs) -> list[np.ndarray]:
    """The masked inputs the coordinator took in (the masked_blobs fixture), as uint32 vectors."""
    return [np.frombuffer(blob, dtype="<u4") for _, blob in masked_blobs]


def test_round_completes_with_the_survivors_sum_when_sites_drop_out(federation, masked_blobs):
    for name in "abc":
        start_agent(federation, name)
    start_agent(federation, "d", DropsOut, vanish_at=fpb.TASK_SECAGG_MASKED_INPUT)  # shared its keys, never masks
    start_agent(federation, "e", DropsOut, vanish_at=fpb.TASK_SECAGG_UNMASK)        # masked, then gone
    federation.wait_online(*"abcde")
    job_yaml = secure_job(rounds=1, min=3, seed=11, deadline=scaled(5), phase_timeout=DROPOUT_PHASE_S)
    job_id = federation.admin().submit(job_yaml).job_id
    wait_until(lambda: federation.store.job(job_id).current_round == 1, 60, "round 1 to close without d and e")
    for name in "de":   # back (restarted) for the final evaluation, which would otherwise wait out its deadline
        start_agent(federation, name)
    assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message

    detail = federation.admin().job(job_id)
    round1 = next(r for r in detail.rounds if r.round == 1)
    survivors = ["a", "b", "c", "e"]
    assert list(round1.contributors) == survivors
    expected, deltas = plain_fedavg(job_yaml, survivors)
    assert max(float(np.abs(d).max()) for s in deltas.values() for d in s.values()) < CLIP  # nothing was clipped
    got = federation.store.load_checkpoint(job_id, 1)
    bits = frac_bits(CLIP)
    weights = {s: heart_disease(HOSPITAL_OF[s]).x_train.shape[0] for s in "abcde"}
    rescale = sum(weights.values()) / sum(weights[s] for s in survivors)  # W over U1 / W over U3
    bound = len(survivors) * 0.5 * 2.0 ** -bits * rescale  # each site's rounding, rescaled to the survivors
    for name, value in expected.items():
        error = np.abs(got[name].astype(np.float64) - value)
        assert error.max() <= bound + np.abs(value).max() * 2.0 ** -23, (name, error.max(), bound)

    # the coordinator only ever received masked vectors: uniform-looking bytes, unlike the plaintext
    masked_inputs = u32(masked_blobs)
    assert len(masked_inputs) == 4
    for vector in masked_inputs:
        counts = np.bincount(vector.view(np.uint8), minlength=256)
        expected_count = vector.nbytes / 256
        chi2 = float(((counts - expected_count) ** 2 / expected_count).sum())
        assert chi2 < 400, chi2          # 255 degrees of freedom: ~330 at p = 0.001
    plaintexts = [np.concatenate([d.reshape(-1) for _, d in sorted(deltas[s].items())]) for s in survivors]
    for q in plaintexts:
        fixed = np.rint(q * 2.0 ** bits).astype(np.int64).astype(np.uint32)
        assert not any(np.array_equal(fixed, v) for v in masked_inputs)
        assert fixed.tobytes()[:16] not in (federation.store.state_dir / "plexus.db").read_bytes()


def test_too_many_dropouts_fail_the_round_and_keep_the_model(federation):
    start_agent(federation, "a")
    start_agent(federation, "b")
    for name in "cd":
        start_agent(federation, name, DropsOut, vanish_at=fpb.TASK_SECAGG_MASKED_INPUT)
    federation.wait_online(*"abcd")
    job_id = federation.admin().submit(secure_job(rounds=1, min=3, seed=1, phase_timeout=DROPOUT_PHASE_S)).job_id
    assert federation.wait_job(job_id) == "failed"
    message = federation.store.job(job_id).message
    assert "secure aggregation, mask phase: 2 of 4 sites answered" in message and "threshold t=3" in message
    assert "the global model is unchanged at round 0" in message
    assert not federation.store.checkpoint_path(job_id, 1).exists()


def _beside_honest_sites(federation):
    """Honest agents a, b, c and raw site d in a one-round secure job: (d, the job id, d's key, cert and CA PEM, its
    advert task)."""
    for name in "abc":
        start_agent(federation, name)
    raw = federation.raw_site("d")
    raw.join()
    federation.wait_online(*"abcd")
    job_id = federation.admin().submit(secure_job(rounds=1, min=3, seed=2)).job_id
    kit = federation.root / "sites" / "d"
    key, cert, ca = ((kit / f).read_bytes() for f in ("key.pem", "cert.pem", "ca.pem"))
    task = raw.next_task()
    assert task.kind == fpb.TASK_SECAGG_ADVERTISE
    return raw, job_id, key, cert, ca, task


def test_malformed_masked_input_is_excluded_with_a_reason(federation):
    from plexus.secagg import SiteSession, advert_from_proto, advert_to_proto

    raw, job_id, key, cert, ca, task = _beside_honest_sites(federation)
    session = SiteSession(task.job_id, task.round, "d")
    raw.stub.SecAgg(fpb.SecAggMessage(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                      advert=advert_to_proto(session.advertise(50, key, cert))), timeout=5)
    task = raw.next_task()
    assert task.kind == fpb.TASK_SECAGG_SHARE
    shares = session.share([advert_from_proto(a) for a in task.secagg.adverts], threshold=task.secagg.threshold,
                           total_weight=task.secagg.total_weight, ca_pem=ca)
    raw.stub.SecAgg(fpb.SecAggMessage(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                      shares=fpb.SharesMessage(ciphertexts=shares)), timeout=5)
    task = raw.next_task()
    assert task.kind == fpb.TASK_SECAGG_MASKED_INPUT
    too_short = {"linear.bias": np.zeros(2, np.uint32), "linear.weight": np.zeros((2, 12), np.uint32)}
    with pytest.raises(grpc.RpcError) as err:
        raw.submit(task, too_short)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "masked input" in err.value.details()

    stop = threading.Event()
    raw.answer_everything_with_failure(stop)   # d is out of this round; it fails the final evaluation too
    try:
        assert federation.wait_job(job_id) == "completed", federation.store.job(job_id).message
    finally:
        stop.set()
    detail = federation.admin().job(job_id)
    assert list(next(r for r in detail.rounds if r.round == 1).contributors) == ["a", "b", "c"]
    rejected = [e for e in detail.site_events if e.site == "d" and e.round == 1 and e.status == "rejected"]
    assert rejected and rejected[0].reason == err.value.details()


@pytest.mark.parametrize("flaw, says", [
    ("signature", "the advert fails verification: signature verification failed"),
    ("small-order key", "the advert fails verification: the peer's X25519 public key has small order"),
    ("reused key", "the advert reuses a public key"),
    ("another's certificate", "the advert's certificate is not the one site 'd' called with"),
])
def test_an_advert_every_peer_would_refuse_is_refused_at_the_coordinator_and_the_round_goes_on(federation, flaw, says):
    """One such advert, relayed, made every honest site refuse the whole set: every secure round failed, retries too.
    The coordinator now checks what the peers check (signature, keys, certificate), so it is d's problem alone."""
    from plexus import crypto
    from plexus.secagg import SiteSession, advert_message, advert_to_proto

    raw, job_id, key, cert, _, task = _beside_honest_sites(federation)
    advert = advert_to_proto(SiteSession(task.job_id, task.round, "d").advertise(50, key, cert))
    if flaw == "signature":
        advert.signature = bytes(len(advert.signature))
    elif flaw == "another's certificate":
        advert.cert_pem = (federation.root / "sites" / "a" / "cert.pem").read_bytes()
    else:
        if flaw == "small-order key":
            advert.c_pk = bytes(32)
        else:
            advert.s_pk = advert.c_pk
        advert.signature = crypto.sign(key, advert_message(task.job_id, task.round, "d", advert.c_pk, advert.s_pk,
                                                           50, advert.b_commitment))
    with pytest.raises(grpc.RpcError) as err:
        raw.stub.SecAgg(fpb.SecAggMessage(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                          nonce=task.nonce, advert=advert), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details(), err.value.details()
    stop = threading.Event()
    raw.answer_everything_with_failure(stop)
    try:
        assert federation.wait_job(job_id, scaled(120)) == "completed", federation.store.job(job_id).message
    finally:
        stop.set()
    detail = federation.admin().job(job_id)
    assert list(next(r for r in detail.rounds if r.round == 1).contributors) == ["a", "b", "c"]


@pytest.mark.parametrize("strategy", ["median", "trimmed_mean", "krum", "multi_krum", "cwt", "swt",
                                      "ensemble", "scaffold"])
def test_secure_aggregation_with_a_strategy_it_cannot_compute_is_refused_at_submit(federation, strategy):
    args = {"ensemble": "{members: [a, b]}", "krum": "{f: 0}", "multi_krum": "{f: 0}"}.get(strategy, "{}")
    job = secure_job(rounds=1, min=3).replace("rounds: 1", f"rounds: 1\nstrategy: {{name: {strategy}, args: {args}}}")
    if strategy in ("cwt", "swt"):
        job = job.replace("min: 3", "min: 1")
    with pytest.raises(grpc.RpcError) as err:
        federation.admin().submit(job)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "secure aggregation" in err.value.details() or "secure_aggregation" in err.value.details()
    assert federation.store.jobs() == []


def test_site_requiring_secure_aggregation_declines_a_plain_job(federation):
    start_agent(federation, "a")
    federation.start_site("b")
    federation.start_site("c")
    federation.wait_online(*"abc")
    job_id = federation.admin().submit(heart_job(rounds=1, min=2)).job_id
    assert federation.wait_job(job_id) == "completed"
    declined = [e for e in federation.admin().job(job_id).site_events if e.status == "declined"]
    assert [(e.site, e.reason) for e in declined] == [
        ("a", "this site's policy requires secure aggregation (privacy.secure_aggregation: true)")]
