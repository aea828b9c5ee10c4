"""Client-level differential privacy (DP-FedAvg): clip each update, add seeded Gaussian noise to the sum.

Pure numpy over named tensors, no I/O. Noise comes from an AES-256-CTR keystream
(plexus.crypto.prg_uint32) turned into normals with Box-Muller, so it is
unpredictable without the key and bit-for-bit reproducible with it.
"""

from __future__ import annotations

import json
import math
import numbers
import secrets
from collections.abc import Mapping

import numpy as np

from plexus.crypto import KEY_BYTES, hkdf, prg_uint32
from plexus.errors import IntegrityError, Reason
from plexus.wire import DTYPES, Layout

DP_NOISE = b"plexus/v1/dp-noise"
# What logs, events and `plexus job show/metrics` say about a run with privacy.dp.reproducible_noise.
NOT_PRIVATE = ("privacy.dp.reproducible_noise is on: the central noise is derived from the job's config, so "
               "anyone who can read the config can remove it; this run is NOT differentially private")

_WORDS_PER_PAIR = 4  # two 53-bit uniforms (two uint32 each) give two normals
_TWO_53 = float(1 << 53)


def clip_update(delta: Mapping[str, np.ndarray], clip_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """Scale the whole update by min(1, S/‖Δ‖₂) (one norm over all tensors); returns (clipped, original norm).

    The clipped norm is guaranteed <= clip_norm after rounding to the tensors' own dtype.
    """
    clip_norm = _positive(clip_norm, "clip_norm")
    arrays = {}
    for name, value in delta.items():
        value = np.asarray(value)
        if value.dtype.kind != "f":
            raise TypeError(f"update tensor {name!r} has dtype {value.dtype}; only float tensors can be clipped "
                            "(leave integer buffers out of the update)")
        arrays[name] = value
    norm = _global_norm(arrays)
    if not math.isfinite(norm):
        raise IntegrityError("the update contains NaN or infinite values; it cannot be clipped or aggregated")
    if norm <= clip_norm:
        return {name: value.copy() for name, value in arrays.items()}, norm
    scale = clip_norm / norm
    while True:
        clipped = {name: (value.astype(np.float64) * scale).astype(value.dtype) for name, value in arrays.items()}
        # Rounding to float32 can land a hair above S; shrink until the bound holds exactly.
        if _global_norm(clipped) <= clip_norm:
            return clipped, norm
        scale *= 1.0 - 1e-6


class GaussianNoise:
    """Deterministic N(0, std²) draws from the AES-CTR keystream keyed by `key` (32 bytes)."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"the noise key must be {KEY_BYTES} bytes; derive it with plexus.dp.noise_key")
        self._key = bytes(key)

    def sample(self, count: int, std: float, *, start: int = 0) -> np.ndarray:
        """Normals [start, start+count) of this key's stream, times std; any window equals a slice of a longer draw."""
        count, start = _count(count, "count"), _count(start, "start")
        std = _non_negative(std, "std")
        if count == 0:
            return np.zeros(0, dtype=np.float64)
        first, last = start // 2, (start + count - 1) // 2
        words = prg_uint32(self._key, _WORDS_PER_PAIR * (last - first + 1), start=_WORDS_PER_PAIR * first)
        w = words.reshape(-1, _WORDS_PER_PAIR).astype(np.uint64)
        # 53-bit uniforms as in numpy's random_standard_uniform: (a >> 5) * 2^26 + (b >> 6).
        u1 = (((w[:, 0] >> np.uint64(5)) << np.uint64(26)) + (w[:, 1] >> np.uint64(6)) + np.uint64(1)) / _TWO_53
        u2 = (((w[:, 2] >> np.uint64(5)) << np.uint64(26)) + (w[:, 3] >> np.uint64(6))) / _TWO_53
        radius = np.sqrt(-2.0 * np.log(u1))  # u1 in (0, 1]: never log(0)
        angle = 2.0 * np.pi * u2
        normals = np.empty(2 * len(w), dtype=np.float64)
        normals[0::2] = radius * np.cos(angle)
        normals[1::2] = radius * np.sin(angle)
        offset = start - 2 * first
        return normals[offset:offset + count] * std


def noise_key(job_seed: int | None, job_id: str, round_: int, party: str) -> bytes:
    """The 32-byte noise key of one party ("coordinator" or a site) in one round of one job.

    With job_seed None the key comes from 32 fresh OS-random bytes: nobody can
    predict or remove the noise. With a job seed the run is reproducible, and the
    noise is predictable to anyone who knows that seed: a job seed weakens DP
    against whoever knows it (e.g. the coordinator, which stores the job config).
    """
    if job_seed is None:
        secret = secrets.token_bytes(KEY_BYTES)
    else:
        if isinstance(job_seed, bool) or not isinstance(job_seed, numbers.Integral) or not 0 <= job_seed < 1 << 64:
            raise ValueError(f"job_seed must be an integer in [0, 2**64) or None, got {job_seed!r}")
        secret = b"plexus/v1/job-seed" + int(job_seed).to_bytes(8, "big")
    if isinstance(round_, bool) or not isinstance(round_, numbers.Integral) or round_ < 0:
        raise ValueError(f"round_ must be a non-negative integer, got {round_!r}")
    context = json.dumps([str(job_id), int(round_), str(party)], separators=(",", ":")).encode()
    return hkdf(secret, info=DP_NOISE + b"\x00" + context)


def add_noise(tensors: Mapping[str, np.ndarray], std: float, key: bytes) -> dict[str, np.ndarray]:
    """A copy of `tensors` plus N(0, std²) per element, drawn in sorted-name order from one keystream."""
    noise, offset, out = GaussianNoise(key), 0, {}
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        if value.dtype.kind != "f":
            raise TypeError(f"tensor {name!r} has dtype {value.dtype}; noise can only be added to float tensors")
        draw = noise.sample(value.size, std, start=offset).reshape(value.shape)
        out[name] = (value.astype(np.float64) + draw).astype(value.dtype)
        offset += value.size
    return out


def distributed_std(noise_multiplier: float, clip_norm: float, n_sites: int) -> float:
    """Per-site noise std so that the sum of n independent site noises has std zS: zS/√n.

    If fewer than n sites survive a round the sum carries less noise than zS, so
    pass the smallest number of sites that can make up the aggregate (sites.min).
    """
    z = _non_negative(noise_multiplier, "noise_multiplier")
    s = _positive(clip_norm, "clip_norm")
    if isinstance(n_sites, bool) or not isinstance(n_sites, numbers.Integral) or n_sites < 1:
        raise ValueError(f"n_sites must be a positive integer, got {n_sites!r}")
    return z * s / math.sqrt(int(n_sites))


def central_std(noise_multiplier: float, clip_norm: float, contributors: int) -> float:
    """Central DP-FedAvg's noise std on the mean of `contributors` clipped updates: N(0, (zS)²) on their
    sum is std zS/m on their mean."""
    return noise_multiplier * clip_norm / contributors


def check_clipped(norm: float, clip_norm: float) -> None:
    """Refuse an update farther than clip_norm (with float tolerance 1e-6) from the global model it trained from."""
    if norm > clip_norm * (1 + 1e-6):
        raise IntegrityError(f"update is {norm:.6g} from the global model, beyond dp.clip_norm {clip_norm}; "
                             "differential privacy needs every site to clip its update", reason=Reason.NORM)


class Distance:
    """‖x − current‖₂ over an update blob of `layout` fed in consecutive pieces (split anywhere), so the
    clip check needs no second pass over the update. Every tensor of the layout must be in `current`."""

    def __init__(self, layout: Layout, current: Mapping[str, np.ndarray]):
        self._tensors = [(t, DTYPES[t.dtype], np.asarray(current[t.name]).reshape(-1)) for t in layout.tensors]
        self._position = 0            # blob bytes taken in, whole elements only
        self._pending = bytearray()   # the bytes of an element split by a piece edge
        self._tensor = 0
        self._squared = 0.0

    def add(self, piece: bytes | memoryview) -> None:
        data = memoryview(piece).cast("B")
        if self._pending:
            self._pending += data
            data = memoryview(bytes(self._pending))
            self._pending.clear()
        used = 0
        while used < len(data) and self._tensor < len(self._tensors):
            t, dtype, ref = self._tensors[self._tensor]
            start = self._position - t.offset
            n = min(t.nbytes - start, len(data) - used) // dtype.itemsize
            if n == 0 and start < t.nbytes:
                break
            if n:
                x = np.frombuffer(data, dtype=dtype, count=n, offset=used).astype(np.float64)
                first = start // dtype.itemsize
                self._squared += float(np.sum((x - ref[first:first + n]) ** 2))
                used += n * dtype.itemsize
                self._position += n * dtype.itemsize
            if self._position == t.offset + t.nbytes:
                self._tensor += 1
        self._pending += data[used:]

    @property
    def norm(self) -> float:
        return self._squared ** 0.5


def _global_norm(arrays: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays.values()))


def _count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _non_negative(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _positive(value: float, name: str) -> float:
    if _non_negative(value, name) == 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)
