"""Compressed updates at the coordinator: each codec's Δ folded exactly as it streams (never densified), taken
out again exactly, and a synchronous round over them makes base + Σ w·Δ / Σ w; malformed ones are refused and
the round goes on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from driver_rig import DriverRig, rigs

from coordinator.aggregate import CodedFold, WeightedSum
from coordinator.drivers.sync import SyncRounds
from coordinator.intake import read_blocks
from coordinator.tasks import Binding, UpdateHeader
from plexus.compression import uplink_codec
from plexus.errors import IntegrityError
from plexus.wire import DTYPES, Layout, encode, iter_chunks

from sparse_wire import gap_wire


@dataclass(frozen=True)
class Spec:   # the attributes of plexus.config.UplinkSpec
    codec: str
    block: int | None = None
    fraction: float | None = None
    k: int | None = None
    error_feedback: bool | None = None
    bin_conv: int | None = None
    bin_dense: int | None = None


SPECS = {"fp16": Spec("fp16"), "int8": Spec("int8", block=32), "int4": Spec("int4", block=32),
         "topk": Spec("topk", fraction=0.1), "adacomp": Spec("adacomp", bin_dense=16), "randk": Spec("randk", k=20)}
# c.odd: an odd element count (int4's last byte holds one value) whose last block is short.
MODEL = {"a.weight": np.zeros((10, 20), np.float32), "b.bias": np.zeros(50, np.float32),
         "c.odd": np.zeros((3, 7), np.float32)}
MODEL_LAYOUT = Layout.of(MODEL)


def delta(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, 0.05, a.shape).astype(np.float32) for name, a in MODEL.items()}


def wire(codec, d, *, round_=1, seed=7):
    tensors, _ = codec.encode(d, round_=round_, residual=None, rng=np.random.default_rng(seed))
    return encode(tensors)


def coded_fold(total, codec, layout, blob, weight, *, split):
    fold = CodedFold(total, weight, lambda: codec.decoder(MODEL_LAYOUT, layout, round_=1))
    for _, piece in iter_chunks(blob, split):
        fold.add(piece)
    fold.finish()
    return fold


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_streamed_fold_of_each_codec_equals_the_dense_fold_of_its_decoded_update_bit_for_bit(name):
    codec = uplink_codec(SPECS[name], seed=3)
    streamed, dense = WeightedSum(MODEL_LAYOUT, sites=2), WeightedSum(MODEL_LAYOUT, sites=2)
    for site, (weight, split) in enumerate([(30, 7), (170, 1)]):   # chunk edges anywhere, even 1 byte apart
        layout, blob = wire(codec, delta(site))
        coded_fold(streamed, codec, layout, blob, weight, split=split)
        decoded = codec.decode(MODEL_LAYOUT, {k: np.asarray(v) for k, v in _views(layout, blob).items()}, round_=1)
        _, plain = encode({k: np.asarray(v, np.float32) for k, v in decoded.items()})
        dense.fold([plain], weight, max(float(np.abs(v).max()) for v in decoded.values()), nbytes=len(plain))
    assert np.array_equal(streamed.acc, dense.acc)
    assert streamed.total_weight == dense.total_weight == 200 and streamed.count == dense.count == 2
    for k, v in dense.sums().items():
        assert np.array_equal(streamed.sums()[k], v)


@pytest.mark.parametrize("ones", [0, 2000])
def test_u8_and_u16_gaps_of_the_same_entries_fold_to_the_same_sum_bit_for_bit(ones):
    """The site's choice of gaps dtype changes bytes only: what the coordinator folds (and so the model it
    makes) is the same bit for bit, fillers and all. Gaps of 255, 256, 510, 65535 and 65536, the first index
    past 255; with 2000 neighbouring entries the site picks U8 gaps, without them U16."""
    chosen = np.cumsum([300, 255, 256, 510, 65535, 65536] + [1] * ones) - 1
    model = Layout.build([("w", "F32", (int(chosen[-1]) + 8,))])
    g = np.zeros(model.tensors[0].numel, np.float32)
    g[chosen] = np.random.default_rng(ones).normal(0, 0.05, chosen.size)
    codec = uplink_codec(Spec("topk", k=chosen.size), seed=0)
    site, _ = codec.encode({"w": g}, round_=1, residual=None, rng=np.random.default_rng(7))
    assert site["w/topk.gaps"].dtype == DTYPES["U8" if ones else "U16"]
    sent = np.cumsum(site["w/topk.gaps"], dtype=np.int64) - 1
    q = site["w/topk.values"][np.isin(sent, chosen)]   # the chosen entries' values, fillers left out
    sums = []
    for tensors in (site, gap_wire("topk", chosen, q, scale=site["w/topk.scale"][0], dtype="U8"),
                    gap_wire("topk", chosen, q, scale=site["w/topk.scale"][0], dtype="U16")):
        layout, blob = encode(tensors)
        total = WeightedSum(model, sites=1)
        fold = CodedFold(total, 3, lambda lay=layout: codec.decoder(model, lay, round_=1))
        for _, piece in iter_chunks(blob, 5):
            fold.add(piece)
        fold.finish()
        sums.append(total.acc.copy())
    assert np.array_equal(sums[0], sums[1]) and np.array_equal(sums[0], sums[2])
    assert np.count_nonzero(sums[0]) == np.count_nonzero(q) > 0


def _views(layout, blob):
    from plexus.wire import decode
    return decode(layout, blob)


@pytest.mark.parametrize("name", ["topk", "int8", "int4"])
def test_a_coded_update_taken_out_part_way_or_whole_leaves_the_sum_exactly_as_it_was(name, tmp_path):
    codec = uplink_codec(SPECS[name], seed=3)
    total = WeightedSum(MODEL_LAYOUT, sites=3)
    layout, blob = wire(codec, delta(0))
    coded_fold(total, codec, layout, blob, 10, split=64)
    before = total.acc.copy()
    journal = tmp_path / "journal"
    for cut in (len(blob) // 3, len(blob)):   # part-way, then whole (finished) before being taken out
        layout2, blob2 = wire(codec, delta(1))
        cut = min(cut, len(blob2))
        journal.write_bytes(bytes(blob2[:cut]))
        fold = CodedFold(total, 25, lambda lay=layout2: codec.decoder(MODEL_LAYOUT, lay, round_=1))
        for _, piece in iter_chunks(blob2[:cut], 50):
            fold.add(piece)
        if cut == len(blob2):
            fold.finish()
        fold.undo(lambda: read_blocks(journal))
        assert np.array_equal(total.acc, before) and total.count == 1 and total.total_weight == 10


JOB = """\
name: job
model: {{name: vector, args: {{size: 4}}}}
data: {{dataset: heart-disease}}
rounds: 1
sites: {{min: {min_sites}, deadline_s: 60}}
strategy: {{name: fedavg}}
compression: {{uplink: {{codec: topk, k: 2}}}}
seed: 0
"""


class Rig(DriverRig):
    driver_class = SyncRounds

    def __init__(self, path, min_sites=2):
        super().__init__(path, JOB.format(min_sites=min_sites), model={"w": np.array([1, 1, 1, 1], np.float32)})
        self.codec = uplink_codec(Spec("topk", k=2), seed=0)

    def send_wire(self, site, grant, tensors: dict, *, num_samples=100):
        layout, blob = encode(tensors)
        header = UpdateHeader(task=Binding(grant.task_id, grant.job_id, grant.round, grant.nonce),
                              num_samples=num_samples, layout=layout)
        return self.stream(site, grant, header, blob)

    def outcome(self, site: str) -> tuple[str, str]:
        return next((status, reason) for s, status, r, reason in self.store.site_events(self.job_id) if s == site)


@pytest.fixture
def rig(tmp_path):
    yield from rigs(tmp_path, Rig)


def topk(gaps, values, scale=1.0, dtype="U16"):
    """A topk wire of w: index j is the sum of gaps[:j + 1] minus 1; value j is values[j]·scale."""
    return {"w/topk.gaps": np.array(gaps, DTYPES[dtype]), "w/topk.scale": np.array([scale], np.float32),
            "w/topk.values": np.array(values, np.int8)}


@pytest.mark.parametrize(("a", "b"), [("U16", "U16"), ("U8", "U8"), ("U8", "U16")])
def test_a_round_of_compressed_updates_makes_the_base_plus_the_weighted_mean_delta(rig, a, b):
    """Whichever gaps dtype each site chose."""
    r = rig()
    r.join("a", "b")
    r.driver.tick(r.now)
    grants = {s: r.driver.grant(s) for s in ("a", "b")}
    assert "accepted" in r.send_wire("a", grants["a"], topk([1, 3], [8, -4], 0.5, a), num_samples=100)   # 0, 3
    r.send_wire("b", grants["b"], topk([2, 2], [8, 2], dtype=b), num_samples=300)                        # 1, 3
    r.driver.tick(r.now)
    model = r.store.load_checkpoint(r.job_id, 1)["w"]
    # base [1,1,1,1] + (100·[4,0,0,-2] + 300·[0,8,0,2]) / 400 = [1,1,1,1] + [1,6,0,1]
    assert model.tolist() == [2.0, 7.0, 1.0, 2.0]


@pytest.mark.parametrize(("tensors", "problem"), [
    (topk([1, 4], [1, 1]), "out of range"),            # indices 0, 4
    (topk([1, 65535], [1, 1]), "out of range"),        # a gap far past the end
    (topk([3, 0], [1, 1]), "strictly increase"),       # indices 2, 2
    (topk([1, 1, 1], [1, 1, 1]), "k"),
    (topk([1, 4], [1, 1], dtype="U8"), "out of range"),
    (topk([1, 255], [1, 1], dtype="U8"), "out of range"),
    (topk([3, 0], [1, 1], dtype="U8"), "strictly increase"),
    (topk([1, 1, 1], [1, 1, 1], dtype="U8"), r"2 <= m <= 2: k_of\(4\) = 2 entries .* \(U8 gaps\)"),
    (topk([1, 1], [1, 1], dtype="I8"), "gaps must be U8 or U16"),
    (topk([1, 1], [1, 1], dtype="U32"), "gaps must be U8 or U16"),
    ({"w": np.zeros(4, np.float32)}, "w"),   # a dense model where a compressed Δ is due
])
def test_a_malformed_compressed_update_is_refused_and_the_round_goes_on(rig, tensors, problem):
    r = rig(min_sites=1)
    r.join("a", "b")
    r.driver.tick(r.now)
    grants = {s: r.driver.grant(s) for s in ("a", "b")}
    with pytest.raises(IntegrityError, match=problem):
        r.send_wire("b", grants["b"], tensors)
    assert r.outcome("b")[0] == "rejected"
    r.send_wire("a", grants["a"], topk([1, 1], [1, 3]))   # indices 0, 1
    r.driver.tick(r.now)   # b has its answer (refused): the round closes on a's update alone
    assert r.store.load_checkpoint(r.job_id, 1)["w"].tolist() == [2.0, 4.0, 1.0, 1.0]
