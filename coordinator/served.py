"""The model sites fetch: one wire blob, held in memory or read from its checkpoint file.

Either way it is handed out the same way (`ServedModel.chunks`): slices of the blob in memory, or
reads of the file, in which case every download shares the page cache and the coordinator holds no
copy of the model. Under compression.downlink the blob is the model encoded (fp16, or an 8-bit delta
against a model the site holds: coordinator.downlink), and says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from plexus.errors import IntegrityError
from plexus.wire import Layout, chunk_size, iter_chunks


@dataclass(frozen=True)
class Held:
    """The model a site says it holds (FetchModelRequest.have_round, have_sha256): what a delta may apply to."""

    round: int
    sha256: bytes


@dataclass(frozen=True)
class ServedModel:
    """A served model: `layout` and its bytes, in `blob` or at `start` in the file `path`; `encoding` says how
    they make the model ("dense": they are it; "fp16"; "delta8", "delta4": against the model of `base_round`, or
    against zeros if `zero_base`), and `sha256`, when set, is that of the decoded model's wire blob (delta codec
    jobs: the site checks it)."""

    layout: Layout
    blob: object = None            # a bytes-like wire blob, or None when served from `path`
    path: Path | None = None
    start: int = 0
    encoding: str = "dense"
    base_round: int = 0
    sha256: bytes = b""
    zero_base: bool = False

    @classmethod
    def in_memory(cls, layout: Layout, blob, *, encoding: str = "dense", base_round: int = 0,
                  sha256: bytes = b"", zero_base: bool = False) -> ServedModel:
        return cls(layout, blob=blob, encoding=encoding, base_round=base_round, sha256=sha256, zero_base=zero_base)

    @classmethod
    def from_file(cls, layout: Layout, path: Path, start: int) -> ServedModel:
        """A checkpoint file whose blob begins at byte `start`."""
        return cls(layout, path=Path(path), start=start)

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of consecutive chunks of at most chunk_bytes (smaller for small models:
        plexus.wire.chunk_size)."""
        total = self.layout.total_bytes
        chunk_bytes = chunk_size(total, chunk_bytes)
        if self.path is None:
            for offset, piece in iter_chunks(self.blob, chunk_bytes):
                yield offset, bytes(piece)
            return
        with open(self.path, "rb") as fh:
            fh.seek(self.start)
            for offset in range(0, total, chunk_bytes):
                data = fh.read(min(chunk_bytes, total - offset))
                if len(data) != min(chunk_bytes, total - offset):
                    raise IntegrityError(f"checkpoint {self.path} is shorter than its header says")
                yield offset, data
