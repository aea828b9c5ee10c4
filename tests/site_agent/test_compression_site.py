"""The site's compressed upload (site_agent/uplink.py): a TRAIN task sends its coded Δ = trained − served with
the error-feedback residual folded in, bounds it under DP, and keeps the new residual (site_agent/state.py) only
once the coordinator accepted the update. A codec-none job sends what it always sent.

Most tests drive SiteAgent.handle with a recording stand-in for the stub; the refusal test runs over real gRPC
with mTLS against a coordinator that refuses the update with INVALID_ARGUMENT."""

from __future__ import annotations

import os
import stat
import time

import grpc
import numpy as np
import pytest
from safetensors.numpy import save

from plexus import pki
from plexus.compression import job_uplink
from plexus.config import DatasetSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.dp import clip_update
from plexus.errors import IntegrityError
from plexus.models import build_job_model, state_to_numpy, state_views
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import Layout, assemble, decode, encode
from site_agent.agent import SiteAgent
from site_agent.state import JobState
from site_agent.uplink import encode_update, model_delta, residual_layout, rounding_rng

from fake_coordinator import FakeCoordinator
from integration.rogue import Outcome, RogueCoordinator, site_agents

JOB = """\
name: squeeze
model: {name: mlp, args: {in_features: 13, hidden: [16], num_classes: 2}}
data: {dataset: heart-disease}
rounds: 5
train: {epochs: 1, batch_size: 32, optimizer: {name: sgd, lr: 0.5}}
"""

# The uplink block of each case. Keys with defaults are spelled out: the codec module does not yet read a key
# left out (None) as its default (test_a_job_naming_only_the_codec_gets_the_codec_defaults).
CODECS = {
    "fp16": "{codec: fp16}",
    "int8": "{codec: int8, block: 16}",
    "int4": "{codec: int4, block: 16}",
    "topk": "{codec: topk, fraction: 0.1, error_feedback: true}",
    "topk-k": "{codec: topk, k: 3, error_feedback: true}",
    "randk": "{codec: randk, fraction: 0.25, error_feedback: true}",
    "randk-no-feedback": "{codec: randk, k: 4, error_feedback: false}",
    "adacomp": "{codec: adacomp, bin_conv: 50, bin_dense: 20}",
}
FEEDBACK = {"topk", "topk-k", "randk", "adacomp"}


def _job_text(uplink: str | None = None, extra: str = "") -> str:
    return JOB + ("" if uplink is None else f"compression: {{uplink: {uplink}}}\n") + extra


def Coordinator(job_text: str) -> FakeCoordinator:
    return FakeCoordinator(parse_round_config(job_text))


class Recording(SiteAgent):
    """A real agent that remembers the model each training task produced (before any DP clipping)."""

    def local_update(self, job, model, served, data, task):
        local = super().local_update(job, model, served, data, task)
        self.trained = state_to_numpy(model)
        return local


def _agent(kit, state_dir) -> Recording:
    return Recording(SiteConfig(
        site="a", coordinator="127.0.0.1:1", kit=kit, state_dir=state_dir,
        datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital="cleveland")},
        policy=PolicySpec(allowed_models=("mlp",))))


def _task(text: str, round_: int, *, kind=fpb.TASK_TRAIN, seed: int = 7) -> fpb.Task:
    return fpb.Task(kind=kind, task_id=f"t{round_}", job_id="squeeze", round=round_, model_round=round_ - 1,
                    config_yaml=text, nonce=b"n" * 16, deadline_unix_s=time.time() + 600, seed=seed + round_)


def _sent(messages) -> tuple[fpb.UpdateHeader, Layout, dict[str, np.ndarray]]:
    """The header, wire layout and wire tensors of one recorded SubmitUpdate stream."""
    header = messages[0].header
    layout = Layout.from_proto(header.manifest)
    return header, layout, decode(layout, assemble(layout, (m.chunk for m in messages[1:])))


def _model_layout(text: str) -> Layout:
    return Layout.of(state_views(build_job_model(parse_round_config(text))))


def _f32(arrays, like: Layout) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(arrays[t.name], dtype=np.float32).reshape(t.shape) for t in like.tensors}


# the residual in JobState ------------------------------------------------------------------------------

LIKE = Layout.build([("a.weight", "F32", (2, 3)), ("a.bias", "F32", (2,))])


def _residual(seed=0):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((2, 3)).astype(np.float32),
            "a.bias": rng.standard_normal(2).astype(np.float32)}


def test_the_residual_round_trips_privately_and_survives_a_restart(tmp_path):
    state = JobState(tmp_path, "job-1")
    assert state.residual(LIKE) is None   # a new job: zero residual
    kept = _residual()
    state.keep_residual(kept)
    path = tmp_path / "residual" / "job-1.safetensors"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(os.listdir(path.parent)) == ["job-1.safetensors"]   # no temporary file left behind
    again = JobState(tmp_path, "job-1").residual(LIKE)   # a new JobState: what a restarted agent reads
    assert again.keys() == kept.keys() and all(np.array_equal(again[n], kept[n]) for n in kept)
    assert JobState(tmp_path, "job-2").residual(LIKE) is None


def test_a_residual_is_replaced_atomically(tmp_path, monkeypatch):
    state = JobState(tmp_path, "job-1")
    state.keep_residual(_residual(0))
    before = (tmp_path / "residual" / "job-1.safetensors").read_bytes()

    def crash(*args):
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        state.keep_residual(_residual(1))
    monkeypatch.undo()
    assert (tmp_path / "residual" / "job-1.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path / "residual")) == ["job-1.safetensors"]


@pytest.mark.parametrize("content, says", [
    (b"\x00garbage, not safetensors", "cannot be read"),
    (save({"a.weight": np.zeros((2, 3), np.float32)}), "does not match the job's model (differs at ['a.bias'])"),
    (save({"a.weight": np.zeros((3, 2), np.float32), "a.bias": np.zeros(2, np.float32)}), "differs at ['a.weight']"),
    (save({"a.weight": np.zeros((2, 3), np.float64), "a.bias": np.zeros(2, np.float32)}), "differs at ['a.weight']"),
    (save({"a.weight": np.full((2, 3), np.nan, np.float32), "a.bias": np.zeros(2, np.float32)}), "NaN"),
])
def test_a_damaged_or_foreign_residual_is_an_error_that_says_how_to_fix_it(tmp_path, content, says):
    (tmp_path / "residual").mkdir()
    (tmp_path / "residual" / "job-1.safetensors").write_bytes(content)
    with pytest.raises(IntegrityError) as caught:
        JobState(tmp_path, "job-1").residual(LIKE)
    message = str(caught.value)
    assert says in message and "residual/job-1.safetensors in its state_dir" in message
    assert "delete the file to restart the residual from zero" in message
    assert str(tmp_path) not in message   # the reason goes to the coordinator: no local paths


# what a site sends -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CODECS))
def test_the_update_decodes_to_delta_plus_old_residual_minus_new(kit, tmp_path, case):
    text = _job_text(CODECS[case])
    job = parse_round_config(text)
    codec, model = job_uplink(job), _model_layout(text)
    agent, stub, state = _agent(kit, tmp_path), Coordinator(text), JobState(tmp_path, "squeeze")
    served = _f32(stub.served(), model)
    assert codec.feedback == (case in FEEDBACK)
    for round_ in (1, 2, 3):   # the later rounds start from a nonzero residual
        old = state.residual(residual_layout(model)) if codec.feedback else None
        agent.handle(stub, _task(text, round_))
        assert stub.results == [] and len(stub.updates) == round_
        header, wire_layout, wire = _sent(stub.updates[-1])
        assert header.num_samples > 0
        assert all("/" in t.name for t in wire_layout.tensors)   # the manifest is the wire layout
        codec.check_layout(model, wire_layout, round_=round_)   # what the coordinator expects
        sent = _f32(codec.decode(model, wire, round_=round_), model)
        delta = model_delta(agent.trained, served)
        if not codec.feedback:
            assert not (tmp_path / "residual").exists()
            if case == "fp16":
                assert all(np.array_equal(sent[n], delta[n].astype(np.float16).astype(np.float32)) for n in sent)
            continue
        new = state.residual(residual_layout(model))
        assert new is not None
        for n in sent:
            g = delta[n] if old is None else delta[n] + old[n]   # G = Δ + old R, in float32 as the codec adds
            assert np.array_equal(g - new[n], sent[n]), n        # sent = Δ + old R − new R, bit for bit
            assert np.array_equal(sent[n] + new[n], g), n


def test_a_job_naming_only_the_codec_gets_the_codec_defaults():
    assert job_uplink(parse_round_config(_job_text("{codec: topk, fraction: 0.1}"))).feedback
    assert job_uplink(parse_round_config(_job_text("{codec: randk, k: 3}"))).feedback
    assert job_uplink(parse_round_config(_job_text("{codec: int8}"))).block == 256
    codec = job_uplink(parse_round_config(_job_text("{codec: adacomp}")))
    assert (codec.bin_conv, codec.bin_dense) == (50, 500)


def test_stochastic_rounding_is_drawn_from_the_task_seed(kit, tmp_path):
    text = _job_text(CODECS["int8"])
    sent = []
    for run, seed in (("a", 7), ("b", 7), ("c", 8)):
        stub = Coordinator(text)
        _agent(kit, tmp_path / run).handle(stub, _task(text, 1, seed=seed))
        sent.append(b"".join(m.chunk.data for m in stub.updates[0][1:]))
    assert sent[0] == sent[1]   # a reproducible run sends the same bits
    assert sent[0] != sent[2]


def test_a_codec_none_job_sends_the_whole_model_exactly_as_before(kit, tmp_path):
    sent = []
    for run, text in (("plain", _job_text()), ("none", _job_text("{codec: none}"))):
        agent, stub = _agent(kit, tmp_path / run), Coordinator(text)
        agent.handle(stub, _task(text, 1))
        header, layout, _ = _sent(stub.updates[0])
        blob = b"".join(m.chunk.data for m in stub.updates[0][1:])
        trained_layout, trained_blob = encode(agent.trained)
        assert layout == trained_layout and blob == bytes(trained_blob)   # the trained model, as it stands
        sent.append((header.SerializeToString(), [m.SerializeToString() for m in stub.updates[0][1:]]))
        assert not (tmp_path / run / "residual").exists()
    assert sent[0] == sent[1]


def test_a_damaged_residual_fails_the_task_and_sends_nothing(kit, tmp_path):
    text = _job_text(CODECS["topk"])
    (tmp_path / "residual").mkdir()
    (tmp_path / "residual" / "squeeze.safetensors").write_bytes(b"torn")
    stub = Coordinator(text)
    _agent(kit, tmp_path).handle(stub, _task(text, 1))
    assert stub.updates == []
    [result] = stub.results
    assert result.status == fpb.RESULT_FAILED
    assert "residual/squeeze.safetensors in its state_dir" in result.reason and "delete the file" in result.reason
    assert (tmp_path / "residual" / "squeeze.safetensors").read_bytes() == b"torn"


def test_a_refused_update_does_not_advance_the_residual(kit, tmp_path):
    text = _job_text(CODECS["topk"])
    agent, stub = _agent(kit, tmp_path), Coordinator(text)
    path = tmp_path / "residual" / "squeeze.safetensors"
    stub.refuse = True
    agent.handle(stub, _task(text, 1))
    assert len(stub.updates) == 1 and not path.exists()   # sent, refused: still a zero residual
    stub.refuse = False
    agent.handle(stub, _task(text, 2))
    kept, inode = path.read_bytes(), path.stat().st_ino
    stub.refuse = True
    agent.handle(stub, _task(text, 3))
    assert len(stub.updates) == 3 and stub.results == []
    assert path.read_bytes() == kept and path.stat().st_ino == inode   # untouched: never replaced


# DP: the decoded update is bounded by clip_norm ------------------------------------------------------

DP = "privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: CLIP}}\n"


def _norm(arrays) -> float:
    return float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in arrays.values())))


@pytest.mark.parametrize("case", ["topk", "adacomp", "int8", "int4", "fp16"])
def test_under_dp_the_sent_vector_is_scaled_to_clip_norm_and_the_residual_keeps_the_rest(kit, tmp_path, case):
    clip = 0.05
    text = _job_text(CODECS[case], DP.replace("CLIP", str(clip)))
    job = parse_round_config(text)
    codec, model = job_uplink(job), _model_layout(text)
    state = JobState(tmp_path, "squeeze")
    old = None
    if codec.feedback:   # a large residual: G is far longer than clip_norm, so the sent vector must be scaled
        rng = np.random.default_rng(3)
        old = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in residual_layout(model).tensors}
        state.keep_residual(old)
    agent, stub = _agent(kit, tmp_path), Coordinator(text)
    agent.handle(stub, _task(text, 1))
    header, _, wire = _sent(stub.updates[0])
    assert header.num_samples == 1   # DP-FedAvg weighs sites equally
    sent = _f32(codec.decode(model, wire, round_=1), model)
    assert _norm(sent) <= clip
    if codec.feedback:
        assert _norm(sent) >= clip * (1 - 1e-4)   # scaled down to clip_norm, not below it
        served = stub.served()
        clipped, _ = clip_update({n: a.astype(np.float64) - served[n] for n, a in agent.trained.items()}, clip)
        new = state.residual(residual_layout(model))
        for n in sent:
            g = clipped[n].astype(np.float32) + old[n]
            assert np.array_equal(new[n], g - sent[n]), n


def test_encode_update_scales_every_codec_to_the_bound():
    layout = Layout.build([("w", "F32", (40, 5)), ("b", "F32", (5,))])
    rng = np.random.default_rng(0)
    delta = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in layout.tensors}
    residual = {t.name: 3 * rng.standard_normal(t.shape).astype(np.float32) for t in layout.tensors}
    for uplink in CODECS.values():
        codec = job_uplink(parse_round_config(_job_text(uplink)))
        coded = encode_update(codec, layout, delta, residual, round_=4, rng=rounding_rng(1), clip_norm=1.0)
        sent = _f32(codec.decode(layout, coded.wire, round_=4), layout)
        assert 1 - 1e-3 <= _norm(sent) <= 1.0, uplink
        if codec.feedback:
            for n in sent:
                assert np.array_equal(coded.residual[n], delta[n] + residual[n] - sent[n]), (uplink, n)
        else:
            assert coded.residual is None


# over real gRPC ---------------------------------------------------------------------------------------

class Refusing(RogueCoordinator):
    """A coordinator that refuses updates with INVALID_ARGUMENT while `refuse` is set."""

    refuse = False

    def SubmitUpdate(self, request_iterator, context):
        if not self.refuse:
            return super().SubmitUpdate(request_iterator, context)
        header = next(request_iterator).header
        for _ in request_iterator:
            pass
        self.outcomes.put(Outcome("refused", header.job_id, header.round))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "update refused by the test")


def test_over_grpc_a_refused_update_leaves_the_residual_file_untouched(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "refusing", hosts=["127.0.0.1"])
    pki.add_site(root, "a")
    rogue = Refusing(root / "coordinator")
    rogue.root = root
    text = _job_text(CODECS["adacomp"])
    path = tmp_path / "state" / "residual" / "squeeze.safetensors"
    try:
        with site_agents(rogue, tmp_path / "state") as start:
            start(PolicySpec(allowed_models=("mlp",)))
            assert rogue.ask("squeeze", text, round_=1).what == "update"
            # An evaluation task after each: the agent runs tasks in turn, so the training task has ended.
            assert rogue.ask("squeeze", text, round_=1, kind=fpb.TASK_EVALUATE).what == "RESULT_EVALUATED"
            kept, inode = path.read_bytes(), path.stat().st_ino
            rogue.refuse = True
            assert rogue.ask("squeeze", text, round_=2).what == "refused"
            assert rogue.ask("squeeze", text, round_=2, kind=fpb.TASK_EVALUATE).what == "RESULT_EVALUATED"
            assert path.read_bytes() == kept and path.stat().st_ino == inode
            rogue.refuse = False
            assert rogue.ask("squeeze", text, round_=3).what == "update"
            assert rogue.ask("squeeze", text, round_=3, kind=fpb.TASK_EVALUATE).what == "RESULT_EVALUATED"
            assert path.read_bytes() != kept   # accepted: advanced
    finally:
        rogue.close()
