"""bench.compression's in-process loop: `none` is bench.strategies' FedAvg bit for bit; the compressed path (Δ
encoded at the site, streamed through the codec's Decoder, folded exactly, added to the current model) gives
the same model as `none` for a lossless stand-in codec, dense or sparse; and, once plexus.compression exists,
every codec of the benchmark runs a round and sends fewer bytes than `none`."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench import compression, strategies
from plexus.config import parse_round_config
from plexus.wire import DTYPES

ROUNDS = 2


@pytest.fixture(scope="module")
def heart():
    """The heart hospitals with the benchmark's MLP; 2 rounds."""
    torch.set_num_threads(1)
    return dataclasses.replace(compression.task_for("heart", False), rounds=ROUNDS)


def heart_job(task, block: dict | None = None):
    train = {"epochs": task.epochs, "batch_size": task.batch_size, "optimizer": task.optimizer}
    text = strategies.JOB.format(strategy="fedavg", model=json.dumps(task.model), dataset=task.name, rounds=ROUNDS,
                                 args="{}", train=json.dumps(train), seed=0)
    return parse_round_config(text + (f"compression: {json.dumps(block)}\n" if block else ""))


def test_none_is_bench_strategies_fedavg_bit_for_bit(heart, tmp_path):
    job = heart_job(heart)
    ours, stats = compression.simulate(heart, job, "job-a", tmp_path / "a")
    theirs = strategies.simulate(heart, job, "job-a", tmp_path / "b")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert np.array_equal(ours[name], theirs[name]), name
    model = sum(a.nbytes for a in ours.values())
    assert stats == [{"up": 4 * model, "down": 4 * model}] * ROUNDS   # 4 hospitals, the whole model each way


class Lossless:
    """A stand-in for a plexus.compression uplink codec with the spec's interface: sends Δ as it is, and its
    Decoder yields DensePieces (one per 7 elements, across chunk edges) or one SparsePiece per tensor."""

    def __init__(self, sparse: bool):
        self.sparse = sparse

    def encode(self, delta, *, round_, residual, rng):
        assert residual is None or residual == {}
        return {f"{n}/lossless.values": np.ascontiguousarray(d, np.float32).ravel() for n, d in delta.items()}, {}

    def check_layout(self, model, wire, *, round_):
        assert [t.name for t in wire.tensors] == [f"{t.name}/lossless.values" for t in model.tensors]

    def decoder(self, model, wire, *, round_):
        return Decoder(model, self.sparse)


class Decoder:
    def __init__(self, model, sparse):
        self.sizes = [t.numel for t in model.tensors]
        self.sparse = sparse
        self.buf = bytearray()
        self.tensor = self.start = 0

    def feed(self, data):
        self.buf += data
        while self.tensor < len(self.sizes):
            n = self.sizes[self.tensor]
            if self.sparse:
                if len(self.buf) < 4 * n:
                    return
                values = np.frombuffer(self.buf[:4 * n], DTYPES["F32"]).astype(np.float64)
                yield SimpleNamespace(tensor=self.tensor, indices=np.arange(n), values=values)
                del self.buf[:4 * n]
                self.tensor += 1
                continue
            take = min(7, n - self.start, len(self.buf) // 4)
            if take == 0:
                return
            values = np.frombuffer(self.buf[:4 * take], DTYPES["F32"]).astype(np.float64)
            yield SimpleNamespace(tensor=self.tensor, start=self.start, values=values)
            del self.buf[:4 * take]
            self.start += take
            if self.start == n:
                self.tensor, self.start = self.tensor + 1, 0

    def finish(self):
        assert self.tensor == len(self.sizes) and not self.buf


class WithCompression:
    """The job as RoundConfig will carry it once issue #15 lands: every field, plus `compression`."""

    def __init__(self, job, compression):
        self._job, self.compression = job, compression

    def __getattr__(self, name):
        return getattr(self._job, name)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-pieces", "sparse-pieces"])
def test_the_compressed_path_with_a_lossless_codec_lands_on_nones_model(heart, tmp_path, monkeypatch, sparse):
    fake = SimpleNamespace(uplink_codec=lambda spec, *, seed: Lossless(sparse))
    monkeypatch.setattr(compression, "codecs", lambda: fake)
    job = heart_job(heart)
    spec = SimpleNamespace(uplink=SimpleNamespace(codec="lossless"), downlink=SimpleNamespace(codec="none"))
    got, stats = compression.simulate(heart, WithCompression(job, spec), "job-a", tmp_path / "a")
    want, _ = compression.simulate(heart, job, "job-a", tmp_path / "b")
    for name in want:   # the same training; only the fixed-point fold of Δ instead of the model rounds differently
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6)
    model = sum(a.nbytes for a in want.values())
    assert stats == [{"up": 4 * model, "down": 4 * model}] * ROUNDS


def test_the_cases_make_the_round_configs_the_spec_describes():
    assert compression.compression_block("none") is None and compression.compression_block("sa:none") is None
    assert compression.compression_block("topk") == {"uplink": {"codec": "topk", "fraction": 0.01}}
    assert compression.compression_block("sa:randk", 0.1) == {"uplink": {"codec": "randk", "fraction": 0.1}}
    assert compression.compression_block("int8/delta8") == {"uplink": {"codec": "int8", "block": 256},
                                                            "downlink": {"codec": "delta8", "block": 256}}
    with pytest.raises(ValueError):
        compression.compression_block("zip")
    fed = compression.federation("heart", 3)
    job = parse_round_config(compression.job_yaml(fed, "sa:none", rounds=2))
    assert job.privacy.secure_aggregation and job.sites.min == 3 and job.model.name == "mlp"
    assert compression.model_bytes(compression.federation("heart-wide").model) >= 40_000_000   # >= 10M float32


needs_compression = pytest.mark.skipif(compression.compression_available() is not None,
                                       reason=str(compression.compression_available()))


@needs_compression
@pytest.mark.parametrize("case", [c for c in compression.CODECS if c != "none"] + ["int8/delta8", "none/fp16"])
def test_every_codec_runs_a_round_and_sends_less_than_none(heart, tmp_path, case):
    job = dataclasses.replace(heart_job(heart, compression.compression_block(case)), rounds=1)
    _, [stats] = compression.simulate(heart, job, "job-c", tmp_path)
    whole = 4 * compression.model_bytes(heart.model)   # none: each of the 4 hospitals moves the model each way
    up, _, down = case.partition("/")
    if up in ("fp16", "int8", "topk", "randk"):        # smaller by construction; adacomp's size depends on Δ
        assert 0 < stats["up"] < whole
    if down not in ("", "none"):
        assert 0 < stats["down"] < whole
    for variant in (case, f"sa:{case}") if up in compression.SECURE_CODECS else (case,):
        parse_round_config(compression.job_yaml(compression.federation("heart", 4), variant, rounds=2))
