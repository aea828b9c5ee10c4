"""Updates and models between the simulator and a worker through shared memory instead of its pipes.

Through a pipe, a 40 MB update is copied into the kernel and out again in 64 KiB pieces, each a pair of
wake-ups; with 32 sites a round that was most of the simulation's CPU. Each worker process has instead two
memory files (memfd) of its own, created by the simulator's ProcessPool and inherited by the worker:
- up: the worker copies an answer's messages into a free region of it (`ArenaWriter.place`) and sends, in the
  call's frame, only where they lie; the simulator reads them in place (`ArenaReader.views`) and the worker
  reuses the region once the simulator has replied to the call, or said that it holds it back (and has then
  copied them);
- down: the simulator places a large reply (a served model) there, and reuses the region once the worker says
  it has parsed it (a `free` frame).

Nothing but message bytes lives there; the frame's header says where, and the simulator checks that every
region lies inside the file before reading it. A worker that dies takes its file with it: no name in
/dev/shm is left behind. The Ray backend keeps its frames whole (its actors may be on other machines), and
so does a system without memfd_create (not Linux).
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

SUPPORTED = hasattr(os, "memfd_create")   # Linux; elsewhere every message travels in its frame
ENV = "PLEXUS_SIMULATION_ARENA_FD"         # the worker's up arena
DOWN_ENV = "PLEXUS_SIMULATION_DOWN_ARENA_FD"
MIN_BYTES = 256 << 10   # answers smaller than this travel in their frame: copying them twice costs less
ALIGN = 1 << 12
# Each placed message ends on this boundary: the bytes field a chunk ends with (its data) then starts aligned when
# its length is a multiple of 8 (a whole number of float64 or int64 values), and numpy reads it in place at full
# speed. Unaligned, its reductions and casts copied every value through a buffer first.
END_ALIGN = 64


class ArenaError(ValueError):
    """A frame's arena region that cannot be read: the other end wrote something else."""


def create(name: str) -> int:
    """A new, empty memory file for one worker (inheritable only through `pass_fds`)."""
    return os.memfd_create(name, os.MFD_CLOEXEC)


def owned(messages: list) -> list:
    """`messages` as the simulator's own bytes: those read in place from an arena are copied out, since their
    region is the worker's again once the call is replied to (or held)."""
    return [bytes(m) if isinstance(m, memoryview) else m for m in messages]


def messages_of(header: dict, messages: list, reader: ArenaReader | None) -> list:
    """The messages a frame carries: its own, or those its header's `arena` entry places (popped from it) in the
    reader's file."""
    if "arena" not in header:
        return messages
    if reader is None:
        raise ArenaError("a frame refers to shared memory this process was not given")
    return reader.views(header.pop("arena"))


class ArenaWriter:
    """The writing side (the worker for its answers, the simulator for large replies): regions of the memory file,
    each free or lent to one call. Thread-safe."""

    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()
        self._regions: list[list] = []   # [offset, size, call or None], in file order, covering the file
        self._map: mmap.mmap | None = None
        self._size = 0
        self.placed = 0   # bytes of messages placed so far

    def place(self, call: int, messages: list[bytes]) -> dict | None:
        """Copy `messages` into a free region lent to `call`, laid out as `stream` lays them out; the frame
        header's `arena` entry saying where, or None if they are small enough to travel in the frame."""
        total = sum(len(m) for m in messages)
        if total < MIN_BYTES:
            return None
        placing = self.stream(call, total + (END_ALIGN - 1) * len(messages))   # room for every gap
        for message in messages:
            placing.add(message)
        return placing.done()

    def stream(self, call: int, size: int) -> Placing:
        """A region of at least `size` bytes lent to `call`, to be filled message by message as they are made
        (`Placing.add`, each ending on an END_ALIGN boundary) and ended by `Placing.done`: a message goes there
        from the processor's cache, not from a list of them all in main memory."""
        with self._lock:
            offset = self._lend(call, size)
            return Placing(self, call, offset, -(-size // ALIGN) * ALIGN, memoryview(self._map))

    def release(self, call: int) -> None:
        """The reader is done with `call`'s region (the simulator replied or holds a copy; the worker parsed a
        reply): free it for the next."""
        with self._lock:
            for region in self._regions:
                if region[2] == call:
                    region[2] = None
            self._merge()

    def _trim(self, offset: int, used: int) -> None:
        """The region at `offset` keeps its first `used` bytes (rounded up to ALIGN; none: all of it is free)."""
        used = -(-used // ALIGN) * ALIGN
        with self._lock:
            for index, region in enumerate(self._regions):
                if region[0] == offset:
                    if used == 0:
                        region[2] = None
                    elif region[1] > used:
                        self._regions.insert(index + 1, [offset + used, region[1] - used, None])
                        region[1] = used
                    break
            self._merge()

    def _merge(self) -> None:
        """Neighbouring free regions become one. Call with the lock held."""
        merged: list[list] = []
        for region in self._regions:
            if merged and merged[-1][2] is None and region[2] is None:
                merged[-1][1] += region[1]
            else:
                merged.append(region)
        self._regions = merged

    def _lend(self, call: int, size: int) -> int:
        size = -(-size // ALIGN) * ALIGN
        for index, region in enumerate(self._regions):
            if region[2] is None and region[1] >= size:
                if region[1] > size:   # the rest stays free
                    self._regions.insert(index + 1, [region[0] + size, region[1] - size, None])
                region[1], region[2] = size, call
                return region[0]
        if self._regions and self._regions[-1][2] is None:   # a free tail grows into what is needed
            tail = self._regions.pop()
            offset = tail[0]
        else:
            offset = self._size
        self._grow(offset + size)
        self._regions.append([offset, size, call])
        return offset

    def close(self) -> None:
        with self._lock:
            self._map = None
            os.close(self._fd)

    def _grow(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        # the old map is not closed: a call may still be copying into it (outside the lock); it goes with its last view
        self._map, self._size = mmap.mmap(self._fd, size), size


class Placing:
    """A region being filled as an answer's messages are made (ArenaWriter.stream). Not thread-safe: one caller."""

    def __init__(self, writer: ArenaWriter, call: int, offset: int, size: int, view: memoryview):
        self._writer, self._call, self._offset, self._size, self._view = writer, call, offset, size, view
        self._sizes: list[int] = []
        self._skips: list[int] = []
        self._at = 0   # bytes of the region used so far

    def add(self, message) -> None:
        skip = -(self._at + len(message)) % END_ALIGN
        end = self._at + skip + len(message)
        if end > self._size:   # more than the caller foresaw: a region twice the size, what is written moved there
            self._move(2 * end)
        start = self._offset + self._at + skip
        self._view[start:start + len(message)] = message
        self._sizes.append(len(message))
        self._skips.append(skip)
        self._at = end

    def done(self) -> dict:
        """The frame header's `arena` entry for the messages added; the region's unused end is free again."""
        self._writer._trim(self._offset, self._at)
        with self._writer._lock:
            self._writer.placed += sum(self._sizes)
        return {"offset": self._offset, "sizes": self._sizes, "skips": self._skips}

    def _move(self, size: int) -> None:
        writer = self._writer
        with writer._lock:
            offset = writer._lend(self._call, size)
            view = memoryview(writer._map)
        view[offset:offset + self._at] = self._view[self._offset:self._offset + self._at]
        writer._trim(self._offset, 0)   # the old region: free
        self._offset, self._size, self._view = offset, -(-size // ALIGN) * ALIGN, view


class ArenaReader:
    """The reading side of one memory file, mapped again whenever the writer has made it larger."""

    def __init__(self, fd: int):
        self._fd = fd
        self._map: mmap.mmap | None = None
        self.read = 0   # bytes of messages read in place so far

    def views(self, spec) -> list[memoryview]:
        """The messages a frame's `arena` entry places, read in place: valid until the writer reuses the region
        (the simulator's replies once it has replied to the call; a worker's once it says `free`). All of one
        call's views are of one object (`.obj`), alive while any of them is: the worker frees a reply's region
        when it goes (SiteHost.receive)."""
        try:
            offset, sizes = int(spec["offset"]), [int(s) for s in spec["sizes"]]
            skips = [int(s) for s in spec.get("skips", [0] * len(sizes))]
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ArenaError(f"a frame's arena entry must be {{offset, sizes, skips}}; got {spec!r:.200}") from exc
        if len(skips) != len(sizes) or any(not 0 <= s < END_ALIGN for s in skips):
            raise ArenaError(f"a frame's arena entry needs one skip in [0, {END_ALIGN}) per message; "
                             f"got {skips[:8]} for {len(sizes)} message(s)")
        end = offset + sum(sizes) + sum(skips)
        if offset < 0 or any(s < 0 for s in sizes):
            raise ArenaError(f"a frame's arena region cannot be negative (offset {offset}, sizes {sizes[:8]})")
        if self._map is None or end > len(self._map):
            size = os.fstat(self._fd).st_size
            if end > size:
                raise ArenaError(f"a frame's arena region ends at byte {end}, past the {size}-byte shared file")
            self._map = mmap.mmap(self._fd, size, prot=mmap.PROT_READ)   # the old one goes with its last view
        if end == offset:
            return [b""] * len(sizes)
        region = np.frombuffer(self._map, np.uint8, count=end - offset, offset=offset)   # see the docstring
        whole, out, at = memoryview(region), [], 0
        for size, skip in zip(sizes, skips):
            at += skip
            out.append(whole[at:at + size])
            at += size
        self.read += sum(sizes)
        return out

    def close(self) -> None:
        self._map = None
        os.close(self._fd)
