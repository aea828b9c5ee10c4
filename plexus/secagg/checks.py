"""Argument checks shared by the secure-aggregation modules: wrong type -> TypeError, wrong value -> ValueError."""

from __future__ import annotations

from collections.abc import Iterable

from plexus import crypto, errors


def not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def check_int(value: object, name: str) -> None:
    if not_int(value):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")


def check_str(value: object, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")


def key_bytes(value: object, name: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != crypto.KEY_BYTES:
        raise ValueError(f"{name} must be {crypto.KEY_BYTES} raw bytes")
    return bytes(value)


def site_set(sites: object, what: str) -> frozenset[str]:
    if isinstance(sites, (str, bytes)) or not isinstance(sites, Iterable):
        raise TypeError(f"{what} must be a list of site names")
    sites = list(sites)
    if not all(isinstance(s, str) for s in sites):
        raise TypeError(f"{what} must be a list of site names")
    if len(set(sites)) != len(sites):
        raise errors.IntegrityError(f"{what} names a site twice: {sorted(sites)}")
    return frozenset(sites)
