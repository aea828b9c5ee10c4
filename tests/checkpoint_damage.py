"""Ways a checkpoint file (safetensors: 8-byte header length, JSON header, data) gets damaged on disk,
shared by the store's unit tests and the coordinator's integration tests."""

from __future__ import annotations

import json

import numpy as np


def data_offset(path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def header(path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:data_offset(path)])


def _rewrite(path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at:at + len(data)] = data
    path.write_bytes(bytes(raw))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def garbage_header(path):
    _rewrite(path, 8, b"\xff\xfe garbage \x00\x01")


def huge_header_length(path):
    _rewrite(path, 0, (1 << 40).to_bytes(8, "little"))


def nan(path):
    _rewrite(path, data_offset(path), np.array([np.nan], np.float32).tobytes())


def bit_flip(path):
    at = data_offset(path) + 5
    _rewrite(path, at, bytes([path.read_bytes()[at] ^ 0x01]))   # a finite float, slightly wrong: a bad disk


def shape_swap(path):
    raw = path.read_bytes()
    end = data_offset(path)
    text = raw[8:end].replace(b'"shape":[4,3]', b'"shape":[3,4]')   # same size, different meaning
    path.write_bytes(raw[:8] + text + raw[end:])


DAMAGE = {"truncated": truncate, "garbage header": garbage_header, "huge header length": huge_header_length,
          "nan": nan, "bit flip": bit_flip, "shape swapped": shape_swap}
