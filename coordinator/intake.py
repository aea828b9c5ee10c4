"""Upload intake: an update (or a masked input) validated chunk by chunk and folded into its round's sum
while it streams.

Every validated chunk goes into the upload's journal (a spool file) before it is folded, so the journal
always holds what the fold may have to take out again: `withdraw` is the one way an update that fails,
is refused, or is still arriving when its round closes leaves the sum. Under DP-FedAvg the update's
distance from the global model is summed as it streams too, so the clip check needs no second pass.

A stream held in memory whole (the calls `plexus simulate` makes in process) is its own journal: `receive`
is given a way to read its chunks' bytes again (`replay`), and no spool file is created, written and unlinked
for it (at 1M parameters and 128 sites, a fifth of the simulator's time went to that). The checks and the
fold are the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from plexus.dp import Distance
from plexus.wire import Layout, Receiver

SPOOL_READ_BYTES = 4 << 20


def read_blocks(path: Path) -> Iterator[bytes]:
    """A spool file's bytes in blocks of SPOOL_READ_BYTES."""
    with open(path, "rb") as fh:
        while block := fh.read(SPOOL_READ_BYTES):
            yield block


class Upload:
    """One upload in progress: `layout` is what it must match; `fold` (a Fold or MaskedFold, or None for
    rules that hold every update) takes each chunk as it arrives; `distance` (DP) measures it as well. Its
    journal is the spool file `journal`, or the stream itself (`receive`'s `replay`)."""

    def __init__(self, layout: Layout, journal: Path, *, fold=None, distance: Distance | None = None,
                 owner: object = None, weight: int = 0, metrics: dict | None = None):
        self.layout, self.journal, self.fold, self.distance = layout, journal, fold, distance
        self._replay: Callable[[], Iterable] | None = None   # the journal, for a stream held in memory
        self._receiver: Receiver | None = None               # ... of which its first `received` bytes came in
        self.owner = owner               # whatever the driver ties the upload to (its round)
        self.weight = weight             # what it weighs in its sum
        self.metrics = metrics or {}     # the site's metrics, recorded once it is accepted
        self.kept = False                # accepted into its sum, or kept on disk: withdraw does nothing
        self._folding = threading.Lock()  # one fold at a time: a chunk's, or `move`'s

    def receive(self, chunks: Iterable[tuple[int, bytes]], *,
                replay: Callable[[], Iterable] | None = None) -> None:
        """Stream (offset, data) chunks through a Receiver into the journal, each folded (and measured) once
        it is in the file; IntegrityError on the first bad chunk, whatever `chunks` raises as it is.
        `replay()`, for a stream held in memory whole and unchanging until the upload ends, gives the chunks'
        bytes again from the first: then the stream is the journal, and no file is written."""
        if replay is not None:
            self._replay = replay
            self._take(chunks, lambda data: None, lambda: None)
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
        receiver = self._receiver = Receiver(self.layout, sink=sink)
        for offset, data in chunks:
            receiver.feed(offset, data)
        receiver.finish()

    def _blocks(self) -> Iterator:
        """The journal's bytes so far, in pieces: the spool file's, or the stream's again, up to what was received."""
        if self._replay is None:
            yield from read_blocks(self.journal)
            return
        left, stream = self._receiver.received, iter(self._replay())
        while left > 0 and (data := next(stream, None)) is not None:   # nothing past it is read (or parsed)
            piece = memoryview(data)[:left]
            left -= len(piece)
            yield piece

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
        if self._replay is not None:   # held in memory: on disk now, as a streamed one is
            with open(held, "wb") as fh:
                fh.writelines(self._blocks())
            self._replay = None
        else:
            self.journal.rename(held)
        self.kept = True
        return held

    def discard(self) -> None:
        if self._replay is not None:
            self._replay = None
        else:
            self.journal.unlink(missing_ok=True)
