"""Upload intake: an update (or a masked input) validated chunk by chunk and folded into its round's sum
while it streams.

Every validated chunk goes into the upload's journal (a spool file) before it is folded, so the journal
always holds what the fold may have to take out again: `withdraw` is the one way an update that fails,
is refused, or is still arriving when its round closes leaves the sum. Under DP-FedAvg the update's
distance from the global model is summed as it streams too, so the clip check needs no second pass.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
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
    rules that hold every update) takes each chunk as it arrives; `distance` (DP) measures it as well."""

    def __init__(self, layout: Layout, journal: Path, *, fold=None, distance: Distance | None = None,
                 owner: object = None, weight: int = 0, metrics: dict | None = None):
        self.layout, self.journal, self.fold, self.distance = layout, journal, fold, distance
        self.owner = owner               # whatever the driver ties the upload to (its round)
        self.weight = weight             # what it weighs in its sum
        self.metrics = metrics or {}     # the site's metrics, recorded once it is accepted
        self.kept = False                # accepted into its sum, or kept on disk: withdraw does nothing
        self._folding = threading.Lock()  # one fold at a time: a chunk's, or `move`'s

    def receive(self, chunks: Iterable[tuple[int, bytes]]) -> None:
        """Stream (offset, data) chunks through a Receiver into the journal, each folded (and measured) once
        it is in the file; IntegrityError on the first bad chunk, whatever `chunks` raises as it is."""
        with open(self.journal, "wb") as fh:
            def sink(data) -> None:
                fh.write(data)
                if self.fold is not None:
                    fh.flush()
                    with self._folding:
                        self.fold.add(data, receiver.max_abs)   # the running max, this chunk included
                if self.distance is not None:
                    self.distance.add(data)
            receiver = Receiver(self.layout, sink=sink)
            for offset, data in chunks:
                receiver.feed(offset, data)
            receiver.finish()

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
            self.fold.undo(lambda: read_blocks(self.journal))

    def move(self, fold) -> None:
        """Fold this upload into another sum from now on (an asynchronous buffer flushed while it streamed):
        what it folded so far comes out of its old sum and goes into `fold`, read back from the journal,
        and the chunks still to come follow it there. Call with the engine lock held, before it is accepted."""
        with self._folding:
            old, folded = self.fold, self.fold.position
            old.undo(lambda: read_blocks(self.journal))
            done = 0
            for block in read_blocks(self.journal):
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
        self.journal.rename(held)
        self.kept = True
        return held

    def discard(self) -> None:
        self.journal.unlink(missing_ok=True)
