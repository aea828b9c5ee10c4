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
MAX_MESSAGE_BYTES = 1 << 31   # far above any chunk or request: a larger length means the stream is out of step


class FrameError(ValueError):
    """A frame that cannot be read: the other end wrote something else, or went away mid-frame."""


def write_frame(out: BinaryIO, header: dict, messages: list[bytes] = ()) -> None:
    """Write one frame; a message is written as it is (a model-sized one is not copied into the frame)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    _write_all(out, struct.pack(">I", len(head)) + head + struct.pack(">I", len(messages)))
    for message in messages:
        _write_all(out, struct.pack(">Q", len(message)))
        _write_all(out, message)
    out.flush()


def _write_all(out: BinaryIO, data) -> None:
    """All of `data`: an unbuffered (raw) stream may take only part of it, when a signal lands mid-write (the
    process stopped and continued: Ctrl-Z then fg, a profiler attaching), and says how much it took."""
    view = memoryview(data).cast("B")
    while view:
        view = view[out.write(view):]


def read_frame(source: BinaryIO) -> tuple[dict, list[bytes]] | None:
    """The next frame, or None at a clean end of the stream (between frames). Its messages are bytearrays, read
    in place (protobuf parses them as they are)."""
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
        if length > MAX_MESSAGE_BYTES:
            raise FrameError(f"a frame message of {length} bytes is over the limit of {MAX_MESSAGE_BYTES}: the stream "
                             "is out of step")
        messages.append(_exactly(source, length))
    return header, messages


def _exactly(source: BinaryIO, size: int, start: bytes = b"") -> bytearray:
    data = bytearray(size)
    data[:len(start)] = start
    view, done = memoryview(data), len(start)
    while done < size:
        got = source.readinto(view[done:])
        if not got:
            raise FrameError(f"the stream ended inside a frame ({done} of {size} bytes)")
        done += got
    return data
