"""Tests for plexus.dp: exact clipping, keystream Gaussian noise, noise keys and the distributed split."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexus.dp import (
    Distance,
    GaussianNoise,
    add_noise,
    central_std,
    check_clipped,
    clip_update,
    distributed_std,
    noise_key,
)
from plexus.errors import IntegrityError
from plexus.wire import encode

KEY = bytes(range(32))


def _norm(tensors: dict) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in tensors.values()))


def test_clip_scales_to_exactly_the_clip_norm():
    delta = {"a": np.array([3.0, 0.0]), "b": np.array([[0.0, 4.0]])}  # global norm 5
    clipped, norm = clip_update(delta, 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0])
    np.testing.assert_allclose(clipped["b"], [[0.0, 0.8]])
    assert _norm(clipped) == pytest.approx(1.0, abs=1e-12)
    assert delta["a"][0] == 3.0  # the input is not modified


def test_clip_leaves_small_updates_untouched():
    delta = {"w": np.array([0.1, -0.2], dtype=np.float32)}
    clipped, norm = clip_update(delta, 1.0)
    np.testing.assert_array_equal(clipped["w"], delta["w"])
    assert clipped["w"].dtype == np.float32 and clipped["w"] is not delta["w"]
    assert norm == pytest.approx(math.sqrt(0.05), rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=40),
       st.floats(1e-3, 1e3))
def test_clipped_norm_never_exceeds_the_bound_even_in_float32(values, clip):
    delta = {"w": np.array(values, dtype=np.float32), "b": np.array(values[::-1], dtype=np.float32)}
    clipped, norm = clip_update(delta, clip)
    assert _norm(clipped) <= clip
    if norm > clip:
        assert _norm(clipped) == pytest.approx(clip, rel=1e-5)
        assert all(v.dtype == np.float32 for v in clipped.values())


def test_clip_rejects_nan_int_tensors_and_bad_norms():
    with pytest.raises(IntegrityError, match="NaN or infinite"):
        clip_update({"w": np.array([np.nan])}, 1.0)
    with pytest.raises(TypeError, match="only float tensors"):
        clip_update({"steps": np.array([3])}, 1.0)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="clip_norm"):
            clip_update({"w": np.ones(2)}, bad)


def test_noise_std_matches_z_times_s():
    z, s, n = 1.3, 0.7, 200_000
    draw = GaussianNoise(KEY).sample(n, z * s)
    # The sample std of n normals has standard error σ/√(2n) ≈ 0.0014 here: 5 SE of tolerance.
    assert abs(draw.std() - z * s) < 5 * z * s / math.sqrt(2 * n)
    assert abs(draw.mean()) < 5 * z * s / math.sqrt(n)
    # Shape, not just scale: the fraction within one σ is 68.27%.
    assert abs(np.mean(np.abs(draw) < z * s) - 0.6827) < 0.005


def test_noise_is_deterministic_per_key_and_chunkable():
    noise = GaussianNoise(KEY)
    whole = noise.sample(101, 2.0)
    np.testing.assert_array_equal(whole, GaussianNoise(KEY).sample(101, 2.0))
    for start, count in ((0, 1), (1, 1), (3, 50), (50, 51), (100, 1), (7, 0)):
        np.testing.assert_array_equal(noise.sample(count, 2.0, start=start), whole[start:start + count])
    assert not np.array_equal(whole, GaussianNoise(bytes(32)).sample(101, 2.0))
    np.testing.assert_array_equal(noise.sample(5, 0.0), np.zeros(5))
    assert whole.dtype == np.float64


def test_noise_rejects_bad_arguments():
    with pytest.raises(ValueError, match="32 bytes"):
        GaussianNoise(b"short")
    with pytest.raises(ValueError, match="std"):
        GaussianNoise(KEY).sample(3, -1.0)
    with pytest.raises(ValueError, match="start"):
        GaussianNoise(KEY).sample(3, 1.0, start=-1)


def test_noise_key_is_reproducible_with_a_seed_and_unpredictable_without():
    a = noise_key(7, "job-1", 3, "coordinator")
    assert len(a) == 32 and a == noise_key(7, "job-1", 3, "coordinator")
    others = {noise_key(8, "job-1", 3, "coordinator"), noise_key(7, "job-2", 3, "coordinator"),
              noise_key(7, "job-1", 4, "coordinator"), noise_key(7, "job-1", 3, "site-a")}
    assert a not in others and len(others) == 4
    assert noise_key(None, "job-1", 3, "coordinator") != noise_key(None, "job-1", 3, "coordinator")
    with pytest.raises(ValueError, match="job_seed"):
        noise_key(-1, "job", 1, "x")


def test_add_noise_draws_one_stream_in_sorted_name_order():
    tensors = {"b": np.zeros((2, 3), dtype=np.float32), "a": np.ones(4)}
    noised = add_noise(tensors, 0.5, KEY)
    stream = GaussianNoise(KEY).sample(10, 0.5)
    np.testing.assert_allclose(noised["a"], 1.0 + stream[:4])
    np.testing.assert_allclose(noised["b"], stream[4:].reshape(2, 3).astype(np.float32))
    assert noised["b"].dtype == np.float32


def test_distributed_noise_sums_to_the_central_std():
    z, s, sites, n = 1.1, 2.0, 4, 100_000
    std = distributed_std(z, s, sites)
    assert std == pytest.approx(z * s / 2)
    total = sum(GaussianNoise(noise_key(0, "job", 1, f"site-{i}")).sample(n, std) for i in range(sites))
    assert abs(total.std() - z * s) < 5 * z * s / math.sqrt(2 * n)
    with pytest.raises(ValueError, match="n_sites"):
        distributed_std(1.0, 1.0, 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.integers(0, 2 ** 32 - 1))
def test_the_streamed_distance_equals_the_whole_update_norm_wherever_the_pieces_split(step, seed):
    rng = np.random.default_rng(seed)
    current = {"a": rng.normal(size=7).astype(np.float32), "b": rng.normal(size=(3, 5)).astype(np.float32)}
    update = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in current.items()}
    layout, blob = encode(update)
    distance = Distance(layout, current)
    for i in range(0, len(blob), step):
        distance.add(blob[i:i + step])
    whole = math.sqrt(sum(float(np.sum((update[k].astype(np.float64) - current[k]) ** 2)) for k in current))
    assert distance.norm == pytest.approx(whole, rel=1e-12)


def test_the_clip_check_allows_float_slack_and_refuses_beyond_it():
    check_clipped(1.0 + 0.9e-6, 1.0)
    with pytest.raises(IntegrityError, match="beyond dp.clip_norm 1.0; differential privacy needs every site"):
        check_clipped(1.0 + 2e-6, 1.0)


def test_central_noise_on_the_mean_is_z_s_over_m():
    assert central_std(1.5, 2.0, 4) == 0.75
