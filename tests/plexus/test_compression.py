"""Tests for plexus.compression: every codec's round trip and error, error feedback, the shared randk draw,
and the streaming Decoder (split anywhere, equal to decode() bit for bit, refusing malformed updates)."""

from __future__ import annotations

import hashlib
import math
import re
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexus.compression import (
    DOWNLINK,
    MAX_GAP,
    UPLINK,
    DensePiece,
    Gaps,
    SparsePiece,
    downlink_codec,
    downlink_decode,
    downlink_encode,
    gap_width,
    is_delta,
    k_of,
    pack_int4,
    randk_indices,
    top_indices,
    unpack_int4,
    uplink_codec,
    zero_base,
)
from plexus.errors import IntegrityError, Reason
from plexus.wire import DTYPES, Layout, decode, encode

from sparse_wire import gap_wire


@dataclass(frozen=True)
class Up:
    """Stands in for plexus.config.UplinkSpec (same fields)."""

    codec: str = "none"
    block: int = 256
    fraction: float | None = None
    k: int | None = None
    error_feedback: bool = True
    bin_conv: int = 50
    bin_dense: int = 500


@dataclass(frozen=True)
class Down:
    codec: str = "none"
    block: int = 256


SPECS = {
    "none": Up(),
    "fp16": Up("fp16"),
    "int8": Up("int8", block=16),
    "int4": Up("int4", block=16),
    "topk": Up("topk", fraction=0.1),
    "topk-nofb": Up("topk", k=3, error_feedback=False),
    "randk": Up("randk", k=5),
    "randk-nofb": Up("randk", fraction=0.25, error_feedback=False),
    "adacomp": Up("adacomp", bin_conv=9, bin_dense=20),
}


def _delta(seed: int = 0) -> dict[str, np.ndarray]:
    """A small model-shaped Δ: a conv kernel, a dense matrix, a bias, a float16 tensor, an integer counter,
    a scalar and an empty tensor."""
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(size=(4, 2, 3, 3)).astype(np.float32),
        "fc.weight": (rng.normal(size=(10, 13)) * 0.01).astype(np.float32),
        "fc.bias": np.array([0.0, -0.0, 1.0, -2.5, 3e-5, 0.0, 7.0], np.float32),
        "half": rng.normal(size=(5,)).astype(np.float16),
        "bn.num_batches_tracked": np.array(12, np.int64),
        "scalar": np.array(0.25, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }


def _model_layout(delta: dict[str, np.ndarray]) -> Layout:
    return Layout.of(delta)


def _stream(decoder, blob: bytes, cuts) -> list:
    """Feed blob cut at the given positions; return every piece."""
    pieces, edges = [], [0, *sorted(set(cuts)), len(blob)]
    for a, b in zip(edges, edges[1:]):
        if b > a:
            pieces += list(decoder.feed(memoryview(blob)[a:b]))
    decoder.finish()
    return pieces


def _reassemble(model: Layout, pieces) -> dict[str, np.ndarray]:
    """Dense float64 tensors from pieces (what a fold would add), zeros where nothing arrived."""
    out = {t.name: np.zeros(t.numel, np.float64) for t in model.tensors}
    for p in pieces:
        flat = out[model.tensors[p.tensor].name]
        assert p.values.dtype == np.float64
        if isinstance(p, DensePiece):
            flat[p.start:p.start + p.values.size] = p.values
        else:
            assert p.indices.dtype == np.int64 and np.all(np.diff(p.indices) > 0)
            flat[p.indices] = p.values
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float64).reshape(-1).view(np.int64)


def _encode(key: str, delta=None, *, round_: int = 3, residual=None, seed: int = 0):
    codec = uplink_codec(SPECS[key], seed=11)
    delta = _delta() if delta is None else delta
    wire, rest = codec.encode(delta, round_=round_, residual=residual, rng=np.random.default_rng(seed))
    return codec, delta, wire, rest


def _refused(codec, model: Layout, wire: dict, *, round_: int = 0, chunk: int = 1):
    """Feed the blob of hand-made wire tensors chunk bytes at a time; return the IntegrityError."""
    layout, blob = encode(wire)
    with pytest.raises(IntegrityError) as info:
        dec = codec.decoder(model, layout, round_=round_)
        _stream(dec, bytes(blob), range(chunk, len(blob), chunk))
    return info.value


# Registries and parameters -------------------------------------------------------------------

def test_registries_are_plain_dicts_and_unknown_names_list_them():
    assert sorted(UPLINK) == ["adacomp", "fp16", "int4", "int8", "none", "randk", "topk"]
    assert sorted(DOWNLINK) == ["delta4", "delta8", "fp16", "none"]
    with pytest.raises(ValueError, match=r"\['adacomp', 'fp16', 'int4', 'int8', 'none', 'randk', 'topk'\]"):
        uplink_codec(Up("zstd"), seed=0)
    with pytest.raises(ValueError, match=r"\['delta4', 'delta8', 'fp16', 'none'\]"):
        downlink_codec(Down("int8"))
    assert [c for c in sorted(DOWNLINK) if is_delta(c)] == ["delta4", "delta8"] and not is_delta("zstd")


def test_codec_flags():
    flags = {key: (c.name, c.feedback, c.shared_indices) for key, c in
             ((key, uplink_codec(spec, seed=0)) for key, spec in SPECS.items())}
    assert flags == {
        "none": ("none", False, True), "fp16": ("fp16", False, True), "int8": ("int8", False, True),
        "int4": ("int4", False, True),
        "topk": ("topk", True, False), "topk-nofb": ("topk", False, False), "randk": ("randk", True, True),
        "randk-nofb": ("randk", False, True), "adacomp": ("adacomp", True, False),
    }


@pytest.mark.parametrize("spec, message", [
    (Up("topk"), "exactly one of fraction and k"),
    (Up("randk", fraction=0.1, k=3), "exactly one of fraction and k"),
    (Up("topk", fraction=1.5), r"fraction must be in \(0, 1\]"),
    (Up("randk", k=0), "k must be at least 1"),
    (Up("int8", block=8), "int8 block must be 16..65536"),
    (Up("int4", block=65537), "int4 block must be 16..65536"),
    (Up("adacomp", bin_dense=0), "at least 1 element"),
])
def test_bad_parameters_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        uplink_codec(spec, seed=0)


def test_k_of():
    assert k_of(10, fraction=0.3) == 3        # not 4: 0.3 × 10 is 3.0000000000000004
    assert k_of(10, fraction=0.01) == 1
    assert k_of(10, fraction=1.0) == 10
    assert k_of(10, k=4) == 4
    assert k_of(3, k=4) == 3
    assert k_of(0, fraction=0.5) == 0 and k_of(0, k=2) == 0   # never more than N


def test_layouts_follow_the_spec_table():
    delta = _delta()
    model = _model_layout(delta)
    rows = lambda layout: {t.name: (t.dtype, t.shape) for t in layout.tensors}   # noqa: E731
    assert uplink_codec(SPECS["none"], seed=0).wire_layout(model, round_=0) == model
    int8 = rows(uplink_codec(SPECS["int8"], seed=0).wire_layout(model, round_=0))
    assert int8["conv.weight/int8.scales"] == ("F32", (5,)) and int8["conv.weight/int8.values"] == ("I8", (72,))
    assert int8["bn.num_batches_tracked/dense.values"] == ("I64", (1,))
    assert int8["half/int8.values"] == ("I8", (5,)) and int8["empty/int8.scales"] == ("F32", (0,))
    topk = rows(uplink_codec(SPECS["topk"], seed=0).wire_layout(model, round_=0))   # no counts: no fillers, U8
    assert topk["fc.weight/topk.gaps"] == ("U8", (13,)) and topk["fc.weight/topk.values"] == ("I8", (13,))
    assert topk["fc.weight/topk.scale"] == ("F32", (1,)) and topk["empty/topk.scale"] == ("F32", (1,))
    assert topk["scalar/topk.values"] == ("I8", (1,)) and topk["empty/topk.gaps"] == ("U8", (0,))
    assert rows(uplink_codec(SPECS["randk"], seed=0).wire_layout(model, round_=0))["fc.bias/randk.values"] == (
        "F32", (5,))
    ada = rows(uplink_codec(SPECS["adacomp"], seed=0).wire_layout(
        model, round_=0, counts={t.name: Gaps(1, "U16") for t in model.tensors}))
    assert ada["fc.bias/adacomp.gaps"] == ("U16", (1,)) and ada["fc.bias/adacomp.scale"] == ("F32", (1,))
    assert ada["fc.bias/adacomp.values"] == ("I8", (1,))
    with pytest.raises(ValueError, match="pass counts"):
        uplink_codec(SPECS["adacomp"], seed=0).wire_layout(model, round_=0)
    # Scales and gaps come before the values they govern.
    names = [t.name for t in uplink_codec(SPECS["int8"], seed=0).wire_layout(model, round_=0).tensors]
    assert names.index("fc.weight/int8.scales") + 1 == names.index("fc.weight/int8.values")
    names = [t.name for t in uplink_codec(SPECS["topk"], seed=0).wire_layout(model, round_=0).tensors]
    assert names.index("fc.weight/topk.gaps") + 1 == names.index("fc.weight/topk.scale")
    assert names.index("fc.weight/topk.scale") + 1 == names.index("fc.weight/topk.values")


# Round trips --------------------------------------------------------------------------------

def test_none_is_the_identity_on_the_model():
    codec, delta, wire, rest = _encode("none")
    assert rest == {} and all(wire[n] is delta[n] or np.array_equal(wire[n], delta[n]) for n in delta)
    decoded = codec.decode(_model_layout(delta), wire, round_=0)
    for name, values in delta.items():
        assert decoded[name].dtype == values.dtype and np.array_equal(decoded[name], values)


def test_fp16_exact_where_representable_and_within_half_an_ulp_elsewhere():
    exact = np.array([0.0, -0.0, 1.0, -2.5, 0.125, 65504.0, 2.0 ** -24, -1000.5], np.float32)
    rough = np.random.default_rng(1).normal(size=200).astype(np.float32)
    delta = {"a": exact, "b": rough, "n": np.array([3, -4], np.int32)}
    codec, _, wire, rest = _encode("fp16", delta)
    decoded = codec.decode(_model_layout(delta), wire, round_=0)
    assert rest == {} and decoded["a"].dtype == np.float32
    assert np.array_equal(_bits(decoded["a"]), _bits(exact))            # -0.0 stays -0.0
    assert np.all(np.abs(decoded["b"] - rough) <= np.abs(rough) * 2.0 ** -11)
    assert np.array_equal(decoded["n"], [3, -4]) and decoded["n"].dtype == np.int32
    with pytest.raises(IntegrityError, match="'a'.*65504") as info:
        codec.encode({"a": np.array([7e4], np.float32)}, round_=0, residual=None, rng=np.random.default_rng(0))
    assert info.value.reason is Reason.NORM


def test_int8_scales_and_error_bound():
    x = np.concatenate([
        np.arange(-127, 128, dtype=np.float32)[:32] * np.float32(0.5),   # block 0, 1: multiples of the scale
        np.zeros(16, np.float32),                                        # block 2: all zero -> scale 0
        np.random.default_rng(2).normal(size=21).astype(np.float32),     # blocks 3, 4 (a short last block)
    ])
    codec, _, wire, _ = _encode("int8", {"x": x})
    scales, q = wire["x/int8.scales"], wire["x/int8.values"]
    assert scales.dtype == np.float32 and q.dtype == np.int8 and scales.size == 5
    peaks = [np.abs(x[i:i + 16]).max() for i in range(0, x.size, 16)]
    assert np.array_equal(scales, np.array(peaks, np.float32) / np.float32(127))
    assert scales[2] == 0 and not q[32:48].any() and q.min() >= -127
    decoded = codec.decode(_model_layout({"x": x}), wire, round_=0)["x"]
    # x = n·0.5 with scale 0.5 (block 0 peaks at 63.5): x/s is an integer, so stochastic rounding is exact.
    assert scales[0] == np.float32(0.5) and np.array_equal(decoded[:16], x[:16])
    # Elsewhere q ∈ {floor(x/s), floor(x/s) + 1}: |error| < s, plus float32 rounding of q·s.
    per_element = np.repeat(scales, 16)[:x.size].astype(np.float64)
    assert np.all(np.abs(decoded.astype(np.float64) - x) <= per_element * (1 + 2.0 ** -20))


def test_int8_stochastic_rounding_is_unbiased():
    """E[q·s] = x: the mean of 4000 encodings lies within 5 standard errors of x for every element (fixed seeds,
    so it cannot flake), and a value between two steps really is rounded both ways."""
    codec = uplink_codec(Up("int8", block=16), seed=0)
    x = np.random.default_rng(3).normal(size=32).astype(np.float32)
    model = _model_layout({"x": x})
    runs = 4000
    total = np.zeros(x.size, np.float64)
    rng = np.random.default_rng(4)
    seen = set()
    for _ in range(runs):
        wire, _ = codec.encode({"x": x}, round_=0, residual=None, rng=rng)
        decoded = codec.decode(model, wire, round_=0)["x"].astype(np.float64)
        total += decoded
        seen.add(int(wire["x/int8.values"][1]))
    scale = np.repeat(wire["x/int8.scales"], 16).astype(np.float64)
    # Var(q·s) = s²·p(1−p) <= s²/4, so the standard error of the mean is at most s / (2·sqrt(runs)).
    stderr = scale / (2 * math.sqrt(runs))
    assert np.all(np.abs(total / runs - x) <= 5 * stderr + 1e-12)
    assert len(seen) == 2   # element 1 sits between two steps and goes both ways


# int4 --------------------------------------------------------------------------------------------

def test_int4_packs_two_values_a_byte_low_nibble_first_in_twos_complement():
    q = np.array([1, -1, 7, -7, 0, 3, -2], np.int8)   # an odd count: the last high nibble is 0
    packed = pack_int4(q)
    assert packed.dtype == np.uint8 and packed.tolist() == [0xF1, 0x97, 0x30, 0x0E]
    assert unpack_int4(packed, 7).tolist() == q.tolist()
    assert pack_int4(q[:6]).tolist() == [0xF1, 0x97, 0x30]
    assert pack_int4(np.zeros(0, np.int8)).size == 0 and unpack_int4(np.zeros(0, np.uint8), 0).size == 0
    assert pack_int4(np.array([-7], np.int8)).tolist() == [0x09]
    with pytest.raises(ValueError, match="3 int4 values take 2 bytes; got 1"):
        unpack_int4(np.array([0x11], np.uint8), 3)
    with pytest.raises(ValueError, match=r"value -8 at element 1 \(byte 0, high nibble\)"):
        unpack_int4(np.array([0x81], np.uint8), 2)
    with pytest.raises(ValueError, match="unused high nibble of byte 1 is 1"):
        unpack_int4(np.array([0x11, 0x11], np.uint8), 3)
    with pytest.raises(ValueError, match="int4 packs -7..7; element 1 is -8"):
        pack_int4(np.array([0, -8], np.int8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-7, 7), max_size=41))
def test_int4_packing_round_trips_any_length(values):
    q = np.array(values, np.int8)
    packed = pack_int4(q)
    assert packed.size == -(-q.size // 2)
    assert unpack_int4(packed, q.size).tolist() == values
    nibbles = [(b >> shift) & 0xF for b in packed.tolist() for shift in (0, 4)]
    assert nibbles[:q.size] == [v & 0xF for v in values] and nibbles[q.size:] in ([], [0])


def test_int4_layout_scales_and_error_bound():
    x = np.concatenate([
        np.arange(-7, 9, dtype=np.float32) * np.float32(0.5),            # block 0: multiples of its scale 0.5
        np.zeros(16, np.float32),                                        # block 1: all zero -> scale 0
        np.random.default_rng(2).normal(size=21).astype(np.float32),     # blocks 2, 3 (a short, odd last block)
    ])
    x[15] = 3.5                                                          # block 0 peaks at 7 · 0.5
    codec, _, wire, rest = _encode("int4", {"x": x})
    assert rest == {} and sorted(wire) == ["x/int4.scales", "x/int4.values"]
    scales, packed = wire["x/int4.scales"], wire["x/int4.values"]
    assert scales.dtype == np.float32 and scales.size == 4
    assert packed.dtype == np.uint8 and packed.size == 27            # ceil(53 / 2)
    assert codec.wire_layout(_model_layout({"x": x}), round_=0) == Layout.of(wire)
    peaks = [np.abs(x[i:i + 16]).max() for i in range(0, x.size, 16)]
    assert np.array_equal(scales, np.array(peaks, np.float32) / np.float32(7))
    q = unpack_int4(packed, x.size)
    assert scales[0] == np.float32(0.5) and q[:16].tolist() == list(range(-7, 8)) + [7]
    assert scales[1] == 0 and not packed[8:16].any() and q.min() >= -7 and q.max() <= 7
    decoded = codec.decode(_model_layout({"x": x}), wire, round_=0)["x"]
    assert decoded.dtype == np.float32 and np.array_equal(decoded[:32], x[:32])   # exact where x/s is whole
    # Elsewhere q ∈ {floor(x/s), floor(x/s) + 1}: |error| < s, plus float32 rounding of q·s.
    per_element = np.repeat(scales, 16)[:x.size].astype(np.float64)
    assert np.all(np.abs(decoded.astype(np.float64) - x) <= per_element * (1 + 2.0 ** -20))
    assert np.all(np.abs(decoded.astype(np.float64) - x)[32:] < per_element[32:])


def test_int4_stochastic_rounding_is_unbiased():
    """E[q·s] = x: over 4000 encodings each element rounds up with probability frac(x/s), within 5 standard
    errors of the binomial, and the mean decoded value lies within 5 standard errors of x (fixed seeds: it
    cannot flake). At 4 bits the steps are 18× coarser than int8's, so a bias would show."""
    codec = uplink_codec(Up("int4", block=16), seed=0)
    x = np.random.default_rng(3).normal(size=33).astype(np.float32)
    model = _model_layout({"x": x})
    runs = 4000
    total = np.zeros(x.size, np.float64)
    ups = np.zeros(x.size, np.int64)
    rng = np.random.default_rng(4)
    for _ in range(runs):
        wire, _ = codec.encode({"x": x}, round_=0, residual=None, rng=rng)
        total += codec.decode(model, wire, round_=0)["x"].astype(np.float64)
        scale = np.repeat(wire["x/int4.scales"], 16)[:x.size].astype(np.float64)
        y = x / scale
        ups += unpack_int4(wire["x/int4.values"], x.size) > np.floor(y)
    frac = y - np.floor(y)
    assert np.all(np.abs(ups / runs - frac) <= 5 * np.sqrt(frac * (1 - frac) / runs) + 1e-9)
    assert ((frac > 0.05) & (frac < 0.95) & (ups > 0) & (ups < runs)).sum() >= 20   # really rounded both ways
    stderr = scale / (2 * math.sqrt(runs))   # Var(q·s) = s²·p(1−p) <= s²/4
    assert np.all(np.abs(total / runs - x) <= 5 * stderr + 1e-12)


def test_int4_decoder_dequantises_chunk_by_chunk():
    """A 4M-element tensor (16 MB as float32) fed 16 KiB at a time: one dense piece per chunk, each at most
    the chunk's 2 · 16 Ki elements, and the decoder's peak memory stays near one chunk's, never the tensor's."""
    n, chunk = 4_000_000, 16 << 10
    model = Layout.build([("w", "F32", (n,))])
    wire = {"w/int4.scales": np.full(-(-n // 256), 0.5, np.float32),
            "w/int4.values": np.tile(np.array([0x9F, 0x17], np.uint8), n // 4)}
    layout, blob = encode(wire)
    blob = bytes(blob)
    tracemalloc.start()
    try:
        dec = uplink_codec(Up("int4", block=256), seed=0).decoder(model, layout, round_=0)
        sizes, seen = [], 0
        for at in range(0, len(blob), chunk):
            for piece in dec.feed(memoryview(blob)[at:at + chunk]):
                assert isinstance(piece, DensePiece) and piece.start == seen
                if seen == 0:
                    assert piece.values[:4].tolist() == [-0.5, -3.5, 3.5, 0.5]   # 0xF, 0x9, 0x7, 0x1
                seen += piece.values.size
                sizes.append(piece.values.size)
        dec.finish()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == n and max(sizes) <= 2 * chunk and len(sizes) > 100
    assert peak < 2_000_000, peak   # a dense float64 copy would be 32 MB


def _int4_wire(values, scales=(1.0,)) -> dict[str, np.ndarray]:
    return {"w/int4.scales": np.array(scales, np.float32), "w/int4.values": np.array(values, np.uint8)}


@pytest.mark.parametrize("n, wire, message, reason", [
    (3, _int4_wire([0x08, 0x00]), "'w/int4.values': value -8 at element 0 (byte 0, low nibble); int4 values "
     "are -7..7", Reason.LAYOUT),
    (3, _int4_wire([0x81, 0x00]), "'w/int4.values': value -8 at element 1 (byte 0, high nibble)", Reason.LAYOUT),
    (3, _int4_wire([0x11, 0x08]), "'w/int4.values': value -8 at element 2 (byte 1, low nibble)", Reason.LAYOUT),
    (40, _int4_wire([0x11] * 16 + [0x81, 0x11, 0x11, 0x11], (1.0, 1.0, 1.0)),
     "'w/int4.values': value -8 at element 33 (byte 16, high nibble)", Reason.LAYOUT),
    (3, _int4_wire([0x11, 0x71]), "'w/int4.values': the unused high nibble of byte 1 is 7; with an odd number of "
     "elements the last byte's high nibble must be 0", Reason.LAYOUT),
    (3, _int4_wire([0x11, 0x81]), "the unused high nibble of byte 1 is 8", Reason.LAYOUT),
    (3, _int4_wire([0x00, 0x00], (np.nan,)), "'w/int4.scales': scale nan at position 0", Reason.NON_FINITE),
    (3, _int4_wire([0x00, 0x00], (np.inf,)), "'w/int4.scales': scale inf at position 0", Reason.NON_FINITE),
    (3, _int4_wire([0x00, 0x00], (-0.5,)), "'w/int4.scales': scale -0.5 at position 0", Reason.LAYOUT),
    (3, _int4_wire([0x70, 0x00], (3e38,)), "'w/int4.values': element 1 decodes to inf", Reason.NON_FINITE),
])
def test_malformed_int4_updates_are_refused_naming_entry_and_position(n, wire, message, reason):
    spec = Up("int4", block=16)
    model = Layout.build([("w", "F32", (n,))])
    for chunk in (1, 2, 64):
        error = _refused(uplink_codec(spec, seed=0), model, wire, chunk=chunk)
        assert error.reason is reason and message in str(error), str(error)
    with pytest.raises(IntegrityError, match=re.escape(message.split(":")[0])):
        uplink_codec(spec, seed=0).decode(model, wire, round_=0)


@pytest.mark.parametrize("wire, message", [
    (_int4_wire([0x11, 0x11, 0x11]), r"'w/int4.values' is U8\[3\]; expected U8\[2\] \(two 4-bit values a byte: "
     r"ceil\(N / 2\) bytes\)"),
    (_int4_wire([0x11]), r"'w/int4.values' is U8\[1\]; expected U8\[2\]"),
    ({"w/int4.scales": np.ones(1, np.float32), "w/int4.values": np.ones(3, np.int8)},
     r"'w/int4.values' is I8\[3\]; expected U8\[2\]"),
    (_int4_wire([0x11, 0x01], (1.0, 1.0)), r"'w/int4.scales' is F32\[2\]; expected F32\[1\]"),
    ({"w/int4.values": np.ones(2, np.uint8)}, r"lacks entr\(ies\) \['w/int4.scales'\]"),
    ({"w/int8.scales": np.ones(1, np.float32), "w/int8.values": np.ones(3, np.int8)},
     r"lacks entr\(ies\) \['w/int4.scales', 'w/int4.values'\]"),
])
def test_int4_byte_counts_are_exact(wire, message):
    model = Layout.build([("w", "F32", (3,))])
    codec = uplink_codec(Up("int4", block=16), seed=0)
    with pytest.raises(IntegrityError, match=message) as info:
        codec.decoder(model, Layout.of(wire), round_=0)
    assert info.value.reason is Reason.LAYOUT


def test_an_int4_stream_of_the_wrong_length_is_refused():
    model = Layout.build([("w", "F32", (3,))])
    codec = uplink_codec(Up("int4", block=16), seed=0)
    layout, blob = encode(_int4_wire([0x11, 0x01]))   # one F32 scale and 2 bytes for 3 values
    dec = codec.decoder(model, layout, round_=0)
    with pytest.raises(IntegrityError, match="more than the 6 bytes") as info:
        list(dec.feed(bytes(blob) + b"\0"))
    assert info.value.reason is Reason.SIZE
    dec = codec.decoder(model, layout, round_=0)
    list(dec.feed(bytes(blob)[:-1]))
    with pytest.raises(IntegrityError, match="ended after 5 of 6 bytes") as info:
        dec.finish()
    assert info.value.reason is Reason.SIZE


# Error feedback ----------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["topk", "randk", "adacomp"])
def test_error_feedback_is_exact_over_rounds(key):
    """decoded(sent) + new R == Δ + old R exactly (in float32 and in real arithmetic), round after round."""
    codec = uplink_codec(SPECS[key], seed=5)
    rng = np.random.default_rng(6)
    residual = None
    for round_ in range(4):
        delta = {k: v for k, v in _delta(round_).items()}
        delta["heavy"] = (rng.normal(size=300) * np.exp(rng.normal(size=300) * 3)).astype(np.float32)
        model = _model_layout(delta)
        wire, new = codec.encode(delta, round_=round_, residual=residual, rng=rng)
        decoded = codec.decode(model, wire, round_=round_)
        assert sorted(new) == sorted(n for n, v in delta.items() if v.dtype.kind == "f")
        for name in new:
            g = delta[name].astype(np.float32) + (residual[name] if residual else 0)
            assert new[name].dtype == np.float32 and new[name].shape == delta[name].shape
            assert np.array_equal(decoded[name] + new[name], g)
            assert np.array_equal(decoded[name].astype(np.float64) + new[name].astype(np.float64),
                                  g.astype(np.float64))
        assert np.array_equal(decoded["bn.num_batches_tracked"], delta["bn.num_batches_tracked"])
        residual = new


def test_without_feedback_there_is_no_residual():
    for key in ("fp16", "int8", "int4", "topk-nofb", "randk-nofb"):
        _, _, _, rest = _encode(key, residual={"fc.bias": np.ones(7, np.float32)})
        assert rest == {}


def test_residual_must_match_the_update():
    codec = uplink_codec(SPECS["topk"], seed=0)
    with pytest.raises(ValueError, match="shape"):
        codec.encode(_delta(), round_=0, residual={"fc.bias": np.ones(3, np.float32)}, rng=np.random.default_rng())
    with pytest.raises(ValueError, match="'gone'"):
        codec.encode(_delta(), round_=0, residual={"gone": np.ones(3, np.float32)}, rng=np.random.default_rng())


def test_non_finite_and_slashed_names_are_refused_at_the_site():
    for key in ("fp16", "int8", "int4", "topk", "randk", "adacomp"):
        with pytest.raises(IntegrityError, match="'w'.*element 1") as info:
            _encode(key, {"w": np.array([1.0, np.nan, 2.0], np.float32)})
        assert info.value.reason is Reason.NON_FINITE
    with pytest.raises(ValueError, match="'/'"):
        _encode("int8", {"a/b": np.ones(3, np.float32)})


# topk, randk, adacomp --------------------------------------------------------------------------

def test_topk_picks_the_largest_magnitudes_ties_by_lower_index():
    g = np.array([0.1, -5.0, 3.0, 3.0, -3.0, 0.0, 2.0], np.float32)
    assert top_indices(g, 3).tolist() == [1, 2, 3]
    assert top_indices(g, 4).tolist() == [1, 2, 3, 4]
    assert top_indices(g, 0).tolist() == [] and top_indices(g, 9).tolist() == list(range(7))
    codec = uplink_codec(Up("topk", k=3), seed=0)
    wire, rest = codec.encode({"g": g}, round_=0, residual=None, rng=np.random.default_rng())
    assert list(wire) == ["g/topk.gaps", "g/topk.scale", "g/topk.values"]
    assert wire["g/topk.gaps"].dtype == np.uint8 and wire["g/topk.gaps"].tolist() == [2, 1, 1]   # 1, 2, 3
    scale = wire["g/topk.scale"]
    assert scale.dtype == np.float32 and scale.tolist() == [np.float32(5) / np.float32(127)]
    q = wire["g/topk.values"]
    assert q.dtype == np.int8 and q[0] == -127 and set(q[1:].tolist()) <= {76, 77}   # 3/scale = 76.2
    sent = q.astype(np.float32) * scale[0]
    assert np.array_equal(sent + rest["g"][[1, 2, 3]], g[[1, 2, 3]])   # the quantisation error stays behind
    assert rest["g"][[0, 4, 5, 6]].tolist() == [np.float32(0.1), -3, 0, 2]


def test_topk_keeps_every_chosen_entry_even_where_q_is_0():
    """One scale per tensor: a chosen entry far below the peak may round to 0; it still travels, so m == k."""
    g = np.array([1000.0, 0.0, 1e-3, -1e-3, 0.5], np.float32)
    codec = uplink_codec(Up("topk", k=4), seed=0)
    wire, rest = codec.encode({"g": g}, round_=0, residual=None, rng=np.random.default_rng(0))
    assert np.cumsum(wire["g/topk.gaps"]).tolist() == [1, 3, 4, 5] and wire["g/topk.values"][0] == 127
    assert wire["g/topk.values"][1:3].tolist() == [0, 0]   # ±1e-3 against a scale of 7.9
    decoded = codec.decode(_model_layout({"g": g}), wire, round_=0)["g"]
    assert np.array_equal(decoded + rest["g"], g)
    plain = uplink_codec(Up("topk", k=4, error_feedback=False), seed=0)
    wire, rest = plain.encode({"g": g}, round_=0, residual=None, rng=np.random.default_rng(0))
    assert rest == {} and wire["g/topk.values"].size == 4   # without feedback the error is lost


def test_a_gap_beyond_65535_is_bridged_by_fillers_that_decode_to_zero():
    g = np.zeros(200_000, np.float32)
    g[0], g[199_999], g[100_000] = 1.0, -2.0, 0.5
    codec = uplink_codec(Up("topk", k=2), seed=0)
    wire, _ = codec.encode({"w": g}, round_=0, residual=None, rng=np.random.default_rng(0))
    # 0, then fillers at 65535, 131070, 196605 (gaps of 65535 with value 0), then 199999.
    assert wire["w/topk.gaps"].tolist() == [1, 65535, 65535, 65535, 3394]
    assert wire["w/topk.values"][1:4].tolist() == [0, 0, 0] and wire["w/topk.values"][-1] == -127
    model = Layout.build([("w", "F32", (200_000,))])
    layout, blob = encode(wire)
    assert layout.total_bytes == 5 * 3 + 4
    pieces = _stream(codec.decoder(model, layout, round_=0), bytes(blob), range(5, len(blob), 5))
    indices = np.concatenate([p.indices for p in pieces])
    values = np.concatenate([p.values for p in pieces])
    assert indices.tolist() == [0, 65535, 131070, 196605, 199999] and values[1:4].tolist() == [0, 0, 0]
    decoded = codec.decode(model, wire, round_=0)["w"]
    assert np.flatnonzero(decoded).tolist() == [0, 199_999] and decoded[199_999] == -2.0
    # (N − k) // 65535 = 3 fillers is the most k = 2 entries can need: a fourth is refused by the layout.
    more = dict(wire, **{"w/topk.gaps": np.array([1, 1, 65535, 65535, 65535, 3393], np.uint16),
                         "w/topk.values": np.zeros(6, np.int8)})
    with pytest.raises(IntegrityError, match=r"has shape \[6\]; it must be \[m\] with 2 <= m <= 5"):
        codec.check_layout(model, Layout.of(more), round_=0)


def _bytes_by_hand(indices) -> dict[str, int]:
    """What each gap dtype costs for these sorted indices: ceil(gap / MAX) entries for each gap (a filler for
    each full MAX), every entry its gap and its I8 value."""
    gaps = np.diff(np.asarray(indices, np.int64), prepend=-1)
    return {"U8": 2 * int(np.sum(-(-gaps // 255))), "U16": 3 * int(np.sum(-(-gaps // 65535)))}


def test_the_gap_width_is_the_one_that_sends_fewer_bytes():
    assert gap_width(np.array([255])) == Gaps(1, "U8")                 # 2 bytes against 3
    assert gap_width(np.array([256])) == Gaps(1, "U16")                # a filler: 4 bytes against 3
    assert gap_width(np.array([510])) == Gaps(1, "U16")                # 255 + 255: one filler
    assert gap_width(np.array([511])) == Gaps(1, "U16")                # two fillers
    assert gap_width(np.array([1, 1, 256])) == Gaps(4, "U8")           # 8 bytes against 9
    assert gap_width(np.array([1, 256])) == Gaps(3, "U8")              # 6 bytes either way: U8
    assert gap_width(np.array([65535] + [1] * 300)) == Gaps(301, "U16")  # 1114 bytes against 903
    assert gap_width(np.array([65535] + [1] * 600)) == Gaps(857, "U8")   # 1714 against 1803
    assert gap_width(np.array([65536, 1])) == Gaps(3, "U16")           # 65535 + 1 and 1
    assert gap_width(np.zeros(0, np.int64)) == Gaps(0, "U8")


@pytest.mark.parametrize("n, k, dtype", [(10_000, 100, "U8"), (300_000, 10_000, "U8"), (65_535, 1, "U16"),
                                         (2_000_000, 20, "U16")])
def test_topk_sends_2_bytes_an_entry_where_its_gaps_fit_a_byte_and_3_where_they_do_not(n, k, dtype):
    """Random entries at 1 % or more lie mostly closer than 255 apart: about 2 bytes an entry (a U8 gap, an I8
    value) and a filler now and then, so fraction 1/20 sends 40× fewer bytes than float32 (1/30 at 3 bytes
    an entry, 1/80 at 8). Far apart, U16 gaps take fewer bytes. Plus one F32 scale a tensor either way."""
    g = np.random.default_rng(n).normal(size=n).astype(np.float32)
    wire, _ = uplink_codec(Up("topk", k=k), seed=0).encode({"w": g}, round_=0, residual=None,
                                                           rng=np.random.default_rng(0))
    cost = _bytes_by_hand(top_indices(g, k))
    assert wire["w/topk.gaps"].dtype == DTYPES[dtype] and cost[dtype] == min(cost.values())
    assert encode(wire)[0].total_bytes == cost[dtype] + 4


@pytest.mark.parametrize("ones, dtype", [(0, "U16"), (2000, "U8")])
def test_gaps_of_255_256_510_65535_and_65536_round_trip_in_either_width(ones, dtype):
    """The first index past 255 and gaps at and beyond each width's largest: alone, U16 gaps are smaller; with
    2000 neighbouring entries, U8 gaps and their 516 fillers are. Either way the stream gives back exactly the
    indices and values, and the other width decodes to the same bits."""
    chosen = np.cumsum([300, 255, 256, 510, 65535, 65536] + [1] * ones) - 1
    n = int(chosen[-1]) + 1
    g = np.zeros(n, np.float32)
    g[chosen] = np.where(np.arange(chosen.size) % 2, -1, 1) * (1 + np.arange(chosen.size) % 127)
    g[chosen[-1]] = 127
    codec = uplink_codec(Up("topk", k=chosen.size), seed=0)
    wire, _ = codec.encode({"w": g}, round_=0, residual=None, rng=np.random.default_rng(0))
    assert wire["w/topk.gaps"].dtype == DTYPES[dtype]
    assert encode(wire)[0].total_bytes == min(_bytes_by_hand(chosen).values()) + 4
    model = Layout.build([("w", "F32", (n,))])
    layout, blob = encode(wire)
    pieces = _stream(codec.decoder(model, layout, round_=0), bytes(blob), range(3, len(blob), 3))
    indices = np.concatenate([p.indices for p in pieces])
    values = np.concatenate([p.values for p in pieces])
    assert indices[values != 0].tolist() == chosen.tolist() and values[values != 0].tolist() == g[chosen].tolist()
    decoded = codec.decode(model, wire, round_=0)["w"]
    assert np.array_equal(decoded, g)
    other = gap_wire("topk", chosen, g[chosen].astype(np.int8), dtype="U8" if dtype == "U16" else "U16")
    assert np.array_equal(_bits(codec.decode(model, other, round_=0)["w"]), _bits(decoded))


_GAP = st.one_of(st.integers(1, 4), st.integers(1, 300),
                 st.sampled_from([254, 255, 256, 509, 510, 511, 65534, 65535, 65536, 65537, 131070, 131071]),
                 st.integers(1, 200_000))


@settings(max_examples=120, deadline=None)
@given(st.lists(_GAP, min_size=1, max_size=400), st.integers(0, 70_000), st.data())
def test_fillers_are_exactly_where_the_gaps_need_them(gaps, tail, data):
    """Any strictly increasing indices (clustered or far apart, the first past 255 or not): the gaps are of
    the dtype that makes fewer bytes, they and the values lead back to exactly the indices and their values,
    every filler is 0 with the dtype's largest gap, m never exceeds k + (N − k) // MAX_GAP, and the update
    streams to the same indices and values, cut anywhere."""
    chosen = np.cumsum(gaps) - 1
    k, n = chosen.size, int(chosen[-1]) + 1 + tail
    g = np.zeros(n, np.float32)
    g[chosen] = 1 + np.arange(k) % 127
    g[chosen[0]] = 127   # scale 127/127 = 1: q·scale is exact
    codec = uplink_codec(Up("topk", k=k), seed=0)
    wire, _ = codec.encode({"w": g}, round_=0, residual=None, rng=np.random.default_rng(0))
    cost = _bytes_by_hand(chosen)
    dtype = "U8" if cost["U8"] <= cost["U16"] else "U16"
    sent = wire["w/topk.gaps"]
    assert sent.dtype == DTYPES[dtype]
    assert encode(wire)[0].total_bytes == cost[dtype] + 4
    most = MAX_GAP[dtype]
    assert sent.min() >= 1 and sent.max() <= most
    idx = np.cumsum(sent, dtype=np.int64) - 1
    q = wire["w/topk.values"]
    assert idx[q != 0].tolist() == chosen.tolist() and q[q != 0].tolist() == g[chosen].tolist()
    assert np.all(sent[q == 0] == most) and k <= q.size <= k + (n - k) // most
    model = Layout.build([("w", "F32", (n,))])
    decoded = codec.decode(model, wire, round_=0)["w"]
    assert np.array_equal(decoded, g)
    # The other width, written by hand, decodes to the same bits: which one the site chose changes no result.
    other = gap_wire("topk", chosen, g[chosen].astype(np.int8), dtype="U16" if dtype == "U8" else "U8")
    assert np.array_equal(_bits(codec.decode(model, other, round_=0)["w"]), _bits(decoded))
    layout, blob = encode(wire)
    cuts = data.draw(st.lists(st.integers(1, len(blob) - 1), max_size=12))
    pieces = _stream(codec.decoder(model, layout, round_=0), bytes(blob), cuts)
    streamed = _reassemble(model, pieces)["w"]
    assert np.array_equal(_bits(streamed), _bits(decoded))
    got = np.concatenate([p.indices for p in pieces])
    assert got.tolist() == idx.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-3, 7.0]), min_size=1, max_size=40),
       st.integers(0, 45))
def test_topk_matches_a_stable_sort(values, k):
    g = np.array(values, np.float32)
    expect = np.sort(np.argsort(-np.abs(g), kind="stable")[:k])
    assert top_indices(g, k).tolist() == expect.tolist()


def test_randk_indices_are_shared_and_fresh_each_round():
    a = randk_indices(42, 3, "fc.weight", 1000, 50)
    assert a.dtype == np.int64 and a.size == 50 and np.all(np.diff(a) > 0) and a[-1] < 1000
    assert np.array_equal(a, randk_indices(42, 3, "fc.weight", 1000, 50))
    assert not np.array_equal(a, randk_indices(42, 4, "fc.weight", 1000, 50))
    assert not np.array_equal(a, randk_indices(42, 3, "fc.bias", 1000, 50))
    assert not np.array_equal(a, randk_indices(43, 3, "fc.weight", 1000, 50))
    # Only PCG64's raw stream decides (stable across numpy releases): the first 50 distinct floor(raw·N / 2**64),
    # recomputed here with Python integers.
    digest = hashlib.sha256(b"plexus/v1/randk/42/3/fc.weight").digest()
    stream, expect = np.random.PCG64(int.from_bytes(digest, "big")), []
    while len(expect) < 50:
        for raw in stream.random_raw(8).tolist():
            i = raw * 1000 >> 64
            if i not in expect and len(expect) < 50:
                expect.append(i)
    assert a.tolist() == sorted(expect)
    assert randk_indices(1, 1, "x", 5, 5).tolist() == [0, 1, 2, 3, 4]


def test_randk_sends_values_at_the_shared_indices():
    delta = {"w": np.arange(1, 21, dtype=np.float32)}
    fb = uplink_codec(Up("randk", k=4), seed=9)
    wire, rest = fb.encode(delta, round_=2, residual=None, rng=np.random.default_rng())
    idx = randk_indices(9, 2, "w", 20, 4)
    assert list(wire) == ["w/randk.values"] and np.array_equal(wire["w/randk.values"], delta["w"][idx])
    assert np.all(rest["w"][idx] == 0) and rest["w"].sum() == delta["w"].sum() - delta["w"][idx].sum()
    plain = uplink_codec(Up("randk", k=4, error_feedback=False), seed=9)
    wire, rest = plain.encode(delta, round_=2, residual=None, rng=np.random.default_rng())
    assert rest == {} and np.array_equal(wire["w/randk.values"], delta["w"][idx] * np.float32(5))   # N/k = 5


def test_randk_without_feedback_is_unbiased():
    """Scaled by N/k, the estimate's mean over rounds (fresh indices each) approaches Δ."""
    delta = {"w": np.random.default_rng(7).normal(size=20).astype(np.float32)}
    codec = uplink_codec(Up("randk", k=5, error_feedback=False), seed=1)
    model = _model_layout(delta)
    runs, rng = 2000, np.random.default_rng(0)
    total = sum(codec.decode(model, codec.encode(delta, round_=r, residual=None, rng=rng)[0], round_=r)["w"]
                .astype(np.float64) for r in range(runs))
    # Each round the element is N/k·x with probability k/N, else 0: variance x²(N/k − 1) = 3x².
    stderr = np.abs(delta["w"]) * math.sqrt(3 / runs)
    assert np.all(np.abs(total / runs - delta["w"]) <= 5 * stderr)


def test_adacomp_selects_by_bin_and_quantises_with_one_scale():
    # One dense bin of 8 (bin_dense 8): G = Δ (no residue), H = 2Δ; |H| >= max|G| = 4 means |Δ| >= 2.
    delta = np.array([0.5, -4.0, 2.0, 1.9, -2.0, 0.0, 3.0, 0.1, 1.0, -1.0], np.float32)   # second bin: peak 1
    codec = uplink_codec(Up("adacomp", bin_dense=8), seed=0)
    wire, rest = codec.encode({"d": delta}, round_=0, residual=None, rng=np.random.default_rng(0))
    assert wire["d/adacomp.gaps"].dtype == np.uint8 and wire["d/adacomp.gaps"].tolist() == [2, 1, 2, 2, 2, 1]
    chosen = np.cumsum(wire["d/adacomp.gaps"]) - 1
    assert chosen.tolist() == [1, 2, 4, 6, 8, 9]
    scale = wire["d/adacomp.scale"]
    assert scale.dtype == np.float32 and scale[0] == np.float32(4.0) / np.float32(127)
    q = wire["d/adacomp.values"]
    assert q.dtype == np.int8 and q[0] == -127
    sent = np.zeros(10, np.float32)
    sent[chosen] = q.astype(np.float32) * scale[0]
    assert np.all(np.abs(sent - delta)[chosen] <= scale[0])
    assert np.array_equal(sent + rest["d"], delta)
    # A conv kernel (ndim >= 3) uses bin_conv; an all-zero tensor sends nothing.
    zero = {"k": np.zeros((2, 2, 2, 2), np.float32)}
    wire, rest = codec.encode(zero, round_=0, residual=None, rng=np.random.default_rng(0))
    assert wire["k/adacomp.gaps"].size == 0 and wire["k/adacomp.values"].size == 0


def test_adacomp_compression_on_random_normal_tensors():
    """i.i.d. N(0, 0.01²) updates (no structure, a hard case): the first round sends 10.8% of a dense
    tensor's entries (18.6× fewer bytes than float32 at 2 bytes an entry, 1-byte gaps, plus fillers), and with
    the residue accumulating, 3.1% (64.4×) by round 6; a conv kernel with bins of 50: 22% (9.0×), then 13%
    (15.5×). Real gradients compress further (the paper's 40×/200× are end to end on trained networks)."""
    codec = uplink_codec(Up("adacomp"), seed=1)
    rng = np.random.default_rng(0)
    for shape, first, last in (((256, 512), 18.0, 63.0), ((64, 32, 3, 3), 8.8, 15.0)):
        residual = None
        ratios = []
        for round_ in range(6):
            delta = {"w": (rng.normal(size=shape) * 0.01).astype(np.float32)}
            wire, residual = codec.encode(delta, round_=round_, residual=residual, rng=rng)
            assert wire["w/adacomp.values"].size < delta["w"].size
            ratios.append(delta["w"].nbytes / encode(wire)[0].total_bytes)
        assert ratios[0] > first and ratios[-1] > last, ratios


# Streaming ---------------------------------------------------------------------------------

def _check_stream(key: str, cuts_of, *, seed: int = 0):
    codec, delta, wire, _ = _encode(key, seed=seed)
    model = _model_layout(delta)
    layout, blob = encode(wire)
    blob = bytes(blob)
    expect = codec.decode(model, wire, round_=3)
    for cuts in cuts_of(len(blob)):
        dec = codec.decoder(model, layout, round_=3)
        pieces = _stream(dec, blob, cuts)
        got = _reassemble(model, pieces)
        for name, values in expect.items():
            assert np.array_equal(_bits(got[name]), _bits(values)), (key, name, cuts[:5])
        flat = np.concatenate([v.reshape(-1).astype(np.float64) for v in expect.values()])
        assert dec.max_abs == np.abs(flat).max()
        assert dec.sum_sq == pytest.approx(float(np.dot(flat, flat)), rel=1e-12)
        kind = SparsePiece if codec.name in ("topk", "randk", "adacomp") else DensePiece
        assert all(isinstance(p, kind) for p in pieces if model.tensors[p.tensor].dtype != "I64")


@pytest.mark.parametrize("key", list(SPECS))
def test_streamed_pieces_equal_decode_for_every_split(key):
    def splits(n):
        rng = np.random.default_rng(8)
        yield []                                              # one chunk
        for step in (1, 3, 7):
            yield list(range(step, n, step))
        for _ in range(5):
            yield sorted(rng.choice(np.arange(1, n), size=min(n - 1, 12), replace=False).tolist())
    _check_stream(key, splits)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(SPECS)), st.integers(0, 2**16), st.data())
def test_streaming_property(key, seed, data):
    def splits(n):
        yield data.draw(st.lists(st.integers(1, n - 1), max_size=20))
    _check_stream(key, splits, seed=seed)


def test_sparse_decoder_memory_is_independent_of_n():
    """A 50M-element tensor: the decoder holds m indices and a chunk, never an N-element array."""
    model = Layout.build([("w", "F32", (50_000_000,))])
    spread = np.arange(0, 50_000_000, 5_000_000)   # 76 fillers between neighbours
    cases = {
        "topk": (Up("topk", k=10), gap_wire("topk", spread, np.ones(10))),
        "randk": (Up("randk", k=10), {"w/randk.values": np.ones(10, np.float32)}),
        "adacomp": (Up("adacomp"), gap_wire("adacomp", spread, np.ones(10))),
    }
    for spec, wire in cases.values():
        layout, blob = encode(wire)
        tracemalloc.start()
        try:
            dec = uplink_codec(spec, seed=0).decoder(model, layout, round_=0)
            pieces = _stream(dec, bytes(blob), range(7, len(blob), 7))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1_000_000 and sum(np.count_nonzero(p.values) for p in pieces) == 10
        if spec.codec != "randk":   # randk's coordinates are the shared draw's
            assert np.concatenate([p.indices[p.values != 0] for p in pieces]).tolist() == spread.tolist()


# Malformed updates ---------------------------------------------------------------------------

def _topk(gaps, values=None, n=10, scale=1.0, *, k=None, dtype="U16"):
    """A topk codec with k (len(gaps) unless given), the model [n] and a hand-made wire of these gaps."""
    model = Layout.build([("w", "F32", (n,))])
    values = np.ones(len(gaps), np.int8) if values is None else np.asarray(values, np.int8)
    return uplink_codec(Up("topk", k=len(gaps) if k is None else k), seed=0), model, {
        "w/topk.gaps": np.asarray(gaps, DTYPES[dtype]), "w/topk.scale": np.array([scale], np.float32),
        "w/topk.values": values}


@pytest.mark.parametrize("gaps, chunk, message", [
    ([2, 3, 6], 1, "index 10 at position 2 is out of range: the tensor has 10 elements"),
    ([2, 65535, 65535], 5, "index 65536 at position 1 is out of range"),              # a large gap sum
    ([6, 2, 3], 2, "index 10 at position 2 is out of range"),                         # summed across chunk edges
    ([2, 3, 0], 3, r"gap 0 at position 2 repeats index 4; indices must strictly increase"),
    ([2, 4, 0], 4, r"gap 0 at position 2 repeats index 5"),                           # across a chunk edge
    ([8, 0, 1], 1, r"gap 0 at position 1 repeats index 7"),
    ([0, 1, 1], 64, r"gap 0 at position 0 repeats index -1"),                        # idx_{-1} = -1 is no index
])
def test_bad_gaps_are_refused(gaps, chunk, message):
    codec, model, wire = _topk(gaps)
    error = _refused(codec, model, wire, chunk=chunk)
    assert error.reason is Reason.LAYOUT and "'w/topk.gaps'" in str(error)
    assert re.search(message, str(error)), str(error)


def test_a_gap_split_across_chunk_edges_is_read_whole():
    # 256 = bytes 00 01: the first byte alone looks like a gap of 0 (a repeated index).
    codec, model, wire = _topk([3, 256], n=300)
    layout, blob = encode(wire)
    dec = codec.decoder(model, layout, round_=0)
    assert list(dec.feed(blob[:3])) == []
    pieces = list(dec.feed(blob[3:]))
    dec.finish()
    assert [p.indices.tolist() for p in pieces] == [[2, 258]]
    # The same bytes against a 10-element tensor: index 258 is out of range, found only once the gap is whole.
    codec, model, wire = _topk([3, 256])
    dec = codec.decoder(model, layout, round_=0)
    assert list(dec.feed(blob[:3])) == []
    with pytest.raises(IntegrityError, match="index 258 at position 1 is out of range") as info:
        list(dec.feed(blob[3:]))
    assert info.value.reason is Reason.LAYOUT
    with pytest.raises(IntegrityError, match="refused"):   # a refused stream stays refused
        dec.finish()


@pytest.mark.parametrize("gaps, values, message", [
    ([3, 0], [1, 1], r"'w/topk.gaps': gap 0 at position 1 repeats index 2"),
    ([255, 255, 255], [1, 0, 1], r"'w/topk.gaps': index 764 at position 2 is out of range: the tensor has 600"),
    ([1, 255, 255, 255], [1, 0, 0, 1], r"'w/topk.gaps': index 765 at position 3 is out of range"),
    # The gap of 255 that could be a filler carries a value: 3 entries sent where k is 2.
    ([1, 255, 100], [1, 5, 1], r"'w/topk.values': value 1 at position 2 is non-zero value number 3; topk sends "
                               r"k_of\(600\) = 2 entries"),
    ([1, 255, 255, 5], [1, 0, -3, 1], r"'w/topk.values': value 1 at position 3 is non-zero value number 3"),
])
def test_bad_u8_gaps_and_fillers_are_refused(gaps, values, message):
    """k = 2 of 600 elements: U8 gaps leave room for (600 − 2) // 255 = 2 fillers, so m is 2..4."""
    codec, model, wire = _topk(gaps, values, n=600, k=2, dtype="U8")
    for chunk in (1, 2, 64):
        error = _refused(codec, model, wire, chunk=chunk)
        assert error.reason is Reason.LAYOUT and re.search(message, str(error)), str(error)
    with pytest.raises(IntegrityError, match=message):
        codec.decode(model, wire, round_=0)


def test_u8_fillers_with_value_0_are_taken_and_decode_to_0():
    codec, model, wire = _topk([1, 255, 255, 5], [3, 0, 0, -1], n=600, k=2, dtype="U8")   # 0 and 515
    decoded = codec.decode(model, wire, round_=0)["w"]
    assert np.flatnonzero(decoded).tolist() == [0, 515] and decoded[[0, 515]].tolist() == [3, -1]
    # A chosen entry whose value rounds to 0 is no filler but is no more than k either.
    codec, model, wire = _topk([1, 255, 7], [0, 0, 4], n=600, k=2, dtype="U8")
    assert np.flatnonzero(codec.decode(model, wire, round_=0)["w"]).tolist() == [262]


@pytest.mark.parametrize("gaps, dtype, message", [
    ([1, 255, 255, 255, 5], "U8", r"has shape \[5\]; it must be \[m\] with 2 <= m <= 4: k_of\(600\) = 2 entries "
                                  r"and a filler for each 255 positions between them \(U8 gaps\)"),
    ([1, 1, 1], "U16", r"has shape \[3\]; it must be \[m\] with 2 <= m <= 2: .* 65535 positions .*\(U16 gaps\)"),
    ([1], "U8", r"has shape \[1\]; it must be \[m\] with 2 <= m <= 4"),
])
def test_m_is_bounded_by_the_fillers_its_gaps_dtype_can_need(gaps, dtype, message):
    codec, model, wire = _topk(gaps, n=600, k=2, dtype=dtype)
    with pytest.raises(IntegrityError, match=message) as info:
        codec.check_layout(model, Layout.of(wire), round_=0)
    assert info.value.reason is Reason.LAYOUT
    _, _, fits = _topk([1, 255, 255, 5], [1, 0, 0, 1], n=600, k=2, dtype="U8")   # 2 fillers: the most U8 needs
    codec.check_layout(model, Layout.of(fits), round_=0)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_adacomp_gaps_are_checked_too(dtype):
    model = Layout.build([("w", "F32", (10,))])
    ada = uplink_codec(Up("adacomp"), seed=0)
    error = _refused(ada, model, {"w/adacomp.gaps": np.array([3, 0], dtype),
                                  "w/adacomp.scale": np.ones(1, np.float32),
                                  "w/adacomp.values": np.ones(2, np.int8)})
    assert error.reason is Reason.LAYOUT and "'w/adacomp.gaps': gap 0 at position 1 repeats index 2" in str(error)
    error = _refused(ada, model, {"w/adacomp.gaps": np.array([9, 2], dtype),
                                  "w/adacomp.scale": np.ones(1, np.float32),
                                  "w/adacomp.values": np.ones(2, np.int8)}, chunk=3)
    assert "'w/adacomp.gaps': index 10 at position 1 is out of range" in str(error)


def _sparse(codec, gaps, scale, values):
    return {f"w/{codec}.gaps": np.array(gaps, np.uint16), f"w/{codec}.scale": np.array([scale], np.float32),
            f"w/{codec}.values": np.array(values, np.int8)}


@pytest.mark.parametrize("codec_key, wire, message, reason", [
    ("int8", {"w/int8.scales": np.array([1.0], np.float32), "w/int8.values": np.array([1, -128, 0], np.int8)},
     "'w/int8.values': value -128 at position 1", Reason.LAYOUT),
    ("int8", {"w/int8.scales": np.array([np.nan], np.float32), "w/int8.values": np.zeros(3, np.int8)},
     "'w/int8.scales': scale nan at position 0", Reason.NON_FINITE),
    ("int8", {"w/int8.scales": np.array([-0.5], np.float32), "w/int8.values": np.zeros(3, np.int8)},
     "'w/int8.scales': scale -0.5 at position 0", Reason.LAYOUT),
    ("int8", {"w/int8.scales": np.array([np.inf], np.float32), "w/int8.values": np.zeros(3, np.int8)},
     "scale inf", Reason.NON_FINITE),
    ("int8", {"w/int8.scales": np.array([3e38], np.float32), "w/int8.values": np.array([0, 127, 0], np.int8)},
     "'w/int8.values': element 1 decodes to inf", Reason.NON_FINITE),
    ("adacomp", _sparse("adacomp", [1, 1], 1.0, [3, -128]),
     "'w/adacomp.values': value -128 at position 1", Reason.LAYOUT),
    ("adacomp", _sparse("adacomp", [1], -1.0, [3]), "'w/adacomp.scale': scale -1.0", Reason.LAYOUT),
    ("adacomp", _sparse("adacomp", [1], np.nan, [3]), "'w/adacomp.scale': scale nan", Reason.NON_FINITE),
    ("topk", _sparse("topk", [2], 1.0, [-128]), "'w/topk.values': value -128 at position 0", Reason.LAYOUT),
    ("topk", _sparse("topk", [2], -0.5, [3]), "'w/topk.scale': scale -0.5", Reason.LAYOUT),
    ("topk", _sparse("topk", [2], np.nan, [3]), "'w/topk.scale': scale nan", Reason.NON_FINITE),
    ("topk", _sparse("topk", [1], 3e38, [127]), "'w/topk.values': element 0 decodes to inf", Reason.NON_FINITE),
])
def test_bad_values_are_refused(codec_key, wire, message, reason):
    spec = {"int8": Up("int8", block=16), "adacomp": Up("adacomp"), "topk": Up("topk", k=1)}[codec_key]
    model = Layout.build([("w", "F32", (3,))])
    for chunk in (1, 2, 64):
        error = _refused(uplink_codec(spec, seed=0), model, wire, chunk=chunk)
        assert error.reason is reason and message in str(error), str(error)
    # decode() makes the same checks.
    with pytest.raises(IntegrityError, match=message.split(":")[0]):
        uplink_codec(spec, seed=0).decode(model, wire, round_=0)


@pytest.mark.parametrize("spec, wire, message", [
    (Up("topk", k=2), _sparse("topk", [1, 1, 1], 1.0, [1, 1, 1]),
     r"'w/topk.gaps' has shape \[3\]; it must be \[m\] with 2 <= m <= 2: k_of\(10\) = 2 entries and a filler"),
    (Up("topk", k=2), _sparse("topk", [1], 1.0, [1]), r"'w/topk.gaps' has shape \[1\]; it must be \[m\] with 2"),
    (Up("topk", k=2), _sparse("topk", [1, 1], 1.0, [1, 1, 1]),
     r"'w/topk.values' is I8\[3\]; expected I8\[2\] \(one per gap\)"),
    (Up("randk", fraction=0.5), {"w/randk.values": np.ones(4, np.float32)},
     r"'w/randk.values' is F32\[4\]; expected F32\[5\]"),
    (Up("topk", k=2), {"w/topk.scale": np.ones(1, np.float32), "w/topk.values": np.ones(2, np.int8)},
     r"lacks entr\(ies\) \['w/topk.gaps'\]"),
    (Up("topk", k=2), {"w/topk.gaps": np.ones(2, np.uint16), "w/topk.values": np.ones(2, np.int8)},
     r"lacks entr\(ies\) \['w/topk.scale'\]"),
    (Up("topk", k=2), dict(_sparse("topk", [1, 1], 1.0, [1, 1]), **{"w/topk.extra": np.ones(2, np.float32)}),
     r"has entr\(ies\) \['w/topk.extra'\]"),
    (Up("topk", k=2), dict(_sparse("topk", [1, 1], 1.0, [1, 1]), **{"w/topk.gaps": np.ones(2, np.int32)}),
     r"'w/topk.gaps' is I32\[2\]; gaps must be U8 or U16"),
    (Up("topk", k=2), dict(_sparse("topk", [1, 1], 1.0, [1, 1]), **{"w/topk.values": np.ones(2, np.float32)}),
     r"'w/topk.values' is F32\[2\]; expected I8\[2\]"),
    (Up("topk", k=2), {"w/topk.indices": np.arange(2, dtype=np.uint32), "w/topk.values": np.ones(2, np.float32)},
     r"lacks entr\(ies\) \['w/topk.gaps', 'w/topk.scale'\]"),   # the former (index, float32) format
    (Up("int8", block=16), {"w/int8.scales": np.ones(1, np.float32), "w/int8.values": np.ones(10, np.uint8)},
     r"'w/int8.values' is U8\[10\]; expected I8\[10\]"),
    (Up("int8", block=16), {"w/int8.scales": np.ones(2, np.float32), "w/int8.values": np.ones(10, np.int8)},
     r"'w/int8.scales' is F32\[2\]; expected F32\[1\]"),
    (Up("fp16"), {"w/fp16.values": np.ones(10, np.float32)}, r"'w/fp16.values' is F32\[10\]; expected F16\[10\]"),
    (Up("fp16"), {"w": np.ones(10, np.float32)}, r"lacks entr\(ies\) \['w/fp16.values'\]"),
    (Up("adacomp"), _sparse("adacomp", [1, 1], 1.0, [1, 1, 1]),
     r"'w/adacomp.values' is I8\[3\]; expected I8\[2\] \(one per gap\)"),
    (Up("adacomp"), _sparse("adacomp", [1] * 11, 1.0, [1] * 11), r"at most the tensor's 10 elements"),
    (Up("adacomp"), dict(_sparse("adacomp", [1] * 11, 1.0, [1] * 11), **{"w/adacomp.gaps": np.ones(11, np.uint8)}),
     r"\[11\]; it must be \[m\] with 0 <= m <= 10: at most the tensor's 10 elements"),
    (Up("adacomp"), dict(_sparse("adacomp", [1], 1.0, [1]), **{"w/adacomp.gaps": np.ones((1, 1), np.uint16)}),
     r"shape \[1, 1\]"),
    (Up("adacomp"), dict(_sparse("adacomp", [1], 1.0, [1]), **{"w/adacomp.scale": np.ones(2, np.float32)}),
     r"'w/adacomp.scale' is F32\[2\]; expected F32\[1\]"),
    (Up("adacomp"), dict(_sparse("adacomp", [1], 1.0, [1]), **{"w/adacomp.gaps": np.ones(1, np.uint32)}),
     r"'w/adacomp.gaps' is U32\[1\]; gaps must be U8 or U16"),
    (Up("adacomp"), dict(_sparse("adacomp", [1], 1.0, [1]), **{"w/adacomp.gaps": np.ones(1, np.int8)}),
     r"'w/adacomp.gaps' is I8\[1\]; gaps must be U8 or U16"),
    (Up("topk", k=2), dict(_sparse("topk", [1, 1], 1.0, [1, 1]), **{"w/topk.gaps": np.ones(2, np.uint32)}),
     r"'w/topk.gaps' is U32\[2\]; gaps must be U8 or U16"),
    (Up(), {"w": np.ones(10, np.float16)}, "'w' is F16"),
])
def test_bad_layouts_are_refused(spec, wire, message):
    model = Layout.build([("w", "F32", (10,))])
    codec = uplink_codec(spec, seed=0)
    with pytest.raises(IntegrityError, match=message) as info:
        codec.check_layout(model, Layout.of(wire), round_=0)
    assert info.value.reason is Reason.LAYOUT
    with pytest.raises(IntegrityError, match=message):
        codec.decoder(model, Layout.of(wire), round_=0)


def test_missing_and_extra_bytes_are_refused():
    codec, model, wire = _topk([2, 1])
    layout, blob = encode(wire)
    assert layout.total_bytes == 2 * 3 + 4
    dec = codec.decoder(model, layout, round_=0)
    list(dec.feed(blob[:-1]))
    with pytest.raises(IntegrityError, match="ended after 9 of 10 bytes") as info:
        dec.finish()
    assert info.value.reason is Reason.SIZE
    dec = codec.decoder(model, layout, round_=0)
    with pytest.raises(IntegrityError, match="more than the 10 bytes") as info:
        list(dec.feed(bytes(blob) + b"\0"))
    assert info.value.reason is Reason.SIZE


def test_each_feed_must_be_drained_before_the_next():
    codec, model, wire = _topk([2, 1])
    layout, blob = encode(wire)
    dec = codec.decoder(model, layout, round_=0)
    dec.feed(blob[:5])   # not iterated
    with pytest.raises(RuntimeError, match="iterate each feed"):
        dec.feed(blob[5:])


# Downlink ----------------------------------------------------------------------------------

def _served(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(40, 5)).astype(np.float32), "b": np.array([0.0, -0.5, 65504.0], np.float32),
            "n": np.array([4, 5], np.int64)}


def test_downlink_none_and_fp16():
    model = _served()
    layout = Layout.of(model)
    none = Down()
    same = downlink_decode(none, layout, downlink_encode(none, model))
    assert all(np.array_equal(same[k], model[k]) and same[k].dtype == model[k].dtype for k in model)
    wire = downlink_encode(Down("fp16"), model)
    assert sorted(wire) == ["b/fp16.values", "n/dense.values", "w/fp16.values"]
    assert downlink_codec(Down("fp16")).wire_layout(layout) == Layout.of(wire)
    decoded = downlink_decode(Down("fp16"), layout, wire)
    assert decoded["w"].dtype == np.float32 and np.array_equal(decoded["b"], model["b"])
    assert np.all(np.abs(decoded["w"] - model["w"]) <= np.abs(model["w"]) * 2.0 ** -11)
    assert np.array_equal(decoded["n"], model["n"]) and decoded["n"].dtype == np.int64
    with pytest.raises(IntegrityError, match="float16's range"):
        downlink_encode(Down("fp16"), {"w": np.array([1e5], np.float32)})


def test_downlink_delta8_against_the_base():
    base = _served(0)
    model = {k: (v + np.float32(0.01) * np.arange(v.size, dtype=np.float32).reshape(v.shape)
                 if v.dtype.kind == "f" else v + 1) for k, v in base.items()}
    spec = Down("delta8", block=16)
    wire = downlink_encode(spec, model, base)
    assert wire["w/delta8.values"].dtype == np.int8 and wire["w/delta8.scales"].shape == (13,)
    assert downlink_codec(spec).wire_layout(Layout.of(model)) == Layout.of(wire)
    decoded = downlink_decode(spec, Layout.of(model), wire, base)
    scale = np.repeat(wire["w/delta8.scales"], 16)[:200].reshape(40, 5).astype(np.float64)
    ulp = np.spacing(np.abs(model["w"])).astype(np.float64)
    assert np.all(np.abs(decoded["w"].astype(np.float64) - model["w"]) <= scale / 2 + ulp)
    assert np.array_equal(decoded["n"], model["n"])
    # Deterministic (round to nearest), and exact when nothing changed.
    assert all(np.array_equal(a, b) for a, b in zip(wire.values(), downlink_encode(spec, model, base).values()))
    same = downlink_decode(spec, Layout.of(base), downlink_encode(spec, base, base), base)
    assert all(np.array_equal(same[k], base[k]) for k in base)
    with pytest.raises(ValueError, match="no base for 'b'"):
        downlink_encode(spec, model, None)
    bad = dict(wire, **{"w/delta8.values": np.where(wire["w/delta8.values"] == 127, -128, 1).astype(np.int8)})
    bad["w/delta8.values"][3] = -128
    with pytest.raises(IntegrityError, match="value -128 at position"):
        downlink_decode(spec, Layout.of(model), bad, base)
    bad = dict(wire, **{"w/delta8.scales": -wire["w/delta8.scales"] - 1})
    with pytest.raises(IntegrityError, match="scale -"):
        downlink_decode(spec, Layout.of(model), bad, base)
    with pytest.raises(IntegrityError, match="lacks"):
        downlink_decode(spec, Layout.of(model), {"w/delta8.values": wire["w/delta8.values"]}, base)


def test_downlink_delta4_against_the_base():
    base = _served(0)
    model = {k: (v + np.float32(0.01) * np.arange(v.size, dtype=np.float32).reshape(v.shape)
                 if v.dtype.kind == "f" else v + 1) for k, v in base.items()}
    spec = Down("delta4", block=16)
    wire = downlink_encode(spec, model, base)
    assert sorted(wire) == ["b/delta4.scales", "b/delta4.values", "n/dense.values", "w/delta4.scales",
                            "w/delta4.values"]
    assert wire["w/delta4.values"].dtype == np.uint8 and wire["w/delta4.values"].shape == (100,)
    assert wire["b/delta4.values"].shape == (2,) and wire["w/delta4.scales"].shape == (13,)
    assert downlink_codec(spec).wire_layout(Layout.of(model)) == Layout.of(wire)
    decoded = downlink_decode(spec, Layout.of(model), wire, base)
    for name in ("w", "b"):   # round to nearest: |error| <= scale/2, plus float32 rounding of base + q·s
        scale = np.repeat(wire[f"{name}/delta4.scales"], 16)[:model[name].size].reshape(model[name].shape)
        ulp = np.spacing(np.abs(model[name])).astype(np.float64)
        error = np.abs(decoded[name].astype(np.float64) - model[name])
        assert decoded[name].dtype == np.float32 and np.all(error <= scale.astype(np.float64) / 2 + ulp)
    assert np.array_equal(decoded["n"], model["n"]) and decoded["n"].dtype == np.int64
    # Deterministic (round to nearest), and exact when nothing changed.
    assert all(np.array_equal(a, b) for a, b in zip(wire.values(), downlink_encode(spec, model, base).values()))
    same = downlink_decode(spec, Layout.of(base), downlink_encode(spec, base, base), base)
    assert all(np.array_equal(same[k], base[k]) for k in base)
    with pytest.raises(ValueError, match="delta4 sends the model as steps .* no base for 'b'"):
        downlink_encode(spec, model, None)


def test_delta4_packs_steps_as_int4_does():
    """Steps 7, −3, 1 of scale 0.1 (max|Δ| / 7): nibbles 0x7, 0xD, 0x1 and a 0 high nibble to end the odd count."""
    spec = Down("delta4", block=16)
    base = {"b": np.zeros(3, np.float32)}
    wire = downlink_encode(spec, {"b": np.array([0.7, -0.3, 0.1], np.float32)}, base)
    assert wire["b/delta4.scales"].tolist() == [np.float32(np.float32(0.7) / 7)]
    assert wire["b/delta4.values"].tolist() == [0xD7, 0x01]


@pytest.mark.parametrize("values, scales, message", [
    ([0xD8, 0x01], [0.1], r"served 'b': delta4 values: value -8 at element 0 \(byte 0, low nibble\)"),
    ([0x87, 0x01], [0.1], r"served 'b': delta4 values: value -8 at element 1 \(byte 0, high nibble\)"),
    ([0xD7, 0x11], [0.1], r"served 'b': delta4 values: the unused high nibble of byte 1 is 1"),
    ([0xD7, 0x01], [-0.5], r"served 'b': delta4 scale -0.5 at position 0"),
    ([0xD7, 0x01], [np.nan], r"served 'b': delta4 scale nan at position 0"),
])
def test_malformed_delta4_models_are_refused(values, scales, message):
    spec, layout = Down("delta4", block=16), Layout.build([("b", "F32", (3,))])
    wire = {"b/delta4.scales": np.array(scales, np.float32), "b/delta4.values": np.array(values, np.uint8)}
    with pytest.raises(IntegrityError, match=message):
        downlink_decode(spec, layout, wire, {"b": np.zeros(3, np.float32)})


@pytest.mark.parametrize("values, message", [
    (np.ones(3, np.uint8), r"'b/delta4.values'.*U8\[3\]"),          # one byte too many
    (np.ones(1, np.uint8), r"'b/delta4.values'.*U8\[1\]"),          # one byte short
    (np.ones(3, np.int8), r"'b/delta4.values'.*I8\[3\]"),           # delta8's values
])
def test_delta4_byte_counts_are_exact(values, message):
    spec, layout = Down("delta4", block=16), Layout.build([("b", "F32", (3,))])
    wire = {"b/delta4.scales": np.ones(1, np.float32), "b/delta4.values": values}
    with pytest.raises(IntegrityError, match=message):
        downlink_decode(spec, layout, wire, {"b": np.zeros(3, np.float32)})


DELTA_CODECS = sorted(c for c in DOWNLINK if is_delta(c))


def test_zero_base_is_zeros_shaped_as_the_model_and_takes_no_memory():
    layout = Layout.of(_served())
    zeros = zero_base(layout)
    assert {k: (v.shape, v.dtype) for k, v in zeros.items()} == {t.name: (t.shape, np.float32) for t in layout.tensors}
    assert all(not v.any() and not v.flags.writeable and v.strides == (0,) * v.ndim for v in zeros.values())


@pytest.mark.parametrize("codec", DELTA_CODECS)
def test_a_delta_from_zeros_decodes_to_the_same_bits_at_both_ends(codec):
    model = _served(1)
    layout, spec = Layout.of(model), Down(codec, block=16)
    wire = downlink_encode(spec, model, zero_base(layout))
    coordinator = downlink_decode(spec, layout, wire, zero_base(layout))
    # The site decodes the blob off the wire, against zeros of its own making.
    site = downlink_decode(spec, layout, decode(*encode(wire)), {t.name: np.zeros(t.shape) for t in layout.tensors})
    assert hashlib.sha256(encode(coordinator)[1]).digest() == hashlib.sha256(encode(site)[1]).digest()
    assert np.array_equal(coordinator["n"], model["n"]) and coordinator["n"].dtype == np.int64
    assert coordinator["w"].dtype == np.float32 and not np.array_equal(coordinator["w"], model["w"])


def test_delta8_from_zeros_is_q_times_scale_exactly_at_a_quarter_of_float32():
    rng = np.random.default_rng(2)
    model = {"w": rng.normal(size=(1000, 1000)).astype(np.float32)}
    layout, spec = Layout.of(model), Down("delta8")
    wire = downlink_encode(spec, model, zero_base(layout))
    chain_0 = downlink_decode(spec, layout, wire, zero_base(layout))["w"]
    q, scales = wire["w/delta8.values"], wire["w/delta8.scales"]
    assert np.array_equal(chain_0.reshape(-1), q.astype(np.float32) * np.repeat(scales, 256)[:q.size])
    assert np.abs(chain_0 - model["w"]).max() <= scales.max() / 2 * (1 + 1e-6)
    assert Layout.of(wire).total_bytes == 10**6 + 4 * 3907   # 0.254 of float32's 4 bytes a value
