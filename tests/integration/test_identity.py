"""Only leaf certificates the federation CA issued directly, for client auth, identify anyone.

Each attack builds its certificate with `cryptography` from keys an attacker could hold (a site's
own key, or an intermediate CA below the federation CA) and calls Join and NextTask over real mTLS.
"""

from __future__ import annotations

import datetime as dt

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from plexus import identity
from plexus.proto.plexus.v1 import federation_pb2 as fpb, federation_pb2_grpc

REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE)


def _load(root, kit):
    cert = x509.load_pem_x509_certificate((root / kit / ("ca.pem" if kit == "ca" else "cert.pem")).read_bytes())
    key = serialization.load_pem_private_key((root / kit / ("ca.key" if kit == "ca" else "key.pem")).read_bytes(),
                                             password=None)
    return cert, key


def _cert(subject_cn, issuer_cert, issuer_key, *, ou="site", ca=False, key_usage="leaf",
          eku=(ExtendedKeyUsageOID.CLIENT_AUTH,)):
    """A certificate for subject_cn in the federation's O, signed by issuer_key; returns (cert, key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    federation = issuer_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
    now = dt.datetime.now(dt.timezone.utc)
    signing = key_usage == "ca"
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn),
                                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, federation),
                                        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou)]))
               .issuer_name(issuer_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=30))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=signing,
                                            crl_sign=signing, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_cert.public_key()),
                              critical=False))
    if eku:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(eku)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def _pem(*certs) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def _calls(federation, chain: bytes, key) -> dict[str, grpc.StatusCode]:
    """Join and NextTask presenting `chain` with `key`; the status code of each (OK when accepted)."""
    ca = (federation.root / "ca" / "ca.pem").read_bytes()
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key_pem, certificate_chain=chain)
    codes = {}
    with grpc.secure_channel(federation.address, credentials) as channel:
        stub = federation_pb2_grpc.FederationStub(channel)
        for name, call in (("Join", lambda: stub.Join(fpb.JoinRequest(agent_version="evil"), timeout=10)),
                           ("NextTask", lambda: stub.NextTask(fpb.NextTaskRequest(wait_s=0.1), timeout=10))):
            try:
                call()
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[name] = exc.code()
    return codes


def _assert_refused(federation, chain, key):
    codes = _calls(federation, chain, key)
    assert all(code in REFUSED for code in codes.values()), codes
    assert "evil" not in {row[0] for row in federation.store.sites()}


def test_a_site_key_cannot_sign_a_usable_certificate(federation):
    site_cert, site_key = _load(federation.root, "sites/a")
    evil, evil_key = _cert("evil", site_cert, site_key)
    _assert_refused(federation, _pem(evil, site_cert), evil_key)
    _assert_refused(federation, _pem(evil), evil_key)


def test_a_leaf_below_an_intermediate_ca_identifies_no_one(federation):
    ca_cert, ca_key = _load(federation.root, "ca")
    intermediate, intermediate_key = _cert("intermediate", ca_cert, ca_key, ou="site", ca=True, key_usage="ca",
                                           eku=())
    evil, evil_key = _cert("evil", intermediate, intermediate_key)
    _assert_refused(federation, _pem(evil, intermediate), evil_key)


@pytest.mark.parametrize("flaw", ["ca_true", "server_auth_only", "no_eku"])
def test_a_direct_certificate_that_is_not_a_client_leaf_identifies_no_one(federation, flaw):
    ca_cert, ca_key = _load(federation.root, "ca")
    options = {"ca_true": {"ca": True}, "server_auth_only": {"eku": (ExtendedKeyUsageOID.SERVER_AUTH,)},
               "no_eku": {"eku": ()}}[flaw]
    evil, evil_key = _cert("evil", ca_cert, ca_key, **options)
    _assert_refused(federation, _pem(evil), evil_key)


def test_an_honest_site_still_joins(federation):
    site_cert, site_key = _load(federation.root, "sites/a")
    assert set(_calls(federation, _pem(site_cert), site_key).values()) == {grpc.StatusCode.OK}


def test_every_certificate_pki_issues_is_a_leaf_with_client_auth(pki_root):
    for path in [pki_root / "coordinator", *(pki_root / "sites").iterdir(), *(pki_root / "admins").iterdir()]:
        cert = x509.load_pem_x509_certificate((path / "cert.pem").read_bytes())
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False, path
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        assert usage.digital_signature and not usage.key_cert_sign and not usage.crl_sign, path
        assert ExtendedKeyUsageOID.CLIENT_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        identity.check_leaf(cert.public_bytes(serialization.Encoding.PEM),
                       (pki_root / "ca" / "ca.pem").read_bytes())
