"""The frames between the simulator and its workers: a small JSON header and a body of protobuf messages.

A frame is `u32 header length, header (JSON object), u32 message count, then per message u64 length and its
serialized bytes`. Tensors travel only inside protobuf messages (wire.py's chunks), never in JSON, and
nothing is pickled: a worker trusts only what it parses.
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

MAX_HEADER_BYTES = 1 << 20


class FrameError(ValueError):
    """A frame that cannot be read: the other end wrote something else, or went away mid-frame."""


def write_frame(out: BinaryIO, header: dict, messages: list[bytes] = ()) -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [struct.pack(">I", len(head)), head, struct.pack(">I", len(messages))]
    for message in messages:
        parts += [struct.pack(">Q", len(message)), message]
    out.write(b"".join(parts))
    out.flush()


def read_frame(source: BinaryIO) -> tuple[dict, list[bytes]] | None:
    """The next frame, or None at a clean end of the stream (between frames)."""
    first = source.read(4)
    if not first:
        return None
    (size,) = struct.unpack(">I", _exactly(source, 4, first))
    if size > MAX_HEADER_BYTES:
        raise FrameError(f"a frame header of {size} bytes is over the limit of {MAX_HEADER_BYTES}")
    header = json.loads(_exactly(source, size))
    if not isinstance(header, dict):
        raise FrameError("a frame header must be a JSON object")
    (count,) = struct.unpack(">I", _exactly(source, 4))
    messages = []
    for _ in range(count):
        (length,) = struct.unpack(">Q", _exactly(source, 8))
        messages.append(_exactly(source, length))
    return header, messages


def _exactly(source: BinaryIO, size: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < size:
        more = source.read(size - len(data))
        if not more:
            raise FrameError(f"the stream ended inside a frame ({len(data)} of {size} bytes)")
        data += more
    return bytes(data)
