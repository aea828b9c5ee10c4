"""The compressed downlink without gRPC: coordinator.downlink serves (through the servicer's own request parsing
and model stream), the site's fetch_model decodes and keeps its chain model under state_dir."""

from __future__ import annotations

import dataclasses
import hashlib
import stat

import numpy as np
import pytest

from coordinator.downlink import Downlink
from coordinator.service import held_model, model_stream
from plexus.config import DownlinkSpec
from plexus.errors import IntegrityError
from plexus.wire import Layout, encode
from site_agent.downlink import fetch_model
from site_agent.state import ServedChain

DELTA8 = DownlinkSpec(codec="delta8", block=16)
FP16 = DownlinkSpec(codec="fp16")


def models(rounds: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A model drifting round by round, with a non-float tensor that travels as it is."""
    rng = np.random.default_rng(seed)
    model = {"w": rng.normal(size=(5, 7)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32),
             "steps": np.array([0], np.int64)}
    out = [model]
    for r in range(1, rounds):
        model = {"w": (model["w"] + rng.normal(scale=0.05, size=(5, 7))).astype(np.float32),
                 "b": (model["b"] + rng.normal(scale=0.05, size=3)).astype(np.float32),
                 "steps": np.array([r], np.int64)}
        out.append(model)
    return out


LAYOUT = Layout.of(models(1)[0])


class Coordinator:
    """FetchModel as the servicer answers it: the request's held model, the driver's choice, the header and chunks.
    `tamper(served)` changes what is sent (a coordinator that is wrong about what the site holds)."""

    def __init__(self, downlink: Downlink, tamper=None):
        self.downlink, self.tamper = downlink, tamper
        self.round = downlink.round
        self.requests, self.sent = [], []

    def FetchModel(self, request, timeout):
        self.requests.append(request)
        served = self.downlink.served(held_model(request))
        if self.tamper is not None:
            served, self.tamper = self.tamper(served), None
        self.sent.append((served.encoding, served.layout.total_bytes))
        return iter(list(model_stream("job-1", self.round, served, 65536)))


def bits(state) -> bytes:
    return bytes(encode(state)[1])


def test_two_sites_one_skipping_a_round_end_with_the_same_chain_bits(tmp_path):
    downlink = Downlink(DELTA8)
    coordinator = Coordinator(downlink)
    a, b = ServedChain(tmp_path / "a", "job-1"), ServedChain(tmp_path / "b", "job-1")
    encodings = {"a": [], "b": []}
    for round_, model in enumerate(models(5)):
        downlink.advance(round_, model)
        coordinator.round = round_   # the header's round: the model round the task names
        for name, chain in (("a", a), ("b", b)):
            if name == "b" and round_ == 2:
                continue   # b misses round 2: it holds chain_1 when chain_3 is served
            got = fetch_model(coordinator, "task", LAYOUT, DELTA8, chain, timeout=5)
            encodings[name].append(coordinator.sent[-1][0])
            assert bits(got) == bits(downlink.base)   # what the site trains from is the coordinator's chain
            assert chain.load(LAYOUT).round == round_
        error = np.abs(downlink.base["w"] - model["w"]).max()
        assert round_ == 0 and error == 0 or 0 < error < 0.02   # quantised, and close to the exact model
        assert downlink.base["steps"].tolist() == [round_]      # non-float tensors exactly
    assert encodings == {"a": ["dense", "delta8", "delta8", "delta8", "delta8"],
                         "b": ["dense", "delta8", "dense", "delta8"]}
    assert bits(a.load(LAYOUT).state) == bits(b.load(LAYOUT).state) == bits(downlink.base)
    sent = dict(coordinator.sent)
    assert sent["dense"] == LAYOUT.total_bytes == 4 * 38 + 8
    assert sent["delta8"] == 38 + 8 + 4 * (3 + 1)   # I8 values, the I64 as it is, an F32 scale per 16 values


def test_a_coordinator_restart_begins_the_chain_again_at_the_exact_model(tmp_path):
    before, after = Downlink(DELTA8), Downlink(DELTA8)
    chain = ServedChain(tmp_path, "job-1")
    model = models(3)
    for round_ in (0, 1):
        before.advance(round_, model[round_])
        fetch_model(Coordinator(before), "task", LAYOUT, DELTA8, chain, timeout=5)
    assert bits(chain.load(LAYOUT).state) != bits(model[1])   # the site holds chain_1, not the model
    after.advance(1, model[1])                                 # taken up again from the checkpoint of round 1
    coordinator = Coordinator(after)
    fetch_model(coordinator, "task", LAYOUT, DELTA8, chain, timeout=5)
    assert coordinator.requests[0].have_round == 1 and coordinator.sent[0][0] == "dense"
    assert bits(chain.load(LAYOUT).state) == bits(after.base) == bits(model[1])
    after.advance(2, model[2])
    coordinator.round = 2
    fetch_model(coordinator, "task", LAYOUT, DELTA8, chain, timeout=5)
    assert coordinator.sent[1][0] == "delta8" and bits(chain.load(LAYOUT).state) == bits(after.base)


@pytest.mark.parametrize("tamper", [
    lambda served: dataclasses.replace(served, base_round=7),            # a delta against a round it lacks
    lambda served: dataclasses.replace(served, sha256=bytes(32)),        # a result the coordinator did not name
])
def test_a_delta_the_site_cannot_apply_is_fetched_again_in_full(tmp_path, tamper):
    downlink = Downlink(DELTA8)
    chain = ServedChain(tmp_path, "job-1")
    model = models(2)
    downlink.advance(0, model[0])
    fetch_model(Coordinator(downlink), "task", LAYOUT, DELTA8, chain, timeout=5)
    downlink.advance(1, model[1])
    coordinator = Coordinator(downlink, tamper)
    got = fetch_model(coordinator, "task", LAYOUT, DELTA8, chain, timeout=5)
    assert [e for e, _ in coordinator.sent] == ["delta8", "dense"]
    assert coordinator.requests[0].have_sha256 and not coordinator.requests[1].have_sha256   # in full
    assert bits(got) == bits(chain.load(LAYOUT).state) == bits(downlink.base)


def test_a_full_model_that_is_not_the_named_one_fails_the_fetch(tmp_path):
    downlink = Downlink(DELTA8)
    downlink.advance(0, models(1)[0])
    coordinator = Coordinator(downlink, lambda served: dataclasses.replace(served, sha256=bytes(32)))
    with pytest.raises(IntegrityError, match="SHA-256"):
        fetch_model(coordinator, "task", LAYOUT, DELTA8, ServedChain(tmp_path, "job-1"), timeout=5)


def test_a_damaged_or_foreign_chain_file_is_no_base(tmp_path):
    chain = ServedChain(tmp_path, "job-1")
    downlink = Downlink(DELTA8)
    downlink.advance(0, models(1)[0])
    fetch_model(Coordinator(downlink), "task", LAYOUT, DELTA8, chain, timeout=5)
    assert stat.S_IMODE(chain.path.stat().st_mode) == 0o600
    held = chain.load(LAYOUT)
    assert held.sha256 == hashlib.sha256(bits(downlink.base)).digest()
    assert chain.load(Layout.of({"w": np.zeros(3, np.float32)})) is None   # another model's layout
    chain.path.write_bytes(b"\x08" + bytes(20))
    assert chain.load(LAYOUT) is None
    coordinator = Coordinator(downlink)
    fetch_model(coordinator, "task", LAYOUT, DELTA8, chain, timeout=5)
    assert not coordinator.requests[0].have_sha256 and chain.load(LAYOUT).round == 0


def test_fp16_serves_half_the_bytes_and_the_site_decodes_float32(tmp_path):
    downlink = Downlink(FP16)
    model = models(1)[0]
    downlink.advance(0, model)
    coordinator = Coordinator(downlink)
    got = fetch_model(coordinator, "task", LAYOUT, FP16, None, timeout=5)
    assert coordinator.sent == [("fp16", 2 * 38 + 8)]
    assert got["w"].dtype == np.float32 and bits(got) == bits(downlink.base)
    assert np.array_equal(got["w"], model["w"].astype(np.float16).astype(np.float32))
    assert not coordinator.requests[0].have_sha256   # fp16 keeps nothing at the site


def test_an_encoding_the_job_did_not_ask_for_is_refused(tmp_path):
    downlink = Downlink(FP16)
    downlink.advance(0, models(1)[0])
    with pytest.raises(IntegrityError, match="compression.downlink is 'delta8'"):
        fetch_model(Coordinator(downlink), "task", LAYOUT, DELTA8, ServedChain(tmp_path, "job-1"), timeout=5)


DELTA4 = DownlinkSpec(codec="delta4", block=16)


def test_delta4_serves_the_chain_as_delta8_does_at_half_its_value_bytes(tmp_path):
    """The served chain is the delta codec's, whichever it is: two sites, one missing a round, hold the
    coordinator's chain bit for bit; a delta carries ceil(N/2) bytes of steps per float tensor."""
    downlink = Downlink(DELTA4)
    coordinator = Coordinator(downlink)
    a, b = ServedChain(tmp_path / "a", "job-1"), ServedChain(tmp_path / "b", "job-1")
    encodings = {"a": [], "b": []}
    for round_, model in enumerate(models(5)):
        downlink.advance(round_, model)
        coordinator.round = round_
        for name, chain in (("a", a), ("b", b)):
            if name == "b" and round_ == 2:
                continue
            got = fetch_model(coordinator, "task", LAYOUT, DELTA4, chain, timeout=5)
            encodings[name].append(coordinator.sent[-1][0])
            assert bits(got) == bits(downlink.base) == bits(chain.load(LAYOUT).state)
        error = np.abs(downlink.base["w"] - model["w"]).max()
        assert round_ == 0 and error == 0 or 0 < error < 0.1   # 4-bit steps: coarser than delta8's, still close
    assert encodings == {"a": ["dense", "delta4", "delta4", "delta4", "delta4"],
                         "b": ["dense", "delta4", "dense", "delta4"]}
    # w: 35 values in 18 bytes, b: 3 in 2, the I64 as it is, an F32 scale per 16 values (3 + 1)
    assert dict(coordinator.sent)["delta4"] == 18 + 2 + 8 + 4 * (3 + 1)


def test_a_delta_of_the_other_delta_codec_is_refused(tmp_path):
    downlink = Downlink(DELTA8)
    chain = ServedChain(tmp_path, "job-1")
    downlink.advance(0, models(1)[0])
    fetch_model(Coordinator(downlink), "task", LAYOUT, DELTA8, chain, timeout=5)   # chain_0, in full
    downlink.advance(1, models(2)[1])
    with pytest.raises(IntegrityError, match=r"sent the model as 'delta8', but this job's compression.downlink is "
                                             r"'delta4' \(served as dense, delta4\)"):
        fetch_model(Coordinator(downlink), "task", LAYOUT, DELTA4, chain, timeout=5)
