"""Upload intake: an update (or a masked input) validated chunk by chunk and folded into its round's sum
while it streams.

Every validated chunk goes into the upload's journal (a spool file) before it is folded, so the journal
always holds what the fold may have to take out again: `withdraw` is the one way an update that fails,
is refused, or is still arriving when its round closes leaves the sum. Under DP-FedAvg the update's
distance from the global model is summed as it streams too, so the clip check needs no second pass.

An engine whose uploads all arrive in its own process, one or two at a time (`plexus simulate`'s), keeps
journals in memory instead (MemoryJournals): a few buffers, each reused upload after upload. The update is
then copied once into memory already in use, where a spool file would be created, written and unlinked for
each (at 1M parameters and 128 sites, a quarter of the simulator's time went to that). The fold is the same.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from plexus.dp import Distance
from plexus.wire import Layout, Receiver

SPOOL_READ_BYTES = 4 << 20
KEPT_BUFFERS = 4   # free journal buffers MemoryJournals keeps for the next uploads; more are let go


def read_blocks(path: Path) -> Iterator[bytes]:
    """A spool file's bytes in blocks of SPOOL_READ_BYTES."""
    with open(path, "rb") as fh:
        while block := fh.read(SPOOL_READ_BYTES):
            yield block


class MemoryJournals:
    """Journal buffers lent to uploads and given back when they end (see the module docstring). Thread-safe."""

    def __init__(self):
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            return self._free.pop() if self._free else bytearray()

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            if len(self._free) < KEPT_BUFFERS:
                self._free.append(buffer)


class Upload:
    """One upload in progress: `layout` is what it must match; `fold` (a Fold or MaskedFold, or None for
    rules that hold every update) takes each chunk as it arrives; `distance` (DP) measures it as well. Its
    journal is the spool file `journal`, or a buffer from `memory` (a `keep` writes the file then)."""

    def __init__(self, layout: Layout, journal: Path, *, fold=None, distance: Distance | None = None,
                 owner: object = None, weight: int = 0, metrics: dict | None = None,
                 memory: MemoryJournals | None = None):
        self.layout, self.journal, self.fold, self.distance = layout, journal, fold, distance
        self._memory = memory
        self._buffer: bytearray | None = None   # the journal, when in memory: its first `_size` bytes
        self._size = 0
        self.owner = owner               # whatever the driver ties the upload to (its round)
        self.weight = weight             # what it weighs in its sum
        self.metrics = metrics or {}     # the site's metrics, recorded once it is accepted
        self.kept = False                # accepted into its sum, or kept on disk: withdraw does nothing
        self._folding = threading.Lock()  # one fold at a time: a chunk's, or `move`'s

    def receive(self, chunks: Iterable[tuple[int, bytes]]) -> None:
        """Stream (offset, data) chunks through a Receiver into the journal, each folded (and measured) once
        it is in the file; IntegrityError on the first bad chunk, whatever `chunks` raises as it is."""
        if self._memory is not None:
            buffer = self._memory.take()
            if len(buffer) < self.layout.total_bytes:   # the whole upload's size, once: no growing on the way
                buffer = bytearray(self.layout.total_bytes)
            self._buffer, self._size = buffer, 0
            self._take(chunks, self._append, lambda: None)
            return
        with open(self.journal, "wb") as fh:
            self._take(chunks, fh.write, fh.flush)

    def _take(self, chunks, write, flush) -> None:
        def sink(data) -> None:
            write(data)
            if self.fold is not None:
                flush()
                with self._folding:
                    self.fold.add(data, receiver.max_abs)   # the running max, this chunk included
            if self.distance is not None:
                self.distance.add(data)
        receiver = Receiver(self.layout, sink=sink)
        for offset, data in chunks:
            receiver.feed(offset, data)
        receiver.finish()

    def _append(self, data) -> None:
        end = self._size + len(data)
        if end > len(self._buffer):   # a new, larger buffer (a view of the old one may still be read: `move`)
            grown = bytearray(end)
            grown[:self._size] = memoryview(self._buffer)[:self._size]
            self._buffer = grown
        self._buffer[self._size:end] = data
        self._size = end

    def _blocks(self) -> Iterator:
        """The journal's bytes so far, in blocks of SPOOL_READ_BYTES."""
        if self._buffer is None:
            yield from read_blocks(self.journal)
            return
        buffer, size = self._buffer, self._size
        for at in range(0, size, SPOOL_READ_BYTES):
            yield memoryview(buffer)[at:min(at + SPOOL_READ_BYTES, size)]

    @property
    def norm(self) -> float:
        """Its distance from the global model: measured by `distance`, or, for a compressed Δ, by its fold."""
        return self.distance.norm if self.distance is not None else self.fold.norm

    def accept(self) -> None:
        """The upload is complete and accepted: it counts in the sum for good."""
        if self.fold is not None:
            self.fold.finish()
        self.kept = True

    def withdraw(self) -> None:
        """Take whatever of it is in the sum back out (nothing once accepted or kept). Call with the engine
        lock held, before the journal is removed."""
        if self.fold is not None and not self.kept:
            self.fold.undo(self._blocks)

    def move(self, fold) -> None:
        """Fold this upload into another sum from now on (an asynchronous buffer flushed while it streamed):
        what it folded so far comes out of its old sum and goes into `fold`, read back from the journal,
        and the chunks still to come follow it there. Call with the engine lock held, before it is accepted."""
        with self._folding:
            old, folded = self.fold, self.fold.position
            old.undo(self._blocks)
            done = 0
            for block in self._blocks():
                piece = memoryview(block)[:folded - done]
                if len(piece):
                    fold.add(piece, old.peak)
                done += len(piece)
                if done >= folded:
                    break
            self.fold = fold

    def keep(self) -> Path:
        """Keep the complete upload on disk (rules that need every update at once); its new path."""
        held = self.journal.with_suffix(".held")
        if self._buffer is not None:   # in memory: on disk now, as a streamed one is
            with open(held, "wb") as fh:
                fh.write(memoryview(self._buffer)[:self._size])
            self._give_back()
        else:
            self.journal.rename(held)
        self.kept = True
        return held

    def discard(self) -> None:
        if self._memory is not None:
            self._give_back()
        else:
            self.journal.unlink(missing_ok=True)

    def _give_back(self) -> None:
        if self._buffer is not None:
            self._memory.give(self._buffer)
            self._buffer, self._size = None, 0
