"""The tensor wire format: name/dtype/shape manifests plus raw little-endian bytes.

A model travels as a *layout* (tensors sorted by name) and one blob, the
concatenation of the tensors' bytes in layout order, cut into chunks. Nothing is
ever pickled; decoding checks every byte against the expected layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from plexus.errors import IntegrityError, Reason
from plexus.proto.plexus.v1 import tensor_pb2

# safetensors dtype names -> little-endian numpy dtypes. Anything else is refused.
DTYPES: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),   # secure aggregation's masked vectors in a 16-bit field (fp16 under secagg)
    "U32": np.dtype("<u4"),   # secure aggregation's masked vectors (integers mod 2**32)
}
_NAMES = {dt: name for name, dt in DTYPES.items()}
FLOAT_DTYPES = ("F16", "F32", "F64")

# Strategy tensors that travel beside the model (SCAFFOLD): the server control variate c, served
# with the model, and each site's change Δc, sent with its update; both float32, per float tensor.
SCAFFOLD_C, SCAFFOLD_DC = "scaffold/c/", "scaffold/dc/"
# The exact strategies' update extras (lbfgs, newton): float64 SUMS over a site's training rows at the served
# weights (plexus.objectives): Σ∇ℓ_i [d], Σℓ_i [1], the row count [1], and for newton Σ∇²ℓ_i [d, d].
EXACT_GRAD, EXACT_LOSS, EXACT_ROWS, EXACT_HESSIAN = "exact/grad", "exact/loss", "exact/rows", "exact/hessian"

DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 1 << 16
CHUNKS_PER_MODEL = 16
# A receiver takes a blob in at most chunk_limit(total) chunks: every message costs the receiver a
# fixed amount of work whatever it carries, so a stream of empty or one-byte chunks would cost it
# seconds of CPU per megabyte. Senders here use chunks of 64 KiB and up (chunk_size).
MIN_AVERAGE_CHUNK_BYTES = 4096
SPARE_CHUNKS = 64
MAX_TENSORS = 100_000
MAX_NAME_LEN = 512


def chunk_limit(total_bytes: int) -> int:
    """The most chunks a blob of total_bytes may arrive in: ceil(total / 4 KiB) + 64."""
    return -(-total_bytes // MIN_AVERAGE_CHUNK_BYTES) + SPARE_CHUNKS


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype; TypeError for dtypes the wire does not carry."""
    name = _NAMES.get(np.dtype(dtype).newbyteorder("<"))
    if name is None:
        raise TypeError(f"dtype {dtype} cannot travel on the wire; use one of {sorted(DTYPES)}")
    return name


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a layout: where its bytes sit in the blob."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Layout:
    """The tensors of a model, sorted by name, with their blob offsets."""

    tensors: tuple[TensorMeta, ...]

    @property
    def total_bytes(self) -> int:
        return self.tensors[-1].offset + self.tensors[-1].nbytes if self.tensors else 0

    @property
    def total_elements(self) -> int:
        return sum(t.numel for t in self.tensors)

    @classmethod
    def build(cls, specs: list[tuple[str, str, tuple[int, ...]]]) -> Layout:
        """Validate (name, dtype, shape) triples and lay them out in name order."""
        if len(specs) > MAX_TENSORS:
            raise IntegrityError(f"manifest lists {len(specs)} tensors; at most {MAX_TENSORS} are allowed",
                                 reason=Reason.LAYOUT)
        names = [s[0] for s in specs]
        if len(set(names)) != len(names):
            raise IntegrityError("manifest lists a tensor name twice; names must be unique", reason=Reason.LAYOUT)
        tensors, offset = [], 0
        for name, dtype, shape in sorted(specs):
            if not name or len(name) > MAX_NAME_LEN:
                raise IntegrityError(f"tensor name {name[:40]!r} must be 1..{MAX_NAME_LEN} characters",
                                     reason=Reason.LAYOUT)
            if dtype not in DTYPES:
                raise IntegrityError(f"tensor {name!r} has dtype {dtype!r}; allowed dtypes are {sorted(DTYPES)}",
                                     reason=Reason.LAYOUT)
            if any(d < 0 for d in shape):
                raise IntegrityError(f"tensor {name!r} has a negative dimension in shape {list(shape)}",
                                     reason=Reason.LAYOUT)
            meta = TensorMeta(name, dtype, tuple(int(d) for d in shape), offset)
            tensors.append(meta)
            offset += meta.nbytes
        return cls(tuple(tensors))

    @classmethod
    def of(cls, state: Mapping[str, np.ndarray]) -> Layout:
        return cls.build([(name, dtype_name(a.dtype), tuple(a.shape)) for name, a in state.items()])

    @classmethod
    def from_proto(cls, manifest: tensor_pb2.Manifest) -> Layout:
        layout = cls.build([(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors])
        if manifest.total_bytes != layout.total_bytes:
            raise IntegrityError(
                f"manifest says {manifest.total_bytes} bytes but its tensors need {layout.total_bytes}",
                reason=Reason.LAYOUT)
        return layout

    def to_proto(self) -> tensor_pb2.Manifest:
        return tensor_pb2.Manifest(
            tensors=[tensor_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape) for t in self.tensors],
            total_bytes=self.total_bytes,
        )

    def require_same(self, other: Layout, *, what: str = "update") -> None:
        """Raise IntegrityError naming the first difference between two layouts."""
        if self == other:
            return
        mine = {t.name: t for t in self.tensors}
        theirs = {t.name: t for t in other.tensors}
        if missing := sorted(mine.keys() - theirs.keys()):
            raise IntegrityError(f"{what} lacks tensor(s) {missing[:5]} of the job's model", reason=Reason.LAYOUT)
        if extra := sorted(theirs.keys() - mine.keys()):
            raise IntegrityError(f"{what} has tensor(s) {extra[:5]} that the job's model does not have",
                                 reason=Reason.LAYOUT)
        for name, t in mine.items():
            o = theirs[name]
            if (t.dtype, t.shape) != (o.dtype, o.shape):
                raise IntegrityError(
                    f"{what} tensor {name!r} is {o.dtype}{list(o.shape)}; the job's model has {t.dtype}{list(t.shape)}",
                    reason=Reason.LAYOUT)


def encode(state: Mapping[str, np.ndarray]) -> tuple[Layout, bytearray]:
    """Lay a state dict out as (layout, blob); key order never changes the bytes. One copy of the model."""
    layout = Layout.of(state)
    blob = bytearray(layout.total_bytes)
    view = memoryview(blob)
    for t in layout.tensors:
        view[t.offset:t.offset + t.nbytes] = _tensor_bytes(state, t)
    return layout, blob


def _tensor_bytes(state: Mapping[str, np.ndarray], t: TensorMeta) -> np.ndarray:
    """Tensor t of state as little-endian bytes in its wire dtype (a view when it already is)."""
    return np.ascontiguousarray(state[t.name], dtype=DTYPES[t.dtype]).reshape(-1).view(np.uint8)


def encode_chunks(state: Mapping[str, np.ndarray], chunk_bytes: int = DEFAULT_CHUNK_BYTES
                  ) -> tuple[Layout, Iterator[tuple[int, bytes]]]:
    """What iter_chunks(encode(state)[1]) yields, without the model-sized blob: each chunk is
    copied straight from the tensors, so a sender holds its tensors and one chunk."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    layout = Layout.of(state)

    def chunks() -> Iterator[tuple[int, bytes]]:
        chunk, start = bytearray(), 0
        for t in layout.tensors:
            data = memoryview(_tensor_bytes(state, t))
            while data:
                if not chunk and len(data) >= chunk_bytes:   # a whole chunk inside one tensor: one copy
                    yield start, bytes(data[:chunk_bytes])
                    start, data = start + chunk_bytes, data[chunk_bytes:]
                    continue
                take = min(chunk_bytes - len(chunk), len(data))   # a chunk spanning tensor edges
                chunk += data[:take]
                data = data[take:]
                if len(chunk) == chunk_bytes:
                    yield start, bytes(chunk)
                    start += len(chunk)
                    chunk.clear()
        if chunk:
            yield start, bytes(chunk)

    return layout, chunks()


def decode(layout: Layout, blob: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """Views of a complete, already validated blob as named arrays (no copy)."""
    if len(blob) != layout.total_bytes:
        raise IntegrityError(f"blob has {len(blob)} bytes; the layout needs {layout.total_bytes}", reason=Reason.SIZE)
    return {
        t.name: np.frombuffer(blob, dtype=DTYPES[t.dtype], count=t.numel, offset=t.offset).reshape(t.shape)
        for t in layout.tensors
    }


def chunk_size(total_bytes: int, cap: int = DEFAULT_CHUNK_BYTES) -> int:
    """The chunk size for streaming a blob of total_bytes: at most `cap`, and small enough that a model
    crosses in at least CHUNKS_PER_MODEL chunks (a multiple of 64 KiB, at least 64 KiB). Each stream
    in flight holds a few chunks, so small models keep small buffers however many sites stream at once,
    while large ones still go in chunks big enough that per-message costs vanish."""
    want = -(-total_bytes // CHUNKS_PER_MODEL)
    return max(MIN_CHUNK_BYTES, min(cap, -(-want // MIN_CHUNK_BYTES) * MIN_CHUNK_BYTES))


def iter_chunks(blob: bytes | memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[int, memoryview]]:
    """(offset, slice) pairs covering the blob; slices share the blob's memory."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(blob)
    for offset in range(0, len(view), chunk_bytes):
        yield offset, view[offset:offset + chunk_bytes]


class Receiver:
    """Validates a blob arriving in chunks against an expected layout.

    Checks order and size (no gaps, no bytes beyond the layout), that no chunk is empty and the blob
    comes in at most `max_chunks` chunks (default chunk_limit(total)), and that every float is finite,
    element by element, even when chunk edges split an element. Valid bytes are handed to ``sink``;
    nothing is buffered beyond one element.
    """

    def __init__(self, layout: Layout, sink=None, *, max_chunks: int | None = None):
        self.layout = layout
        self.max_chunks = chunk_limit(layout.total_bytes) if max_chunks is None else max_chunks
        self.received = 0
        self.chunks = 0
        self.max_abs = 0.0
        self._sink = sink
        self._tensor = 0
        self._partial = bytearray()

    def feed(self, offset: int, data: bytes | memoryview) -> None:
        total = self.layout.total_bytes
        if not len(data):
            raise IntegrityError(f"empty chunk at byte {offset}; every chunk carries at least one byte",
                                 reason=Reason.SIZE)
        self.chunks += 1
        if self.chunks > self.max_chunks:
            raise IntegrityError(f"chunk {self.chunks} at byte {offset}: {total} bytes come in at most "
                                 f"{self.max_chunks} chunks (on average at least {MIN_AVERAGE_CHUNK_BYTES} bytes "
                                 "each); send larger chunks", reason=Reason.SIZE)
        if offset != self.received:
            raise IntegrityError(f"chunk at byte {offset} arrived out of order; expected byte {self.received}",
                                 reason=Reason.SIZE)
        if offset + len(data) > total:
            raise IntegrityError(
                f"received {offset + len(data)} bytes; the job's model needs exactly {total}", reason=Reason.SIZE)
        self._validate(offset, memoryview(data))
        self.received += len(data)
        if self._sink is not None:
            self._sink(data)

    def finish(self) -> None:
        if self.received != self.layout.total_bytes:
            raise IntegrityError(
                f"stream ended after {self.received} of {self.layout.total_bytes} bytes; the update is incomplete",
                reason=Reason.SIZE)

    def _validate(self, offset: int, data: memoryview) -> None:
        pos, end = offset, offset + len(data)
        tensors = self.layout.tensors
        while pos < end:
            while tensors[self._tensor].offset + tensors[self._tensor].nbytes <= pos:
                self._tensor += 1
            t = tensors[self._tensor]
            dtype = DTYPES[t.dtype]
            seg_end = min(end, t.offset + t.nbytes)
            if self._partial:
                take = min(dtype.itemsize - len(self._partial), seg_end - pos)
                self._partial += data[pos - offset:pos - offset + take]
                pos += take
                if len(self._partial) == dtype.itemsize:
                    self._check(t, np.frombuffer(bytes(self._partial), dtype=dtype))
                    self._partial.clear()
                continue
            whole = (seg_end - pos) // dtype.itemsize * dtype.itemsize
            if whole:
                self._check(t, np.frombuffer(data[pos - offset:pos - offset + whole], dtype=dtype))
                pos += whole
            if pos < seg_end:
                self._partial += data[pos - offset:seg_end - offset]
                pos = seg_end

    def _check(self, t: TensorMeta, values: np.ndarray) -> None:
        if values.size == 0:
            return
        # max and min propagate NaN and show ±Inf: two passes, no temporary arrays.
        high, low = float(values.max()), float(values.min())
        if values.dtype.kind == "f" and not (math.isfinite(high) and math.isfinite(low)):
            raise IntegrityError(f"tensor {t.name!r} contains NaN or Inf; refusing the update",
                                 reason=Reason.NON_FINITE)
        self.max_abs = max(self.max_abs, high, -low)


def assemble(layout: Layout, chunks: Iterable, into: bytearray | None = None) -> bytearray:
    """Validate chunks (objects with .offset and .data) into one complete blob for the layout: a new one,
    or `into` (exactly layout.total_bytes long) reused, which saves faulting in fresh pages every round."""
    if into is not None and len(into) != layout.total_bytes:
        raise ValueError(f"assemble: the buffer has {len(into)} bytes; the layout needs {layout.total_bytes}")
    blob = bytearray(layout.total_bytes) if into is None else into
    view = memoryview(blob)
    receiver = Receiver(layout)
    for chunk in chunks:
        receiver.feed(chunk.offset, chunk.data)
        view[chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
    receiver.finish()
    return blob
