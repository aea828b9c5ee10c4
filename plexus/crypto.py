"""Plexus's one crypto module: X25519, HKDF, AES-GCM, an AES-CTR stream and ECDSA.

Only this module (and plexus.pki and plexus.identity, for X.509) imports `cryptography.hazmat`.
Keys are always derived with HKDF and a purpose label; verification raises
plexus.errors.IntegrityError, it never returns a bool. Randomness comes from
the OS (`os.urandom` inside pyca), never from numpy.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography import x509
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from plexus.errors import IntegrityError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16

# HKDF purpose labels of secure aggregation; one label per kind of key.
SECAGG_SHARE_KEY = b"plexus/v1/secagg-share-key"
SECAGG_MASK = b"plexus/v1/secagg-mask"
SECAGG_SELF_MASK = b"plexus/v1/secagg-self-mask"

_MAX_HKDF_LENGTH = 255 * 32


def _check_bytes(value: object, what: str, length: int | None = None) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, not {type(value).__name__}")
    value = bytes(value)
    if length is not None and len(value) != length:
        raise ValueError(f"{what} must be {length} bytes, got {len(value)}")
    return value


def x25519_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as (private raw 32 bytes, public raw 32 bytes)."""
    private = x25519.X25519PrivateKey.generate()
    return (
        private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        ),
        private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw),
    )


def x25519_public(private: bytes) -> bytes:
    """The raw public key of a raw X25519 private key."""
    private = _check_bytes(private, "X25519 private key", KEY_BYTES)
    key = x25519.X25519PrivateKey.from_private_bytes(private)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def x25519_shared(private: bytes, peer_public: bytes) -> bytes:
    """Raw X25519 shared secret; IntegrityError for a low-order peer key (all-zero result).

    The result is not a key: feed it to `hkdf` with a purpose label.
    """
    private = _check_bytes(private, "X25519 private key", KEY_BYTES)
    peer_public = _check_bytes(peer_public, "X25519 public key", KEY_BYTES)
    key = x25519.X25519PrivateKey.from_private_bytes(private)
    try:
        shared = key.exchange(x25519.X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:  # OpenSSL refuses the all-zero secret of a small-order point
        shared = bytes(KEY_BYTES)
    if not any(shared):
        raise IntegrityError("the peer's X25519 public key has small order (all-zero shared secret); refuse it")
    return shared


def hkdf(secret: bytes, *, info: bytes, salt: bytes = b"", length: int = 32) -> bytes:
    """HKDF-SHA-256 of `secret`; `info` is a mandatory purpose label such as SECAGG_MASK."""
    secret = _check_bytes(secret, "secret")
    info = _check_bytes(info, "info")
    salt = _check_bytes(salt, "salt")
    if not info:
        raise ValueError("hkdf needs a non-empty purpose label as info, e.g. b'plexus/v1/secagg-mask'")
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"length must be an int, not {type(length).__name__}")
    if not 1 <= length <= _MAX_HKDF_LENGTH:
        raise ValueError(f"length must be between 1 and {_MAX_HKDF_LENGTH}, got {length}")
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt or None, info=info).derive(secret)


def aead_encrypt(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM; returns nonce (12 random bytes) || ciphertext || tag."""
    key = _check_bytes(key, "AEAD key", KEY_BYTES)
    plaintext = _check_bytes(plaintext, "plaintext")
    aad = _check_bytes(aad, "aad")
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def aead_decrypt(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """Open an `aead_encrypt` blob; IntegrityError on any tampering, wrong key, wrong aad or truncation."""
    key = _check_bytes(key, "AEAD key", KEY_BYTES)
    blob = _check_bytes(blob, "ciphertext")
    aad = _check_bytes(aad, "aad")
    if len(blob) < NONCE_BYTES + TAG_BYTES:
        raise IntegrityError(
            f"ciphertext is {len(blob)} bytes, shorter than nonce + tag ({NONCE_BYTES + TAG_BYTES}); it was truncated"
        )
    try:
        return AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except InvalidTag:
        raise IntegrityError(
            "ciphertext failed authentication (tampered, truncated, wrong key or wrong context)"
        ) from None


def prg_uint32(seed: bytes, count: int, *, start: int = 0) -> np.ndarray:
    """Elements [start, start+count) of the little-endian uint32 AES-256-CTR keystream keyed by `seed`."""
    return prg_words(seed, count, 32, start=start)


PRG_WORD_BITS = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def prg_words(seed: bytes, count: int, bits: int, *, start: int = 0) -> np.ndarray:
    """Elements [start, start+count) of the AES-256-CTR keystream keyed by `seed`, read as little-endian
    `bits`-bit words (8, 16 or 32): the same stream for every width, cut into words of that size.

    The counter starts at zero with no nonce: safe only because every seed is a
    single-purpose HKDF output used for one stream. Any window equals the same
    slice of one long stream, so masks can be made chunk by chunk.
    """
    seed = _check_bytes(seed, "PRG seed", KEY_BYTES)
    if bits not in PRG_WORD_BITS or isinstance(bits, bool):
        raise ValueError(f"bits must be one of {sorted(PRG_WORD_BITS)}, got {bits!r}")
    for name, value in (("count", count), ("start", start)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    count, start, size = int(count), int(start), bits // 8
    block, skip = divmod(size * start, 16)
    if block + (skip + size * count + 15) // 16 > 1 << 128:
        raise ValueError("the PRG stream is 2**132 bytes long; start + count exceeds it")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(block.to_bytes(16, "big"))).encryptor()
    total = skip + size * count
    raw = np.empty(total + 15, dtype=np.uint8)   # update_into wants block_size - 1 bytes of slack
    encryptor.update_into(bytes(total), raw)     # keystream = AES-CTR of zeros, written in place (no copy)
    # writable; native order on little-endian hosts
    return raw[skip:total].view(f"<u{size}").view(PRG_WORD_BITS[bits])


def sign(private_key_pem: bytes, message: bytes) -> bytes:
    """ECDSA P-256 / SHA-256 signature (DER) of `message` with a PEM private key."""
    private_key_pem = _check_bytes(private_key_pem, "private key PEM")
    message = _check_bytes(message, "message")
    try:
        key = serialization.load_pem_private_key(private_key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the private key is not an unencrypted PEM key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError("signing needs an ECDSA P-256 key, as issued by `plexus pki`")
    return key.sign(message, ec.ECDSA(hashes.SHA256()))


def verify(cert_pem: bytes, message: bytes, signature: bytes) -> None:
    """Check an ECDSA P-256 / SHA-256 signature by the certificate's key; IntegrityError if it fails.

    This checks the signature only; whether the certificate itself is trusted is
    plexus.identity.verify_issued's job.
    """
    cert_pem = _check_bytes(cert_pem, "certificate PEM")
    message = _check_bytes(message, "message")
    signature = _check_bytes(signature, "signature")
    try:
        public = x509.load_pem_x509_certificate(cert_pem).public_key()
    except ValueError:
        raise IntegrityError("the signer's certificate is not a PEM certificate") from None
    if not isinstance(public, ec.EllipticCurvePublicKey) or not isinstance(public.curve, ec.SECP256R1):
        raise IntegrityError("the signer's certificate does not hold an ECDSA P-256 key")
    try:
        public.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise IntegrityError(
            "signature verification failed: message or signature altered, or signed by another key"
        ) from None
