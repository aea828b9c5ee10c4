"""Compressed updates end to end over real gRPC + mTLS on the heart-disease hospitals: every uplink codec trains,
moves the bytes it should, gives the same bits again from the same seed, keeps its error-feedback residual
across a site restart, and a site sending malformed sparse indices or int4 nibbles is refused while the round
goes on; int4 up with delta4 down trains, each site holding the served chain bit for bit."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from plexus.admin_client import mean_eval
from plexus.compression import downlink_decode, downlink_encode, uplink_codec, zero_base
from plexus.config import DownlinkSpec, parse_round_config
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import Layout, encode
from site_agent.agent import SiteAgent

from integration.harness import wait_until

JOB = """\
name: {name}
model: {{name: mlp, args: {{in_features: 13, hidden: [64], num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
sites: {{min: {min}, deadline_s: 60}}
train: {{epochs: 1, batch_size: 16, optimizer: {{name: sgd, lr: 0.1}}}}
compression: {{uplink: {uplink}{downlink}}}
seed: 5
"""
FOUR = ("a", "b", "c", "d")
UPLINKS = {"none": "{codec: none}", "fp16": "{codec: fp16}", "int8": "{codec: int8}",
           "topk": "{codec: topk, fraction: 0.05}", "adacomp": "{codec: adacomp}",
           "randk": "{codec: randk, fraction: 0.25}", "int4": "{codec: int4}"}


def job(codec: str, *, rounds: int = 3, min: int = 4, name: str | None = None, downlink: str | None = None) -> str:
    return JOB.format(name=name or f"heart-{codec}", rounds=rounds, min=min, uplink=UPLINKS[codec],
                      downlink="" if downlink is None else f", downlink: {{codec: {downlink}}}")


def bytes_in(federation) -> float:
    return federation.coordinator.metrics.model_bytes.labels("in")._value.get()


def run(federation, codec: str, **kw) -> tuple[str, float]:
    admin = federation.admin()
    before = bytes_in(federation)
    job_id = admin.submit(job(codec, **kw)).job_id
    assert federation.wait_job(job_id, timeout=120) == "completed", admin.job(job_id).summary.message
    return job_id, bytes_in(federation) - before


@pytest.fixture
def four(federation):
    return federation.start_sites(*FOUR)


def test_every_uplink_codec_trains_and_sends_fewer_bytes_than_dense_updates(four):
    admin = four.admin()
    sent = {}
    for codec in UPLINKS:
        job_id, sent[codec] = run(four, codec)
        evals = mean_eval(admin.job(job_id))
        assert evals[0]["loss"] - evals[max(evals)]["loss"] > 0.01, (codec, evals)
    dense = sent["none"]
    assert 0.45 < sent["fp16"] / dense <= 0.51, sent
    assert 0.24 < sent["int8"] / dense <= 0.27, sent      # one byte per element + a float per 256
    assert 0.12 < sent["int4"] / dense <= 0.14, sent      # half a byte per element + a float per 256
    assert sent["topk"] / dense < 0.11, sent              # 5 % of the entries, index + value each
    assert sent["randk"] / dense < 0.27, sent             # 25 % of the values, no indices
    assert sent["adacomp"] / dense < 0.5, sent


def test_a_seeded_compressed_run_gives_the_same_model_bit_for_bit(four):
    first, _ = run(four, "int8", rounds=2, name="again-1")
    second, _ = run(four, "int8", rounds=2, name="again-1")
    a = four.store.load_checkpoint(first, 2)
    b = four.store.load_checkpoint(second, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_the_error_feedback_residual_survives_a_site_restart(four):
    """topk with error feedback: a's residual after round 1 is on disk; an agent restarted before round 2
    reads it back, so its round-2 update is the top-k of Δ2 + that residual."""
    admin = four.admin()
    job_id = admin.submit(job("topk", rounds=3)).job_id
    store = four.store
    wait_until(lambda: store.job(job_id).current_round >= 1, 60, "round 1")
    agent, thread = next((a, t) for a, t in four.agents if a.config.site == "a")
    # The site writes its residual once the coordinator's reply reaches it, which can be after the round closed.
    wait_until(lambda: any(agent.config.state_dir.rglob(f"*{job_id}*.safetensors")), 60, "a's residual on disk")
    residual_file = next(agent.config.state_dir.rglob(f"*{job_id}*.safetensors"))
    agent.stop.set()
    thread.join(timeout=30)
    four.agents.remove((agent, thread))
    assert residual_file.exists()
    four.start_site("a")
    assert four.wait_job(job_id, timeout=120) == "completed"
    assert residual_file.exists()


def tampered_update_refused(federation, codec: str, tamper) -> grpc.RpcError:
    """Sites a, b, c and a raw site d in a one-round job of `codec`; d encodes an update of ones and sends it as
    `tamper` changed it. Returns the refusal d got, once the round went on without d and the job completed."""
    for name in ("a", "b", "c"):
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    raw = federation.raw_site("d")
    raw.join()
    federation.wait_online("d")
    admin = federation.admin()
    job_id = admin.submit(job(codec, rounds=1, min=3)).job_id
    cfg = parse_round_config(job(codec, rounds=1, min=3))
    task = raw.next_task()
    _, model = raw.fetch(task)
    tensors, _ = uplink_codec(cfg.compression.uplink, seed=cfg.seed).encode(
        {k: np.ones_like(v) for k, v in model.items()}, round_=task.round, residual=None, rng=np.random.default_rng(0))
    with pytest.raises(grpc.RpcError) as refused:
        raw.submit(task, tamper(dict(tensors)))
    stop = threading.Event()   # from now on it fails every task, so no round waits out its deadline for it
    raw.answer_everything_with_failure(stop)
    try:
        assert federation.wait_job(job_id, timeout=120) == "completed"
    finally:
        stop.set()
    rounds = {r.round: r for r in admin.job(job_id).rounds}
    assert sorted(rounds[1].contributors) == ["a", "b", "c"]
    assert task.kind == fpb.TASK_TRAIN
    return refused.value


def test_a_site_sending_an_out_of_range_index_is_refused_with_invalid_argument_and_the_round_goes_on(federation):
    def tamper(tensors):
        name = next(k for k in tensors if k.endswith("/topk.gaps"))
        assert tensors[name].dtype == np.uint8   # all-ones Δ: its top 5 % are the first entries, 1 apart
        # Every gap 255: the k = ceil(N / 20) entries would reach 255·k − 1 >= N, past the end.
        tensors[name] = np.full_like(tensors[name], 255)
        return tensors

    refused = tampered_update_refused(federation, "topk", tamper)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "range" in refused.details()



def test_int4_up_and_delta4_down_train_with_every_site_on_the_served_chain(four, monkeypatch):
    """Each round every site fetches a delta4 step from the chain model it holds (its first from zeros),
    decodes chain_r bit for bit (recomputed here from the exact checkpoints with the codec itself), and sends
    its Δ from it as int4: ceil(N/2) bytes and a float32 scale per 256 values of each tensor."""
    decoded = {}   # (site, model round) -> what the site trains from
    fetch = SiteAgent._fetch

    def recording_fetch(self, stub, task, expected, job_):
        state = fetch(self, stub, task, expected, job_)
        decoded[(self.config.site, task.model_round)] = {k: np.array(v) for k, v in state.items()}
        return state

    monkeypatch.setattr(SiteAgent, "_fetch", recording_fetch)
    admin, registry = four.admin(), four.coordinator.metrics.registry
    out_before = registry.get_sample_value("plexus_model_bytes_total", {"direction": "out"})
    job_id, sent_up = run(four, "int4", downlink="delta4", name="heart-int4-delta4")
    sent_down = registry.get_sample_value("plexus_model_bytes_total", {"direction": "out"}) - out_before
    evals = mean_eval(admin.job(job_id))
    assert evals[0]["loss"] - evals[max(evals)]["loss"] > 0.01, evals

    checkpoints = [four.store.load_checkpoint(job_id, r) for r in range(4)]
    layout = Layout.of(checkpoints[0])
    assert all(t.dtype == "F32" for t in layout.tensors)
    spec = DownlinkSpec(codec="delta4")
    chain = [downlink_decode(spec, layout, downlink_encode(spec, checkpoints[0], zero_base(layout)), zero_base(layout))]
    for model in checkpoints[1:]:
        chain.append(downlink_decode(spec, layout, downlink_encode(spec, model, chain[-1]), chain[-1]))
    assert sorted(decoded) == [(site, r) for site in FOUR for r in range(4)]
    for (site, round_), state in decoded.items():
        assert bytes(encode(state)[1]) == bytes(encode(chain[round_])[1]), (site, round_)

    scales = sum(-(-t.numel // 256) for t in layout.tensors)
    update = sum(-(-t.numel // 2) for t in layout.tensors) + 4 * scales
    assert sent_up == 3 * 4 * update                     # 3 rounds, 4 sites
    # each site's first fetch the chain's start from zeros, then a delta for each round's training and the final
    # evaluation: every one as many bytes as an int4 update
    assert sent_down == 4 * 4 * update


def test_a_site_sending_an_int4_value_of_minus_8_is_refused_with_invalid_argument_and_the_round_goes_on(federation):
    name = ""

    def tamper(tensors):
        nonlocal name
        name = next(k for k in tensors if k.endswith("/int4.values"))
        tensors[name] = tensors[name].copy()
        tensors[name][2] = 0x87   # element 5, the high nibble of byte 2: 0x8, the -8 no encoder writes
        return tensors

    refused = tampered_update_refused(federation, "int4", tamper)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{name!r}: value -8 at element 5 (byte 2, high nibble)" in refused.details()
