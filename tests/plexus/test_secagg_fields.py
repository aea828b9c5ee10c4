"""Secure aggregation's small fields and masked plans: exact sums mod 2**m at the bounds, unbiased stochastic
rounding, the PRG's m-bit words, and what each uplink codec masks."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexus import crypto
from plexus.config import MIN_GRID_LEVELS, UplinkSpec, max_secure_sites
from plexus.secagg import Field, frac_bits, mask_plan, quantize
from plexus.wire import Layout

SEED = bytes(range(32))


def _weights(rng: np.random.Generator, n: int) -> np.ndarray:
    """n weights in (0, 1] summing to at most 1, as num_samples / total_weight."""
    samples = rng.integers(1, 1000, n)
    return samples / samples.sum()


@pytest.mark.parametrize("bits", [8, 16])
def test_the_grid_leaves_room_for_every_sites_rounding(bits):
    assert Field.grid(bits, 1.0, 3).levels == 2 ** (bits - 1) - 1 - 3
    assert max_secure_sites({8: "int8", 16: "fp16"}[bits]) == 2 ** (bits - 1) - 1 - MIN_GRID_LEVELS
    most = max_secure_sites({8: "int8", 16: "fp16"}[bits])
    assert Field.grid(bits, 1.0, most).levels == MIN_GRID_LEVELS
    with pytest.raises(ValueError, match=f"at most {most} sites"):
        Field.grid(bits, 1.0, most + 1)
    assert max_secure_sites("none") is None and max_secure_sites("randk") is None


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 16]), n=st.integers(1, 111), seed=st.integers(0, 2**32 - 1),
       extreme=st.booleans(), clip=st.sampled_from([0.01, 1.0, 3.0]))
def test_the_sum_mod_2_pow_m_is_the_exact_sum_even_at_the_bounds(bits, n, seed, extreme, clip):
    rng = np.random.default_rng(seed)
    field = Field.grid(bits, clip, n)
    weights = _weights(rng, n)
    sign = rng.choice([-1.0, 1.0])
    total = np.zeros(64, field.dtype)
    exact = np.zeros(64, np.int64)
    for w in weights:
        # at the bounds: every site at ±clip (and beyond, which is clipped), all the same sign
        delta = sign * clip * (1 + rng.random(64)) if extreme else rng.uniform(-2 * clip, 2 * clip, 64)
        q = field.quantize(delta, w, rng)
        assert q.dtype == field.dtype
        total += q                                            # wraps mod 2**bits
        exact += q.view(np.int8 if bits == 8 else np.int16)   # the plain integer sum
    assert np.abs(exact).max() <= field.levels + n - 1 <= 2 ** (bits - 1) - 2
    np.testing.assert_array_equal(field.dequantize(total), exact * (clip / field.levels))
    if extreme:   # all at +clip (or -clip): the sum is Σ w·L = L, off by at most the n roundings
        assert np.abs(exact - sign * field.levels).max() <= n


@pytest.mark.parametrize(("bits", "value"), [(8, 0.3), (8, -0.77), (16, 0.123456), (16, -0.999)])
def test_stochastic_rounding_is_unbiased(bits, value):
    field = Field.grid(bits, 1.0, 4)
    weight, count = 0.5, 200_000
    x = value * weight * field.levels          # in grid units; not on the grid
    frac = x - np.floor(x)
    q = field.quantize(np.full(count, value), weight, np.random.default_rng(7))
    got = q.view(np.int8 if bits == 8 else np.int16).astype(np.float64)
    assert set(np.unique(got)) == {np.floor(x), np.floor(x) + 1}
    sd = np.sqrt(frac * (1 - frac) / count)    # of the mean of `count` Bernoulli(frac) roundings
    assert abs(got.mean() - x) < 5 * sd, (got.mean(), x, sd)
    # rounding to nearest would be off by min(frac, 1 - frac) every time
    assert abs(got.mean() - x) < min(frac, 1 - frac) / 10


def test_values_on_the_grid_are_exact_and_rounding_uses_os_randomness_by_default():
    field = Field.grid(8, 1.0, 3)                                    # L = 124
    on_grid = np.array([-1.0, -0.5, 0.0, 0.25, 1.0, 7.0])             # 7 is clipped to 1
    np.testing.assert_array_equal(field.quantize(on_grid, 1.0).view(np.int8), [-124, -62, 0, 31, 124, 124])
    off = np.full(4096, 0.5 / 124)                                   # half a grid step
    a, b = field.quantize(off, 1.0), field.quantize(off, 1.0)
    assert set(np.unique(a)) == {0, 1} and not np.array_equal(a, b)  # two fresh draws


def test_the_32_bit_field_is_todays_fixed_point_bit_for_bit():
    field = Field.fixed(4.0, frac_bits(4.0))
    delta = np.random.default_rng(0).normal(0, 2, 1000)
    np.testing.assert_array_equal(field.quantize(delta, 0.25), quantize(delta, 0.25, 4.0, frac_bits(4.0)))
    assert field.dtype == np.uint32 and field.wire_dtype == "U32" and field.holds(10 ** 6)


def test_a_field_refuses_what_could_wrap():
    with pytest.raises(ValueError):
        Field(8, 1.0, levels=127)                 # no room for a single site's rounding
    with pytest.raises(ValueError):
        Field(32, 1.0, frac_bits=frac_bits(1.0) + 1)
    with pytest.raises(ValueError):
        Field(12, 1.0, levels=100)
    assert Field.grid(8, 1.0, 6).holds(6) and not Field.grid(8, 1.0, 3).holds(6)
    with pytest.raises(TypeError, match="uint8"):
        Field.grid(8, 1.0, 3).dequantize(np.zeros(3, np.uint32))


# --- the PRG's m-bit words ------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_prg_words_are_one_keystream_cut_into_words(bits):
    stream = crypto.prg_words(SEED, 1024 * 32 // bits, bits)
    assert stream.dtype == {8: np.uint8, 16: np.uint16, 32: np.uint32}[bits] and stream.flags.writeable
    assert stream.tobytes() == crypto.prg_uint32(SEED, 1024).tobytes()      # the same bytes at every width
    for start, count in ((0, 5), (3, 17), (15, 1), (33, 100)):
        np.testing.assert_array_equal(crypto.prg_words(SEED, count, bits, start=start), stream[start:start + count])
    with pytest.raises(ValueError, match="bits"):
        crypto.prg_words(SEED, 4, 64)


# --- what each uplink codec masks -----------------------------------------------

MODEL = Layout.of({"fc.weight": np.zeros((20, 50), np.float32), "fc.bias": np.zeros(20, np.float32)})


@pytest.mark.parametrize(("codec", "dtype", "bits"), [("none", "U32", 32), ("int8", "U8", 8), ("fp16", "U16", 16)])
def test_dense_codecs_mask_every_element_in_their_field(codec, dtype, bits):
    plan = mask_plan(None if codec == "none" else UplinkSpec(codec=codec), MODEL, seed=1, round_=2)
    assert [(t.name, t.dtype, t.shape) for t in plan.layout().tensors] == [
        ("fc.bias", dtype, (20,)), ("fc.weight", dtype, (20, 50))]
    assert plan.bits == bits and plan.layout().total_bytes == MODEL.total_elements * bits // 8


def test_randk_masks_the_same_k_indices_at_every_site_and_scatters_the_sum_back():
    spec = UplinkSpec(codec="randk", fraction=0.1)
    plan = mask_plan(spec, MODEL, seed=5, round_=3)
    again = mask_plan(spec, MODEL, seed=5, round_=3)        # another site, or the coordinator
    assert [(t.name, t.dtype, t.shape) for t in plan.layout().tensors] == [
        ("fc.bias", "U32", (2,)), ("fc.weight", "U32", (100,))]
    for idx, other in zip(plan.indices, again.indices):
        np.testing.assert_array_equal(idx, other)
        assert np.all(np.diff(idx) > 0) and idx[0] >= 0
    assert not np.array_equal(plan.indices[1], mask_plan(spec, MODEL, seed=5, round_=4).indices[1])   # per round
    assert plan.indices[1][-1] < 1000
    delta = {"fc.bias": np.arange(20, dtype=np.float64), "fc.weight": np.arange(1000, dtype=np.float64).reshape(20, 50)}
    picked = np.concatenate(list(plan.values(delta)))
    np.testing.assert_array_equal(picked, np.concatenate([plan.indices[0], plan.indices[1]]))
    dense = plan.dense(picked)
    for t, idx in zip(MODEL.tensors, plan.indices):
        d = delta[t.name]
        expect = np.zeros(t.numel)
        expect[idx] = d.reshape(-1)[idx]
        np.testing.assert_array_equal(dense[t.name].reshape(-1), expect)
        assert dense[t.name].shape == t.shape
    assert mask_plan(UplinkSpec(codec="randk", k=30), MODEL, seed=5, round_=3).layout().tensors[0].shape == (20,)


def test_codecs_that_choose_their_own_coordinates_cannot_be_masked():
    with pytest.raises(ValueError, match="cannot be masked"):
        mask_plan(UplinkSpec(codec="topk", k=3), MODEL, seed=0, round_=1)


# --- a rule's update extras -------------------------------------------------------

EXTRAS = Layout.build([("exact/grad", "F64", (3,)), ("exact/rows", "F64", (1,)), ("zz/extra", "F32", (2, 2))])


def test_extras_are_masked_whole_beside_the_model_in_layout_order():
    plan = mask_plan(None, MODEL, seed=1, round_=2, extras=EXTRAS)
    # Layout order over model and extras together, as the plain path lays out an update (sorted by name)
    assert [(t.name, t.dtype, t.shape) for t in plan.layout().tensors] == [
        ("exact/grad", "U32", (3,)), ("exact/rows", "U32", (1,)), ("fc.bias", "U32", (20,)),
        ("fc.weight", "U32", (20, 50)), ("zz/extra", "U32", (2, 2))]
    update = {"fc.weight": np.full((20, 50), 3.0), "zz/extra": np.full((2, 2), 5.0), "fc.bias": np.full(20, 2.0),
              "exact/rows": np.array([42.0]), "exact/grad": np.array([1.0, -2.0, 0.5])}
    flat = np.concatenate(list(plan.values(update)))   # the dict's own order does not matter
    np.testing.assert_array_equal(flat, np.concatenate(
        [[1.0, -2.0, 0.5], [42.0], np.full(20, 2.0), np.full(1000, 3.0), np.full(4, 5.0)]))
    dense = plan.dense(flat)
    assert sorted(dense) == sorted(update)
    for name, value in update.items():
        np.testing.assert_array_equal(dense[name], value)


def test_extras_are_whole_under_randk_and_refused_on_a_small_grid():
    plan = mask_plan(UplinkSpec(codec="randk", k=5), MODEL, seed=5, round_=3, extras=EXTRAS)
    shapes = {t.name: t.shape for t in plan.layout().tensors}
    assert shapes == {"exact/grad": (3,), "exact/rows": (1,), "fc.bias": (5,), "fc.weight": (5,), "zz/extra": (2, 2)}
    plain = mask_plan(UplinkSpec(codec="randk", k=5), MODEL, seed=5, round_=3)   # the model's indices unchanged
    np.testing.assert_array_equal(plan.indices[3], plain.indices[1])
    for codec in ("int8", "fp16"):
        with pytest.raises(ValueError, match="too coarse for the strategy's update extras"):
            mask_plan(UplinkSpec(codec=codec), MODEL, seed=5, round_=3, extras=EXTRAS)


def test_an_update_that_differs_from_the_plan_is_refused():
    plan = mask_plan(None, MODEL, seed=1, round_=2, extras=EXTRAS)
    model_only = {"fc.weight": np.zeros((20, 50)), "fc.bias": np.zeros(20)}
    with pytest.raises(ValueError, match=r"missing: \['exact/grad', 'exact/rows', 'zz/extra'\]"):
        list(plan.values(model_only))
    with pytest.raises(ValueError, match="has 3 elements in the update; the layout has 1"):
        list(plan.values({**model_only, "exact/grad": np.zeros(3), "exact/rows": np.zeros(3),
                          "zz/extra": np.zeros(4)}))
    with pytest.raises(ValueError, match="names of model tensors"):
        mask_plan(None, MODEL, seed=1, round_=2, extras=Layout.build([("fc.bias", "F64", (20,))]))
