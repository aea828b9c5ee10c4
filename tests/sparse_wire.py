"""Hand-made wires of the sparse codecs (topk, adacomp) for tests, written out plainly rather than with the
codec's own code."""

from __future__ import annotations

import numpy as np

from plexus.wire import DTYPES


def gap_wire(codec: str, indices, values, *, scale: float = 1.0, dtype: str = "U16",
             tensor: str = "w") -> dict[str, np.ndarray]:
    """<tensor>/<codec>.gaps, .scale and .values for sorted indices and int8 values, gaps of `dtype`, with a
    filler (value 0) wherever a gap would exceed the dtype's largest."""
    most = {"U8": 255, "U16": 65535}[dtype]
    gaps, q, last = [], [], -1
    for i, v in zip(np.asarray(indices).tolist(), np.asarray(values).tolist()):
        while i - last > most:
            last += most
            gaps.append(most)
            q.append(0)
        gaps.append(i - last)
        q.append(v)
        last = i
    return {f"{tensor}/{codec}.gaps": np.array(gaps, DTYPES[dtype]),
            f"{tensor}/{codec}.scale": np.array([scale], np.float32),
            f"{tensor}/{codec}.values": np.array(q, np.int8)}
