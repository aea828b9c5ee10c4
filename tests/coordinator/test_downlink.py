"""SyncRounds under compression.downlink: checkpoints keep the exact model, sites fetch the encoded one, `job.base`
is what they decode, and the delta8 chain begins from zeros, again when a job is taken up again."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from driver_rig import DriverRig, rigs

from coordinator.drivers.sync import SyncRounds
from coordinator.served import Held
from coordinator.tasks import Binding, UpdateHeader
from plexus.compression import downlink_decode, downlink_encode, zero_base
from plexus.config import DownlinkSpec
from plexus.wire import Layout, encode

JOB = """\
name: job
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: 3
sites: {{min: 2, deadline_s: 60}}
strategy: {{name: fedavg}}
seed: 0
{compression}"""


class Rig(DriverRig):
    driver_class = SyncRounds

    def __init__(self, path, *, compression: str = ""):
        super().__init__(path, JOB.format(compression=compression))
        self.fp16_uplink = "uplink: {codec: fp16}" in compression

    def header(self, grant, values, num_samples: int, **fields):
        """With uplink fp16 the sites send Δ = trained − base as F16 (`values` is that Δ)."""
        if not self.fp16_uplink:
            return super().header(grant, values, num_samples, **fields)
        layout, blob = encode({"w/fp16.values": np.asarray(values, np.float16)})
        return UpdateHeader(task=Binding(grant.task_id, grant.job_id, grant.round, grant.nonce),
                            num_samples=num_samples, layout=layout, **fields), blob

    def round(self, *values) -> None:
        """One round: sites a and b send `values` (the model "w" each trained), equally weighted."""
        self.join("a", "b")
        self.driver.tick(self.now)
        for site, value in zip("ab", values):
            self.send(site, self.driver.grant(site), value, num_samples=100)
        self.driver.tick(self.now)

    def model(self, round_: int) -> np.ndarray:
        return self.store.load_checkpoint(self.job_id, round_)["w"]


@pytest.fixture
def rig(tmp_path):
    yield from rigs(tmp_path, Rig)


def sha(array) -> bytes:
    return hashlib.sha256(bytes(encode({"w": array})[1])).digest()


A, B = [0.1, -0.2, 0.3, 0.004], [0.3, 0.2, -0.1, 0.001]


def test_delta8_checkpoints_the_exact_model_and_serves_the_chain(rig):
    r = rig(compression="compression: {downlink: {codec: delta8, block: 16}}")
    job = r.driver.job
    # The vector model starts at zeros: chain_0 = Q8(0 - 0) = 0, as 4 I8 and one F32 scale.
    start = job.fetched(None, zero_base=True)
    assert job.in_memory and job.base["w"].tolist() == [0, 0, 0, 0] and start.layout.total_bytes == 4 + 4
    assert (start.encoding, start.zero_base, start.base_round, start.sha256) == ("delta8", True, 0, sha(job.base["w"]))
    assert job.fetched(Held(0, bytes(32)), zero_base=True) is start   # whatever the site holds
    older = job.fetched(Held(0, bytes(32)))    # an agent that cannot decode it: chain_0 in full, the same bits
    assert (older.encoding, older.zero_base, older.sha256) == ("dense", False, start.sha256)
    r.round(A, B)
    exact = (np.float32(A) + np.float32(B)) / 2
    assert np.allclose(r.model(1), exact, atol=1e-7) and np.array_equal(job.state["w"], r.model(1))
    chain_1 = job.base["w"].copy()
    assert not np.array_equal(chain_1, r.model(1))          # the sites start from the quantised chain
    assert np.abs(chain_1 - r.model(1)).max() <= np.abs(r.model(1)).max() / 254 + 1e-9
    delta = job.fetched(Held(0, sha(np.zeros(4, np.float32))))
    assert (delta.encoding, delta.base_round, delta.sha256) == ("delta8", 0, sha(chain_1))
    assert delta.layout.total_bytes == 4 + 4                  # 4 I8 values + one F32 scale
    assert not delta.zero_base
    for stale in (None, Held(0, bytes(32)), Held(1, sha(chain_1))):   # nothing, a damaged copy, chain_1 itself
        full = job.fetched(stale)
        assert full.encoding == "dense" and bytes(full.blob) == bytes(encode({"w": chain_1})[1])
    r.round(A, A)
    following = job.fetched(Held(1, sha(chain_1)))
    assert (following.encoding, following.base_round) == ("delta8", 1)

    taken_up = r.take_up().job                                # a coordinator restart: the chain begins again
    spec, layout = DownlinkSpec(codec="delta8", block=16), Layout.of({"w": r.model(2)})
    wire = downlink_encode(spec, {"w": r.model(2)}, zero_base(layout))
    assert np.array_equal(taken_up.base["w"], downlink_decode(spec, layout, wire, zero_base(layout))["w"])
    assert not np.array_equal(taken_up.base["w"], r.model(2))
    again = taken_up.fetched(Held(1, sha(chain_1)), zero_base=True)
    assert (again.encoding, again.zero_base, again.sha256) == ("delta8", True, sha(taken_up.base["w"]))


def test_fp16_serves_half_the_bytes_and_base_is_what_sites_decode(rig):
    r = rig(compression="compression: {downlink: {codec: fp16}}")
    r.round(A, B)
    job = r.driver.job
    served = job.fetched(None)
    assert served.encoding == "fp16" and served.layout.total_bytes == 2 * 4
    assert np.array_equal(job.base["w"], r.model(1).astype(np.float16).astype(np.float32))
    assert job.base["w"].dtype == np.float32 and not np.array_equal(job.base["w"], r.model(1))


@pytest.mark.parametrize("compression", ["", "compression: {downlink: {codec: none}}"])
def test_a_plain_downlink_is_served_from_the_checkpoint_file_as_before(rig, compression):
    r = rig(compression=compression)
    r.round(A, B)
    job = r.driver.job
    assert job.downlink is None and not job.in_memory and job.base is job.state
    served = job.fetched(Held(0, bytes(32)))
    assert served.path == r.store.checkpoint_path(r.job_id, 1) and served.encoding == "dense" and not served.sha256


def test_a_model_fp16_cannot_carry_fails_its_round_before_anything_is_stored(rig):
    r = rig(compression="compression: {downlink: {codec: fp16}}")
    r.round([1e5, 0, 0, 0], [1e5, 0, 0, 0])
    row = r.store.job(r.job_id)
    assert row.status == "failed" and row.current_round == 0 and "beyond float16's range" in row.message
    assert not r.store.checkpoint_path(r.job_id, 1).exists()


def test_with_a_compressed_uplink_the_new_model_is_the_served_chain_plus_the_mean_delta(rig):
    r = rig(compression="compression: {uplink: {codec: fp16}, downlink: {codec: delta8, block: 16}}")
    job = r.driver.job
    half = np.float16
    r.round(A, B)   # Δs from the chain's start, Q8(0 - 0): the exact initial model, zeros
    assert np.allclose(r.model(1), (np.float32(half(A)) + np.float32(half(B))) / 2, rtol=0, atol=1e-8)
    chain_1 = job.base["w"].copy()
    r.round(A, A)   # Δs from chain_1, which the sites decoded: not from the exact model of round 1
    assert np.allclose(r.model(2), chain_1 + np.float32(half(A)), rtol=0, atol=1e-8)
    assert not np.allclose(r.model(2), r.model(1) + np.float32(half(A)), rtol=0, atol=1e-6)


def test_delta4_serves_its_chain_as_delta8_does(rig):
    r = rig(compression="compression: {downlink: {codec: delta4, block: 16}}")
    job = r.driver.job
    start = job.fetched(None, zero_base=True)
    assert (start.encoding, start.zero_base, start.layout.total_bytes) == ("delta4", True, 2 + 4)
    assert job.fetched(None).encoding == "dense"   # an agent that does not ask for the start from zeros
    r.round(A, B)
    chain_1 = job.base["w"].copy()
    exact = r.model(1)
    assert not np.array_equal(chain_1, exact) and np.abs(chain_1 - exact).max() <= np.abs(exact).max() / 14 + 1e-9
    delta = job.fetched(Held(0, sha(np.zeros(4, np.float32))))
    assert (delta.encoding, delta.base_round, delta.sha256) == ("delta4", 0, sha(chain_1))
    assert delta.layout.total_bytes == 2 + 4                  # 4 values in 2 bytes + one F32 scale
    assert job.fetched(Held(1, sha(chain_1))).encoding == "dense"
    r.round(A, A)
    assert job.fetched(Held(1, sha(chain_1))).encoding == "delta4"
