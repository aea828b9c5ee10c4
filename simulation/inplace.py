"""Chunk messages read in place: an update's or a model's data as a view of the serialized message, not a copy.

Protobuf copies a bytes field out of the message it parses, and again into a new bytes object each time the field
is read. In a simulation every update and every served model crosses as serialized messages in memory: the
simulator reads an update's chunks in place in the worker's shared memory, and a worker's virtual sites read a
served model's chunks in place in the worker's shared memory. The shared memory lays each message out to end on an
aligned boundary (simulation.arena.END_ALIGN), so that a chunk's data, its last field, starts aligned: numpy reads
it at full speed, where unaligned it copied it through a buffer first. Figures: docs/performance.md ("The
simulation moves each update through main memory as few times as it can")."""

from __future__ import annotations

from dataclasses import dataclass

from plexus.errors import IntegrityError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import Layout, chunk_limit


@dataclass(frozen=True)
class _Chunk:
    offset: int
    data: memoryview


@dataclass(frozen=True)
class ChunkMessage:
    """An UpdateMessage or ModelMessage whose body is a chunk, as their readers read one (WhichOneof,
    .chunk.offset, .chunk.data), with the data a view of the serialized message."""

    chunk: _Chunk

    def WhichOneof(self, group: str) -> str:   # noqa: N802 (protobuf's name)
        if group != "body":
            raise ValueError(f"a chunk message has no oneof {group!r}")
        return "chunk"


def chunk_in_place(message) -> ChunkMessage | None:
    """An UpdateMessage or ModelMessage holding only a chunk (both: `oneof body {header = 1; Chunk chunk = 2}`),
    read without copying its data, if it is serialized the way protobuf writes one (chunk = field 2, in it the
    offset = field 1 then the data = field 2, each at most once, nothing else); None for anything else, which
    protobuf then parses (and refuses, if it is malformed)."""
    view = memoryview(message).cast("B")
    end = len(view)
    if end < 2 or view[0] != 0x12:        # field 2 (chunk), length-delimited
        return None
    length, at = _varint(view, 1)
    if length is None or at + length != end:
        return None
    offset = 0
    if at < end and view[at] == 0x08:     # chunk.offset: field 1, varint
        offset, at = _varint(view, at + 1)
        if offset is None or offset >= 1 << 64:
            return None
    data = view[at:at]
    if at < end and view[at] == 0x12:     # chunk.data: field 2, length-delimited
        size, at = _varint(view, at + 1)
        if size is None or at + size > end:
            return None
        data, at = view[at:at + size], at + size
    return ChunkMessage(_Chunk(offset, data)) if at == end else None


def _varint(view: memoryview, at: int) -> tuple[int | None, int]:
    """A base-128 varint at `at`: (its value, the index after it), or (None, at) if it runs past the end or
    past 10 bytes."""
    value = 0
    for shift in range(0, 70, 7):
        if at >= len(view):
            return None, at
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
    return None, at


def serialized(message) -> bytes:
    """A message's bytes (a message already serialized stays as it is)."""
    return message if isinstance(message, (bytes, bytearray, memoryview)) else message.SerializeToString()


# What a chunk message adds to its data at most: its tags and lengths (1 + 5 + 1 + 10 + 1 + 5 bytes) and the gap
# that aligns its end in the arena (simulation.arena.END_ALIGN, < 64).
CHUNK_OVERHEAD = 23 + 63


def update_bytes(header) -> int:
    """At most the bytes of the update stream that `header` (an UpdateMessage with its header) begins: its
    manifest's data, its chunks' overhead (at most one chunk per MIN_AVERAGE_CHUNK_BYTES, as the coordinator
    allows), and the header itself; 0 for anything else (a stream whose size it does not say)."""
    if not isinstance(header, fpb.UpdateMessage) or header.WhichOneof("body") != "header":
        return 0
    try:
        total = Layout.from_proto(header.header.manifest).total_bytes
    except (IntegrityError, ValueError, KeyError):
        return 0
    return header.ByteSize() + CHUNK_OVERHEAD + total + CHUNK_OVERHEAD * chunk_limit(total)
