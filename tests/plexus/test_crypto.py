"""Behaviour of plexus.crypto: key agreement, HKDF, AEAD failures, the PRG stream and ECDSA."""

import datetime as dt

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexus import crypto, errors, identity, pki

SEED = bytes(range(32))
NOW = dt.datetime(2025, 1, 15, 12, 0, tzinfo=dt.timezone.utc)


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    base = tmp_path_factory.mktemp("crypto")
    pki.init_federation(base / "pki", "Crypto Fed", now=NOW)
    pki.init_federation(base / "other", "Other Fed", now=NOW)
    return (
        identity.load_kit(pki.add_site(base / "pki", "alpha", now=NOW)),
        identity.load_kit(pki.add_site(base / "pki", "beta", now=NOW)),
        identity.load_kit(pki.add_site(base / "other", "alpha", now=NOW)),
    )


def chi_square_bytes(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    expected = len(data) / 256
    return float(((counts - expected) ** 2 / expected).sum())


# 255 degrees of freedom: mean 255, sd 22.6; 400 is > 6 sd, so a false alarm is ~1e-9.
CHI2_LIMIT = 400


# --- X25519 ------------------------------------------------------------------


def test_x25519_parties_agree_and_outsiders_differ():
    a_sk, a_pk = crypto.x25519_keypair()
    b_sk, b_pk = crypto.x25519_keypair()
    c_sk, c_pk = crypto.x25519_keypair()
    assert len(a_sk) == len(a_pk) == crypto.KEY_BYTES
    shared = crypto.x25519_shared(a_sk, b_pk)
    assert shared == crypto.x25519_shared(b_sk, a_pk)
    assert shared != crypto.x25519_shared(c_sk, b_pk)
    assert crypto.x25519_public(a_sk) == a_pk


@pytest.mark.parametrize("point", [bytes(32), b"\x01" + bytes(31)])
def test_x25519_refuses_small_order_points(point):
    sk, _ = crypto.x25519_keypair()
    with pytest.raises(errors.IntegrityError, match="small order"):
        crypto.x25519_shared(sk, point)


def test_x25519_checks_key_lengths():
    sk, pk = crypto.x25519_keypair()
    with pytest.raises(ValueError, match="32 bytes"):
        crypto.x25519_shared(sk, pk[:31])
    with pytest.raises(TypeError):
        crypto.x25519_shared(sk, "not bytes")


# --- HKDF ----------------------------------------------------------------------


def test_hkdf_needs_a_purpose_label():
    with pytest.raises(ValueError, match="purpose label"):
        crypto.hkdf(SEED, info=b"")
    with pytest.raises(TypeError):
        crypto.hkdf(SEED, info=None)


def test_hkdf_separates_labels_salts_and_lengths():
    mask = crypto.hkdf(SEED, info=crypto.SECAGG_MASK)
    assert len(mask) == 32 and mask == crypto.hkdf(SEED, info=crypto.SECAGG_MASK)
    assert mask != crypto.hkdf(SEED, info=crypto.SECAGG_SELF_MASK)
    assert mask != crypto.hkdf(SEED, info=crypto.SECAGG_MASK, salt=b"round 2")
    assert len(crypto.hkdf(SEED, info=crypto.SECAGG_SHARE_KEY, length=64)) == 64
    labels = {crypto.SECAGG_MASK, crypto.SECAGG_SELF_MASK, crypto.SECAGG_SHARE_KEY}
    assert len(labels) == 3 and all(label.startswith(b"plexus/v1/secagg-") for label in labels)


# --- AEAD ----------------------------------------------------------------------


KEY = crypto.hkdf(SEED, info=crypto.SECAGG_SHARE_KEY)
AAD = b"job|1|alpha|beta"


@pytest.mark.parametrize("plaintext", [b"", b"x", b"secret share bytes " * 7])
def test_aead_round_trip_with_fresh_nonces(plaintext):
    blob = crypto.aead_encrypt(KEY, plaintext, AAD)
    assert len(blob) == len(plaintext) + crypto.NONCE_BYTES + crypto.TAG_BYTES
    assert crypto.aead_decrypt(KEY, blob, AAD) == plaintext
    assert crypto.aead_encrypt(KEY, plaintext, AAD) != blob


def test_aead_detects_a_flipped_bit_anywhere():
    blob = crypto.aead_encrypt(KEY, b"twenty bytes of text", AAD)
    for i in range(len(blob)):
        for bit in (0x01, 0x80):
            bad = bytearray(blob)
            bad[i] ^= bit
            with pytest.raises(errors.IntegrityError):
                crypto.aead_decrypt(KEY, bytes(bad), AAD)


def test_aead_detects_truncation_extension_and_empty_input():
    blob = crypto.aead_encrypt(KEY, b"twenty bytes of text", AAD)
    for n in range(len(blob)):
        with pytest.raises(errors.IntegrityError):
            crypto.aead_decrypt(KEY, blob[:n], AAD)
    with pytest.raises(errors.IntegrityError):
        crypto.aead_decrypt(KEY, blob + b"\x00", AAD)
    with pytest.raises(errors.IntegrityError, match="truncated"):
        crypto.aead_decrypt(KEY, b"", AAD)


def test_aead_refuses_wrong_key_and_wrong_aad():
    blob = crypto.aead_encrypt(KEY, b"payload", AAD)
    with pytest.raises(errors.IntegrityError):
        crypto.aead_decrypt(crypto.hkdf(SEED, info=b"plexus/v1/other"), blob, AAD)
    with pytest.raises(errors.IntegrityError):
        crypto.aead_decrypt(KEY, blob, b"job|1|alpha|gamma")
    with pytest.raises(errors.IntegrityError):
        crypto.aead_decrypt(KEY, blob, b"")
    with pytest.raises(ValueError, match="32 bytes"):
        crypto.aead_decrypt(KEY[:16], blob, AAD)


# --- PRG -----------------------------------------------------------------------


def test_prg_matches_the_aes256_ctr_known_answer():
    # AES-256 of the zero block under the zero key (FIPS-197 style vector), read as little-endian uint32.
    expected = np.frombuffer(bytes.fromhex("dc95c078a2408989ad48a21492842087"), dtype="<u4")
    out = crypto.prg_uint32(bytes(32), 4)
    assert out.dtype == np.uint32 and out.flags.writeable
    np.testing.assert_array_equal(out, expected)


LONG_STREAM = crypto.prg_uint32(SEED, 4096)


@settings(max_examples=200)
@given(start=st.integers(0, 4096), count=st.integers(0, 4096))
def test_prg_any_window_is_a_slice_of_one_stream(start, count):
    count = min(count, 4096 - start)
    np.testing.assert_array_equal(crypto.prg_uint32(SEED, count, start=start), LONG_STREAM[start : start + count])


def test_prg_far_offsets_follow_the_counter():
    start = (1 << 40) + 3
    window = crypto.prg_uint32(SEED, 10, start=start)
    np.testing.assert_array_equal(crypto.prg_uint32(SEED, 7, start=start + 3), window[3:])


def test_prg_seeds_give_different_streams():
    other = crypto.prg_uint32(bytes(31) + b"\x01", 4096)
    assert np.count_nonzero(LONG_STREAM == other) < 5
    assert crypto.prg_uint32(SEED, 0).shape == (0,)
    with pytest.raises(ValueError):
        crypto.prg_uint32(SEED[:16], 4)
    with pytest.raises(ValueError):
        crypto.prg_uint32(SEED, -1)


def test_prg_output_looks_uniform():
    stream = crypto.prg_uint32(SEED, 1 << 18)  # 1 MiB
    assert chi_square_bytes(stream.tobytes()) < CHI2_LIMIT


# --- ECDSA ---------------------------------------------------------------------


def test_sign_verify_with_a_federation_kit(kits):
    alpha, beta, _ = kits
    message = b"plexus/v1/test message"
    signature = crypto.sign(alpha.key_pem, message)
    crypto.verify(alpha.cert_pem, message, signature)  # returns None, raises otherwise

    with pytest.raises(errors.IntegrityError):
        crypto.verify(alpha.cert_pem, message + b"!", signature)
    with pytest.raises(errors.IntegrityError):
        crypto.verify(beta.cert_pem, message, signature)
    for i in (0, len(signature) // 2, len(signature) - 1):
        bad = bytearray(signature)
        bad[i] ^= 0x01
        with pytest.raises(errors.IntegrityError):
            crypto.verify(alpha.cert_pem, message, bytes(bad))
    with pytest.raises(errors.IntegrityError):
        crypto.verify(alpha.cert_pem, message, b"")
    with pytest.raises(errors.IntegrityError):
        crypto.verify(b"not a certificate", message, signature)
    with pytest.raises(ValueError):
        crypto.sign(b"not a key", message)


# --- certificates of relayed messages (plexus.identity.verify_issued) ----------------


def test_verify_issued_checks_issuer_validity_and_identity(kits):
    alpha, beta, foreign = kits
    identity.verify_issued(alpha.cert_pem, alpha.ca_pem, name="alpha", kind="site", now=NOW)
    with pytest.raises(errors.IntegrityError, match="not issued by this federation's CA"):
        identity.verify_issued(foreign.cert_pem, alpha.ca_pem, name="alpha", kind="site", now=NOW)
    with pytest.raises(errors.IntegrityError, match="belongs to site 'beta'"):
        identity.verify_issued(beta.cert_pem, alpha.ca_pem, name="alpha", kind="site", now=NOW)
    with pytest.raises(errors.IntegrityError, match="belongs to site"):
        identity.verify_issued(alpha.cert_pem, alpha.ca_pem, name="alpha", kind="coordinator", now=NOW)
    for when in (NOW - dt.timedelta(days=1), NOW + pki.LEAF_VALIDITY + dt.timedelta(days=1)):
        with pytest.raises(errors.IntegrityError, match="not valid at"):
            identity.verify_issued(alpha.cert_pem, alpha.ca_pem, name="alpha", kind="site", now=when)
    with pytest.raises(errors.IntegrityError, match="cannot be parsed"):
        identity.verify_issued(b"garbage", alpha.ca_pem, name="alpha", kind="site", now=NOW)
