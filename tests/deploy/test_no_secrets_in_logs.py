"""A whole demo run's logs hold no private key material, in any encoding we can think of."""

from __future__ import annotations

import base64
import json

from cryptography.hazmat.primitives import serialization


def test_demo_logs_hold_no_private_key_bytes(demo_run):
    """Over the session's one whole demo run with JSON logs (conftest demo_run: four hospitals, 20 rounds)."""
    workdir, result = demo_run.workdir, demo_run.result
    assert result.returncode == 0, (result.stdout + result.stderr).decode(errors="replace")
    logs = {p.name: p.read_bytes() for p in (workdir / "logs").glob("*.log")}
    assert {"coordinator.log", "site-cleveland.log", "site-hungary.log"} <= set(logs)
    haystacks = [*logs.values(), result.stdout, result.stderr]
    keys = sorted((workdir / "pki").rglob("*.key")) + sorted((workdir / "pki").rglob("key.pem"))
    assert len(keys) >= 5   # the CA, the coordinator, the sites (two at least), the operator
    needles = []
    for path in keys:
        pem = path.read_bytes()
        body = [line for line in pem.splitlines() if line and not line.startswith(b"-----")]
        der = serialization.load_pem_private_key(pem, password=None).private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        needles += [(path, "PEM body line", line) for line in body]
        needles += [(path, "DER", der), (path, "DER hex", der.hex().encode()),
                    (path, "DER base64", base64.b64encode(der))]
    assert needles
    for path, what, needle in needles:
        for hay in haystacks:
            assert needle not in hay, f"{what} of {path} appears in the logs"
    assert all(b"PRIVATE KEY" not in hay for hay in haystacks)
    # Logs are JSON lines (plain prints to stdout aside) with job/round/site-bearing messages.
    coordinator = [json.loads(line) for line in logs["coordinator.log"].splitlines() if line.startswith(b"{")]
    assert coordinator and all({"time", "level", "logger", "message"} <= set(e) for e in coordinator)
