"""Fixtures for integration tests; the machinery lives in harness.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator import aggregate
from plexus import pki

from integration.harness import HOSPITAL_OF, Federation, Processes


@pytest.fixture(scope="session")
def pki_root(tmp_path_factory) -> Path:
    """One federation CA for the session: sites a-d, an operator and a viewer."""
    root = tmp_path_factory.mktemp("pki") / "federation"
    pki.init_federation(root, "test-federation", hosts=["127.0.0.1"])
    for name in HOSPITAL_OF:
        pki.add_site(root, name)
    pki.add_admin(root, "ops", role="operator")
    pki.add_admin(root, "viewer", role="viewer")
    return root


@pytest.fixture
def federation(pki_root, tmp_path):
    fed = Federation(pki_root, tmp_path / "state")
    yield fed
    fed.close()


@pytest.fixture
def procs(tmp_path):
    """Child `plexus` processes for the test, logging into tmp_path; all stopped at its end."""
    p = Processes(tmp_path)
    yield p
    p.stop_all()


@pytest.fixture
def masked_blobs(monkeypatch):
    """Every masked input the coordinator's masked sum took in whole: (its layout, its bytes as received)."""
    seen, pieces = [], {}
    add, finish = aggregate.MaskedFold.add, aggregate.MaskedFold.finish

    def recording_add(self, piece, max_abs=0.0):
        pieces.setdefault(id(self), []).append(bytes(piece))
        return add(self, piece, max_abs)

    def recording_finish(self):
        finish(self)
        seen.append((self.total.layout, b"".join(pieces.pop(id(self)))))

    monkeypatch.setattr(aggregate.MaskedFold, "add", recording_add)
    monkeypatch.setattr(aggregate.MaskedFold, "finish", recording_finish)
    return seen
