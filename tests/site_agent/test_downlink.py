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
    `tamper(served)` changes what is sent (a coordinator that is wrong about what the site holds); `older_agent`
    drops the request's zero_base, as an agent from before it sends none."""

    def __init__(self, downlink: Downlink, tamper=None, *, older_agent: bool = False):
        self.downlink, self.tamper, self.older_agent = downlink, tamper, older_agent
        self.round = downlink.round
        self.requests, self.sent = [], []

    def FetchModel(self, request, timeout):
        self.requests.append(request)
        zero_base = request.zero_base and not self.older_agent
        served = self.downlink.served(held_model(request), zero_base=zero_base)
        if self.tamper is not None:
            served, self.tamper = self.tamper(served), None
        self.sent.append((served.encoding + " from zeros" * served.zero_base, served.layout.total_bytes))
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
        assert 0 < error < 0.02   # quantised from round 0 on (chain_0 is the delta from zeros), close to the model
        assert downlink.base["steps"].tolist() == [round_]      # non-float tensors exactly
    # Every site's first fetch is the compact delta from zeros; b, back after a missed round, gets chain_3 in full.
    assert encodings == {"a": ["delta8 from zeros", "delta8", "delta8", "delta8", "delta8"],
                         "b": ["delta8 from zeros", "delta8", "dense", "delta8"]}
    assert bits(a.load(LAYOUT).state) == bits(b.load(LAYOUT).state) == bits(downlink.base)
    sent = dict(coordinator.sent)
    assert sent["dense"] == LAYOUT.total_bytes == 4 * 38 + 8
    # I8 values, the I64 as it is, an F32 scale per 16 values: from zeros as from chain_{r-1}
    assert sent["delta8 from zeros"] == sent["delta8"] == 38 + 8 + 4 * (3 + 1)


def test_the_first_fetch_is_the_delta_from_zeros_at_a_quarter_of_float32_and_the_site_names_its_bits(tmp_path):
    rng = np.random.default_rng(1)
    model = {"w": rng.normal(size=(1000, 1000)).astype(np.float32), "b": rng.normal(size=10).astype(np.float32)}
    layout, spec = Layout.of(model), DownlinkSpec(codec="delta8")   # block 256
    downlink = Downlink(spec)
    downlink.advance(0, model)
    coordinator = Coordinator(downlink)
    chain = ServedChain(tmp_path, "job-1")
    got = fetch_model(coordinator, "task", layout, spec, chain, timeout=5)
    (encoding, sent), = coordinator.sent
    assert encoding == "delta8 from zeros" and not coordinator.requests[0].have_sha256
    assert sent == 10**6 + 10 + 4 * (3907 + 1) and sent / layout.total_bytes < 0.255   # I8 + an F32 per 256
    chain_0 = hashlib.sha256(bits(downlink.base)).digest()
    assert hashlib.sha256(bits(got)).digest() == chain_0 == chain.load(layout).sha256   # the same bits both ends
    assert not np.array_equal(got["w"], model["w"])                                      # chain_0, not the model
    downlink.advance(1, {k: v + np.float32(0.01) for k, v in model.items()})
    coordinator.round = 1
    fetch_model(coordinator, "task", layout, spec, chain, timeout=5)
    assert (coordinator.requests[1].have_round, coordinator.requests[1].have_sha256) == (0, chain_0)
    assert coordinator.sent[1] == ("delta8", sent)


@pytest.mark.parametrize(("tamper", "message"), [
    (lambda served: dataclasses.replace(served, zero_base=True), "as dense and from a zero base"),
    (lambda served: dataclasses.replace(served, base_round=1), "as a delta against round 1 and from a zero base"),
])
def test_a_zero_base_header_that_is_not_a_plain_delta_is_refused(tmp_path, tamper, message):
    downlink = Downlink(DELTA8)
    for round_, model in enumerate(models(2 if "dense" in message else 1)):
        downlink.advance(round_, model)   # a site that holds nothing: round 1 in full, round 0 from zeros
    with pytest.raises(IntegrityError, match=message + "; only a delta may start from zeros"):
        fetch_model(Coordinator(downlink, tamper), "task", LAYOUT, DELTA8, ServedChain(tmp_path, "job-1"), timeout=5)


def test_fp16_from_a_zero_base_is_refused(tmp_path):
    downlink = Downlink(FP16)
    downlink.advance(0, models(1)[0])
    coordinator = Coordinator(downlink, lambda served: dataclasses.replace(served, zero_base=True))
    with pytest.raises(IntegrityError, match="as fp16 and from a zero base"):
        fetch_model(coordinator, "task", LAYOUT, FP16, None, timeout=5)


def test_an_agent_that_does_not_ask_for_zero_base_gets_chain_0_in_full_with_the_same_bits(tmp_path):
    downlink = Downlink(DELTA8)
    model = models(2)
    downlink.advance(0, model[0])
    new, old = Coordinator(downlink), Coordinator(downlink, older_agent=True)
    a, b = ServedChain(tmp_path / "a", "job-1"), ServedChain(tmp_path / "b", "job-1")
    fetch_model(new, "task", LAYOUT, DELTA8, a, timeout=5)
    fetch_model(old, "task", LAYOUT, DELTA8, b, timeout=5)
    assert new.requests[0].zero_base and [e for e, _ in new.sent + old.sent] == ["delta8 from zeros", "dense"]
    assert bits(a.load(LAYOUT).state) == bits(b.load(LAYOUT).state) == bits(downlink.base)
    downlink.advance(1, model[1])
    new.round = old.round = 1
    for coordinator, chain in ((new, a), (old, b)):
        fetch_model(coordinator, "task", LAYOUT, DELTA8, chain, timeout=5)
        assert coordinator.sent[-1][0] == "delta8" and bits(chain.load(LAYOUT).state) == bits(downlink.base)


def test_a_coordinator_restart_begins_the_chain_again_from_zeros(tmp_path):
    before, after = Downlink(DELTA8), Downlink(DELTA8)
    chain = ServedChain(tmp_path, "job-1")
    model = models(3)
    for round_ in (0, 1):
        before.advance(round_, model[round_])
        fetch_model(Coordinator(before), "task", LAYOUT, DELTA8, chain, timeout=5)
    held = chain.load(LAYOUT)
    assert bits(held.state) != bits(model[1])               # the site holds chain_1, not the model
    after.advance(1, model[1])                              # taken up again from the checkpoint of round 1
    assert bits(after.base) not in (bits(model[1]), bits(held.state))   # Q8(model_1 - 0): a chain of its own
    coordinator = Coordinator(after)
    fetch_model(coordinator, "task", LAYOUT, DELTA8, chain, timeout=5)
    # The old chain_1 is no base for the new chain: the site gets its start, compact, and holds its bits.
    assert coordinator.requests[0].have_sha256 == held.sha256 and coordinator.sent[0][0] == "delta8 from zeros"
    assert bits(chain.load(LAYOUT).state) == bits(after.base)
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


@pytest.mark.parametrize("rounds", [1, 2])   # the chain's start from zeros; chain_1 in full to a new site
def test_a_model_that_is_not_the_named_one_fails_the_fetch_of_a_site_that_holds_none(tmp_path, rounds):
    downlink = Downlink(DELTA8)
    for round_, model in enumerate(models(rounds)):
        downlink.advance(round_, model)
    coordinator = Coordinator(downlink, lambda served: dataclasses.replace(served, sha256=bytes(32)))
    with pytest.raises(IntegrityError, match="SHA-256"):
        fetch_model(coordinator, "task", LAYOUT, DELTA8, ServedChain(tmp_path, "job-1"), timeout=5)
    assert [e for e, _ in coordinator.sent] == [["delta8 from zeros", "dense"][rounds - 1]]   # not fetched again


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
        # 4-bit steps: coarser than delta8's (chain_0 within max|w|/14 of the model), then close
        assert 0 < error <= (np.abs(model["w"]).max() / 14 + 1e-6 if round_ == 0 else 0.1)
    assert encodings == {"a": ["delta4 from zeros", "delta4", "delta4", "delta4", "delta4"],
                         "b": ["delta4 from zeros", "delta4", "dense", "delta4"]}
    # w: 35 values in 18 bytes, b: 3 in 2, the I64 as it is, an F32 scale per 16 values (3 + 1); from zeros too
    sent = dict(coordinator.sent)
    assert sent["delta4 from zeros"] == sent["delta4"] == 18 + 2 + 8 + 4 * (3 + 1)


def test_a_delta_of_the_other_delta_codec_is_refused(tmp_path):
    downlink = Downlink(DELTA8)
    chain = ServedChain(tmp_path, "job-1")
    downlink.advance(0, models(1)[0])
    fetch_model(Coordinator(downlink), "task", LAYOUT, DELTA8, chain, timeout=5)   # chain_0, from zeros
    downlink.advance(1, models(2)[1])
    with pytest.raises(IntegrityError, match=r"sent the model as 'delta8', but this job's compression.downlink is "
                                             r"'delta4' \(served as dense, delta4\)"):
        fetch_model(Coordinator(downlink), "task", LAYOUT, DELTA4, chain, timeout=5)
