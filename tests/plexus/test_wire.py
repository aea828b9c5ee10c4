"""Tests for plexus.wire: the layout, the deterministic blob and the streaming Receiver."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from plexus.errors import IntegrityError
from plexus.proto.plexus.v1 import tensor_pb2
from plexus.wire import (
    DTYPES,
    Layout,
    Receiver,
    assemble,
    chunk_limit,
    decode,
    dtype_name,
    encode,
    encode_chunks,
    iter_chunks,
)


def _extremes(name: str) -> np.ndarray:
    dtype = DTYPES[name]
    if dtype.kind == "f":
        info = np.finfo(dtype)
        values = [0.0, -0.0, 1.0, -1.5, float(info.max), float(info.min), float(info.tiny),
                  float(info.smallest_subnormal)]
    else:
        info = np.iinfo(dtype)
        values = [0, 1, int(info.max), int(info.min), int(info.max) // 3]
    return np.array(values, dtype=dtype)


def _collect(layout: Layout, blob: bytes, chunk: int) -> tuple[Receiver, bytearray]:
    """Any chunking, down to one byte per chunk (beyond the default chunk_limit, which streams keep to)."""
    sunk = bytearray()
    receiver = Receiver(layout, sink=sunk.extend, max_chunks=max(1, len(blob)))
    for offset, data in iter_chunks(blob, chunk):
        receiver.feed(offset, data)
    receiver.finish()
    return receiver, sunk


# round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_allowed_dtype_round_trips_bit_for_bit(name):
    dtype = DTYPES[name]
    values = _extremes(name)
    state = {
        "vector": values,
        "matrix": np.resize(values, (3, 4)),
        "scalar": values[2].reshape(()),
        "empty": np.zeros((0,), dtype=dtype),
        "empty2d": np.zeros((2, 0, 3), dtype=dtype),
    }

    layout, blob = encode(state)
    out = decode(layout, blob)

    assert len(blob) == layout.total_bytes == (len(values) + 12 + 1) * dtype.itemsize
    assert set(out) == set(state)
    for key, original in state.items():
        assert out[key].dtype == dtype
        assert out[key].shape == original.shape
        assert out[key].tobytes() == original.tobytes(), key
    assert {t.name: t.dtype for t in layout.tensors} == dict.fromkeys(state, name)
    assert out["scalar"].ndim == 0


def test_empty_state_and_all_empty_tensors_round_trip():
    layout, blob = encode({})
    assert (layout.tensors, blob, decode(layout, blob)) == ((), b"", {})

    layout, blob = encode({"z": np.zeros((0, 5), np.float32), "a": np.zeros((0,), np.int64)})
    out = decode(layout, blob)
    assert blob == b"" and layout.total_bytes == 0
    assert out["z"].shape == (0, 5) and out["a"].shape == (0,)


def test_key_order_of_the_state_does_not_change_the_bytes():
    rng = np.random.default_rng(7)
    items = [("w1", rng.standard_normal((3, 2)).astype(np.float32)),
             ("b1", np.arange(3, dtype=np.int64)),
             ("a0", np.array(2.5)),
             ("Z", np.zeros((2,), np.uint8))]

    reference = encode(dict(items))
    for order in (items[::-1], items[1:] + items[:1], sorted(items, key=lambda kv: kv[0])):
        assert encode(dict(order)) == reference
    assert [t.name for t in reference[0].tensors] == ["Z", "a0", "b1", "w1"]


def test_non_contiguous_and_big_endian_inputs_encode_as_little_endian_values():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = base.astype(">f4")

    assert dtype_name(big.dtype) == "F32"
    assert encode({"x": big})[1] == encode({"x": base})[1] == base.astype("<f4").tobytes()
    assert encode({"x": base.T})[1] == np.ascontiguousarray(base.T).tobytes()


# golden bytes -----------------------------------------------------------------------------

GOLDEN_BLOB = bytes.fromhex(
    "0700000000000000"  # a: I64 [[7]]            bytes 0..8
    "0000c03f"          # b[0]: F32 1.5 = 0x3FC00000  bytes 8..12
    "000000c0"          # b[1]: F32 -2.0 = 0xC0000000 bytes 12..16
)
GOLDEN_MANIFEST = bytes.fromhex(
    "0a0c" "0a0161" "1203493634" "1a020101"   # TensorSpec{name "a", dtype "I64", shape [1, 1]}
    "0a0b" "0a0162" "1203463332" "1a0102"     # TensorSpec{name "b", dtype "F32", shape [2]}
    "1010"                                    # total_bytes 16
)


def test_golden_blob_and_manifest():
    state = {"b": np.array([1.5, -2.0], np.float32), "a": np.array([[7]], np.int64)}

    layout, blob = encode(state)
    manifest = layout.to_proto()

    assert blob == GOLDEN_BLOB
    assert [(t.name, t.dtype, t.shape, t.offset, t.nbytes) for t in layout.tensors] == [
        ("a", "I64", (1, 1), 0, 8), ("b", "F32", (2,), 8, 8)]
    assert [(t.name, t.dtype, list(t.shape)) for t in manifest.tensors] == [("a", "I64", [1, 1]), ("b", "F32", [2])]
    assert manifest.total_bytes == 16
    assert manifest.SerializeToString(deterministic=True) == GOLDEN_MANIFEST
    assert Layout.from_proto(tensor_pb2.Manifest.FromString(GOLDEN_MANIFEST)) == layout


# layout validation ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["BF16", "C64", "BOOL", "f32", "", "U64"])
def test_build_refuses_a_dtype_outside_the_allowlist_and_lists_the_allowed(bad):
    with pytest.raises(IntegrityError) as err:
        Layout.build([("ok", "F32", (1,)), ("w", bad, (2,))])
    assert repr(bad) in str(err.value)
    assert str(sorted(DTYPES)) in str(err.value)


def test_build_refuses_negative_dimensions():
    with pytest.raises(IntegrityError, match=r"'w' has a negative dimension in shape \[2, -1\]"):
        Layout.build([("w", "F32", (2, -1))])


def test_build_refuses_duplicate_names():
    with pytest.raises(IntegrityError, match="twice"):
        Layout.build([("w", "F32", (2,)), ("b", "F32", (1,)), ("w", "I64", (1,))])


@pytest.mark.parametrize("name", ["", "x" * 513])
def test_build_refuses_empty_and_overlong_names(name):
    with pytest.raises(IntegrityError, match="1..512 characters"):
        Layout.build([(name, "F32", (1,))])


def test_build_sorts_by_name_and_assigns_contiguous_offsets():
    layout = Layout.build([("c", "U8", (3,)), ("a", "F64", (2,)), ("b", "I16", ())])

    assert [(t.name, t.offset) for t in layout.tensors] == [("a", 0), ("b", 16), ("c", 18)]
    assert layout.total_bytes == 21 and layout.total_elements == 6


@pytest.mark.parametrize("delta", [-1, 1, 1000])
def test_from_proto_refuses_a_wrong_total(delta):
    manifest = Layout.build([("w", "F32", (3,)), ("n", "I64", ())]).to_proto()
    manifest.total_bytes = 20 + delta

    with pytest.raises(IntegrityError, match=f"manifest says {20 + delta} bytes but its tensors need 20"):
        Layout.from_proto(manifest)


def test_from_proto_refuses_negative_dims_and_unknown_dtypes():
    negative = tensor_pb2.Manifest(tensors=[tensor_pb2.TensorSpec(name="w", dtype="F32", shape=[-4])], total_bytes=0)
    pickled = tensor_pb2.Manifest(tensors=[tensor_pb2.TensorSpec(name="w", dtype="O", shape=[1])], total_bytes=8)

    with pytest.raises(IntegrityError, match="negative"):
        Layout.from_proto(negative)
    with pytest.raises(IntegrityError, match="allowed dtypes"):
        Layout.from_proto(pickled)


MODEL = Layout.build([("fc.weight", "F32", (4, 3)), ("fc.bias", "F32", (4,)), ("steps", "I64", ())])


@pytest.mark.parametrize("other, pattern", [
    ([("fc.weight", "F32", (4, 3)), ("steps", "I64", ())], r"update lacks tensor\(s\) \['fc.bias'\]"),
    ([("fc.weight", "F32", (4, 3)), ("fc.bias", "F32", (4,)), ("steps", "I64", ()), ("extra", "U8", (1,))],
     r"update has tensor\(s\) \['extra'\] that the job's model does not have"),
    ([("fc.weight", "F32", (3, 4)), ("fc.bias", "F32", (4,)), ("steps", "I64", ())],
     r"update tensor 'fc.weight' is F32\[3, 4\]; the job's model has F32\[4, 3\]"),
    ([("fc.weight", "F32", (4, 3)), ("fc.bias", "F64", (4,)), ("steps", "I64", ())],
     r"update tensor 'fc.bias' is F64\[4\]; the job's model has F32\[4\]"),
])
def test_require_same_names_the_differing_tensor(other, pattern):
    with pytest.raises(IntegrityError, match=pattern):
        MODEL.require_same(Layout.build(other))


def test_require_same_accepts_an_equal_layout_and_uses_the_label():
    MODEL.require_same(Layout.build([("steps", "I64", ()), ("fc.bias", "F32", (4,)), ("fc.weight", "F32", (4, 3))]))

    with pytest.raises(IntegrityError, match=r"^checkpoint lacks"):
        MODEL.require_same(Layout.build([("steps", "I64", ())]), what="checkpoint")


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, object, np.bool_, "U4", "datetime64[s]", np.uint64])
def test_dtype_name_refuses_dtypes_the_wire_does_not_carry(dtype):
    with pytest.raises(TypeError, match="cannot travel on the wire"):
        dtype_name(np.dtype(dtype))


def test_encode_refuses_complex_and_object_arrays():
    with pytest.raises(TypeError):
        encode({"z": np.ones(2, np.complex64)})
    with pytest.raises(TypeError):
        encode({"o": np.array([{"pickle": "me"}], dtype=object)})


def test_decode_refuses_a_blob_of_the_wrong_size():
    layout, blob = encode({"w": np.ones(3, np.float32)})

    for bad in (blob[:-1], blob + b"\0", b""):
        with pytest.raises(IntegrityError, match="the layout needs 12"):
            decode(layout, bad)


def test_iter_chunks_covers_the_blob_and_refuses_non_positive_sizes():
    blob = bytes(range(10))

    assert [(o, bytes(d)) for o, d in iter_chunks(blob, 4)] == [(0, blob[:4]), (4, blob[4:8]), (8, blob[8:])]
    assert list(iter_chunks(b"", 4)) == []
    for size in (0, -3):
        with pytest.raises(ValueError):
            list(iter_chunks(blob, size))


# Receiver ---------------------------------------------------------------------------------

def _f32(*values: float) -> tuple[Layout, bytes]:
    return encode({"w": np.array(values, np.float32)})


def test_receiver_refuses_out_of_order_offsets():
    layout, blob = _f32(1, 2, 3, 4)
    receiver = Receiver(layout)
    receiver.feed(0, blob[:4])

    with pytest.raises(IntegrityError, match="chunk at byte 8 arrived out of order; expected byte 4"):
        receiver.feed(8, blob[8:])
    with pytest.raises(IntegrityError, match="out of order"):
        receiver.feed(0, blob[:4])    # a replayed chunk
    receiver.feed(4, blob[4:])        # the stream can still be completed in order
    receiver.finish()


def test_receiver_refuses_bytes_beyond_the_layout_and_does_not_sink_them():
    layout, blob = _f32(1, 2)
    sunk = bytearray()
    receiver = Receiver(layout, sink=sunk.extend)

    with pytest.raises(IntegrityError, match="received 9 bytes; the job's model needs exactly 8"):
        receiver.feed(0, blob + b"\0")
    receiver.feed(0, blob)
    with pytest.raises(IntegrityError, match="needs exactly 8"):
        receiver.feed(8, b"\0")
    assert bytes(sunk) == blob and receiver.received == 8


def test_receiver_refuses_an_incomplete_stream():
    layout, blob = _f32(1, 2, 3)
    receiver = Receiver(layout)
    receiver.feed(0, blob[:7])

    with pytest.raises(IntegrityError, match="stream ended after 7 of 12 bytes; the update is incomplete"):
        receiver.finish()
    with pytest.raises(IntegrityError, match="after 0 of 12"):
        Receiver(layout).finish()


def test_receiver_refuses_an_empty_chunk_even_at_the_right_offset():
    layout, blob = _f32(1, 2)
    receiver = Receiver(layout)
    receiver.feed(0, blob[:4])

    with pytest.raises(IntegrityError, match="empty chunk at byte 4; every chunk carries at least one byte"):
        receiver.feed(4, b"")


def test_receiver_takes_a_blob_in_at_most_chunk_limit_chunks():
    """ceil(total / 4 KiB) + 64: 8 KiB in 66 chunks at most, so one-byte chunks are refused at the 67th."""
    layout, blob = encode({"w": np.zeros(2048, np.float32)})
    assert chunk_limit(layout.total_bytes) == 2 + 64
    receiver = Receiver(layout)
    for offset in range(66):
        receiver.feed(offset, blob[offset:offset + 1])

    with pytest.raises(IntegrityError, match="chunk 67 at byte 66: 8192 bytes come in at most 66 chunks"):
        receiver.feed(66, blob[66:67])
    assert receiver.received == 66
    chunks = [tensor_pb2.Chunk(offset=o, data=bytes(p)) for o, p in iter_chunks(blob, 4096)]
    assert bytes(assemble(layout, chunks)) == blob   # what real senders do is far inside it


@pytest.mark.parametrize("dtype", ["F16", "F32", "F64"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_receiver_refuses_non_finite_floats(dtype, bad):
    layout, blob = encode({"a": np.ones(2, np.int32), "w": np.array([1.0, bad, 2.0], DTYPES[dtype])})
    sunk = bytearray()
    receiver = Receiver(layout, sink=sunk.extend)

    with pytest.raises(IntegrityError, match="tensor 'w' contains NaN or Inf"):
        receiver.feed(0, blob)
    assert sunk == b"" and receiver.received == 0


def test_receiver_catches_a_nan_whose_bytes_are_split_across_chunks():
    layout, blob = _f32(1.0, math.nan)
    receiver = Receiver(layout)

    receiver.feed(0, blob[:6])        # 1.0 and half of the NaN: nothing wrong yet
    with pytest.raises(IntegrityError, match="NaN or Inf"):
        receiver.feed(6, blob[6:])


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_receiver_catches_a_nan_in_the_very_last_element(chunk):
    layout, blob = encode({"a": np.arange(5, dtype=np.float64), "z": np.array([0.5, -1.0, np.nan], np.float32)})
    sunk = bytearray()
    receiver = Receiver(layout, sink=sunk.extend)
    chunks = list(iter_chunks(blob, chunk))

    for offset, data in chunks[:-1]:
        receiver.feed(offset, data)
    with pytest.raises(IntegrityError, match="tensor 'z'"):
        receiver.feed(*chunks[-1])
    assert bytes(sunk) == blob[:chunks[-1][0]]


def test_receiver_accepts_integers_whose_bytes_look_like_nan():
    nan_bits = struct.unpack("<i", struct.pack("<f", math.nan))[0]
    layout, blob = encode({"i": np.array([nan_bits, -1], np.int32), "u": np.full(8, 0xFF, np.uint8)})

    receiver, sunk = _collect(layout, blob, 3)

    assert sunk == blob
    assert receiver.max_abs == float(abs(nan_bits)) == 2143289344.0


def test_receiver_max_abs_is_zero_for_an_empty_layout_and_takes_negatives():
    layout, blob = encode({"e": np.zeros((0,), np.float32)})
    assert _collect(layout, blob, 4)[0].max_abs == 0.0

    layout, blob = encode({"i": np.array([-128, 5], np.int8), "w": np.array([-3.5], np.float32)})
    assert _collect(layout, blob, 1)[0].max_abs == 128.0


_FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_FLOAT64 = st.floats(allow_nan=False, allow_infinity=False)
_KINDS = {
    "F32": _FLOAT32, "F64": _FLOAT64, "F16": st.floats(width=16, allow_nan=False, allow_infinity=False),
    "I8": None, "I16": None, "I32": None, "I64": None, "U8": None,
}


@st.composite
def _states(draw) -> dict[str, np.ndarray]:
    state = {}
    for i in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(sorted(_KINDS)))
        shapes = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=6)
        state[f"t{i}"] = draw(hnp.arrays(DTYPES[name], shapes, elements=_KINDS[name]))  # None: any integer
    return state


@settings(max_examples=150, deadline=None, database=None)
@given(state=_states(), chunk=st.integers(1, 97))
def test_receiver_accepts_any_finite_state_in_any_chunking(state, chunk):
    layout, blob = encode(state)
    values = [abs(x) for a in state.values() for x in a.ravel().tolist()]

    receiver, sunk = _collect(layout, blob, chunk)

    assert bytes(sunk) == blob
    assert receiver.received == len(blob)
    assert receiver.max_abs == float(max(values, default=0))
    out = decode(layout, bytes(sunk))
    assert all(out[k].tobytes() == np.ascontiguousarray(v).tobytes() for k, v in state.items())


def test_a_model_larger_than_a_chunk_by_an_odd_number_of_bytes_round_trips():
    chunk = 64
    rng = np.random.default_rng(3)
    state = {"big": rng.integers(0, 256, 3 * chunk + 7, dtype=np.uint8),   # odd size: "w" starts unaligned
             "w": rng.standard_normal((5, 3)).astype(np.float32)}
    layout, blob = encode(state)
    chunks = list(iter_chunks(blob, chunk))

    receiver, sunk = _collect(layout, blob, chunk)
    out = decode(layout, bytes(sunk))

    assert layout.total_bytes == 3 * chunk + 7 + 60 == len(blob)
    assert [len(d) for _, d in chunks] == [64, 64, 64, 64, 3]
    assert np.array_equal(out["big"], state["big"]) and np.array_equal(out["w"], state["w"])
    assert receiver.max_abs == max(255.0, float(np.abs(state["w"]).max()))


@pytest.mark.parametrize("chunk_bytes", [1, 5, 64, 1000, 4096, 1 << 20])
def test_encode_chunks_yields_exactly_the_chunks_of_the_encoded_blob(chunk_bytes):
    rng = np.random.default_rng(1)
    state = {"b": rng.standard_normal((3, 7)).astype(np.float32), "a": np.arange(5, dtype=np.int64),
             "c": rng.standard_normal(0).astype(np.float64), "d": rng.standard_normal(1000).astype(np.float16)}
    layout, blob = encode(state)
    streamed_layout, chunks = encode_chunks(state, chunk_bytes)
    assert streamed_layout == layout
    assert list(chunks) == [(offset, bytes(piece)) for offset, piece in iter_chunks(blob, chunk_bytes)]


def test_encode_chunks_never_holds_more_than_a_few_chunks():
    """A site streams its update from the tensors themselves: no model-sized buffer (encode() + iter_chunks
    peaks at the whole 32 MB here; this at the chunk being built, its copy and the one the caller holds)."""
    import tracemalloc

    state = {f"t{i}": np.full(1_000_003 + i, i, np.float32) for i in range(8)}   # 32 MB, odd tensor edges
    chunk = 1 << 20
    tracemalloc.start()
    try:
        _, chunks = encode_chunks(state, chunk)
        total = sum(len(data) for _, data in chunks)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == sum(a.nbytes for a in state.values())
    assert peak < 4 * chunk, peak


def test_assemble_into_reuses_the_buffer_and_checks_its_size():
    state = {"w": np.arange(10, dtype=np.float32)}
    layout, blob = encode(state)
    buffer = bytearray(layout.total_bytes)
    chunks = [type("Chunk", (), {"offset": o, "data": bytes(p)})() for o, p in iter_chunks(blob, 64 * 1024)]

    out = assemble(layout, chunks, into=buffer)

    assert out is buffer and bytes(buffer) == bytes(blob)
    with pytest.raises(ValueError, match="the buffer has 39 bytes; the layout needs 40"):
        assemble(layout, chunks, into=bytearray(39))


@pytest.mark.parametrize("total, cap, expected", [
    (0, 1 << 20, 1 << 16),                  # never below 64 KiB
    (4_000_000, 1 << 20, 256 * 1024),       # a 1M-parameter model: 16 chunks of 256 KiB
    (16 * (1 << 20), 1 << 20, 1 << 20),     # exactly 16 MiB: the cap
    (200_000_000, 1 << 20, 1 << 20),        # large models: the cap
    (200_000_000, 1 << 22, 1 << 22),
    (2_000_001, 1 << 20, 128 * 1024),       # rounded up to a multiple of 64 KiB
])
def test_chunk_size_gives_small_models_small_chunks(total, cap, expected):
    from plexus.wire import chunk_size

    size = chunk_size(total, cap)

    assert size == expected and size % (1 << 16) == 0
    assert total == 0 or -(-total // size) >= min(16, -(-total // cap))
